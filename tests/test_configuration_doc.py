"""docs/configuration.md's table is exactly what ``kernelctl config show --markdown`` prints (defaults rendered for a
user whose home is /home/user, no KERNELCTL_* variable set): a setting added, removed or re-described without the
doc fails here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli.config import markdown
from kernelctl.settings import Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_configuration_doc_is_the_generated_table(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KERNELCTL_")] + ["XDG_DATA_HOME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/user")
    generated = markdown(Settings())
    documented = "".join(line for line in DOC.read_text().splitlines(keepends=True) if line.startswith("|"))
    assert documented == generated, (
        "docs/configuration.md's table differs from `kernelctl config show --markdown`; regenerate it with "
        "`env -u XDG_DATA_HOME HOME=/home/user kernelctl config show --markdown` (no KERNELCTL_* set):\n" + generated)
