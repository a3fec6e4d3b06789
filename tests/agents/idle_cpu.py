"""Measure the agent's CPU use while idle between trials (real controller + real agent on loopback).

    .venv/bin/python -m tests.agents.idle_cpu [--seconds 60] [--heartbeat 5]

Starts ``kernelctl serve`` (SQLite) and one ``kernelctl agent`` with /metrics on, waits until it registered
and settled, then reads utime+stime of the agent process from /proc/PID/stat over the window.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

from kernelpack.signing import generate_keypair
from tests import dbutil
from tests.agents.agentutil import AgentProcess, wait_for
from tests.controller.serverutil import ControllerProcess


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--heartbeat", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        kp = generate_keypair(tmp / "keys")
        trusted = tmp / "trusted"
        trusted.mkdir()
        (trusted / kp.public_path.name).write_bytes(kp.public_path.read_bytes())
        with dbutil.fresh_database("sqlite", tmp) as url, \
                ControllerProcess(url, tmp, heartbeat_seconds=args.heartbeat) as ctl:
            ov = tmp / "inv.json"
            ov.write_text('{"arch": "sm_90", "driver_version": "550.54.15", "cuda_version": "12.4"}')
            agent = AgentProcess(tmp, controller_url=ctl.url, token=ctl.tokens["enroll"], trusted_keys=trusted,
                                 node_name="idle-1", overrides=ov,
                                 env={"KERNELCTL_AGENT_METRICS_PORT": str(free_port())}).start()
            try:
                op = ctl.client("operator")
                wait_for(lambda: op.get("/v1/nodes").json(), 120, "registration")
                time.sleep(max(10.0, 2 * args.heartbeat))  # settle
                assert agent.proc is not None
                pid = agent.proc.pid
                c0, t0 = cpu_seconds(pid), time.monotonic()
                time.sleep(args.seconds)
                c1, t1 = cpu_seconds(pid), time.monotonic()
                beats = agent.log_text().count("/v1/agents/heartbeat")
            finally:
                agent.stop()
    used = c1 - c0
    print(f"agent idle CPU: {used:.2f} s over {t1 - t0:.1f} s wall = {100 * used / (t1 - t0):.3f}% of one core "
          f"(heartbeat every {args.heartbeat:g}s, /metrics on; {beats} heartbeats in the log)")


if __name__ == "__main__":
    main()
