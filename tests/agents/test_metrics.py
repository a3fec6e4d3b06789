"""The agent's /metrics endpoint (real HTTP server on a free loopback port): names, labels, values."""

from __future__ import annotations

import httpx

from agents.metrics import AgentMetrics


def test_metrics_served_and_off_by_default() -> None:
    m = AgentMetrics()
    assert m.serve(0) is None  # port 0: disabled
    port = m.serve(_free(), addr="127.0.0.1")
    try:
        m.trials.labels("crash").inc()
        m.trial_duration.observe(12.5)
        m.outbox_depth.set(3)
        m.heartbeat_failures.inc(2)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        m.close()
    assert 'kernelctl_agent_trials_total{outcome="crash"} 1.0' in text
    assert "kernelctl_agent_trial_duration_seconds_count 1.0" in text
    assert "kernelctl_agent_outbox_depth 3.0" in text
    assert "kernelctl_agent_heartbeat_failures_total 2.0" in text
    for line in text.splitlines():  # no per-node labels anywhere
        if line.startswith("kernelctl_agent") and "{" in line:
            assert "node=" not in line


def _free() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
