"""A test cut short by pytest-timeout leaves no process behind (tests/reaper.py): a pytest run whose test starts a
process that starts another in a session of its own, then times out, ends with both stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import reaper

REPO_ROOT = Path(__file__).resolve().parents[1]

ORPHANING_TEST = textwrap.dedent('''
    import os, subprocess, sys, time

    # a child in a session of its own that starts a grandchild in another: stopping the child's process group
    # orphans the grandchild (as the demo's controller and agents were when the demo was killed)
    CHILD = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
             "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)")

    def test_cut_short_by_the_timeout():
        subprocess.Popen([sys.executable, "-c", CHILD, os.environ["PIDFILE"]], start_new_session=True)
        time.sleep(600)
''')


def test_a_timed_out_test_leaves_no_process_behind(tmp_path: Path) -> None:
    (tmp_path / "test_orphans.py").write_text(ORPHANING_TEST)
    pidfile = tmp_path / "grandchild.pid"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.reaper", "-p", "no:cacheprovider", "-o", "addopts=",
         "--timeout", "5", "--rootdir", str(tmp_path), str(tmp_path / "test_orphans.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PIDFILE": str(pidfile), "PYTHONPATH": str(REPO_ROOT)})
    grandchild = int(pidfile.read_text())
    try:
        assert run.returncode == 1 and "Timeout" in run.stdout, run.stdout[-2000:]
        assert "stopped 2 process(es) that tests left running" in run.stderr, run.stderr[-2000:]
        assert not Path(f"/proc/{grandchild}").exists(), "the grandchild outlived the test run"
    finally:
        reaper.stop_processes([grandchild])
