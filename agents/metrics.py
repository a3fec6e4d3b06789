"""Prometheus metrics of one agent (own registry; served on ``agent_metrics_port`` when it is not 0).

Names carry the ``kernelctl_agent_`` prefix; labels are bounded (outcome, reason), never a node or bundle.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("kernelctl.agent.metrics")


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.trials = Counter("kernelctl_agent_trials", "Trials finished, by outcome.", ["outcome"], registry=r)
        self.trial_duration = Histogram(
            "kernelctl_agent_trial_duration_seconds", "Wall time of one trial (child start to result).",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200), registry=r,
        )
        self.trials_skipped = Counter(
            "kernelctl_agent_trials_skipped", "Trials the agent postponed, by reason.", ["reason"], registry=r
        )
        self.outbox_depth = Gauge("kernelctl_agent_outbox_depth", "Reports not yet acknowledged.", registry=r)
        self.heartbeat_failures = Counter(
            "kernelctl_agent_heartbeat_failures", "Heartbeats that failed after retries.", registry=r
        )
        self.reports_sent = Counter(
            "kernelctl_agent_reports_sent", "Reports acknowledged by the controller.", registry=r
        )
        self.bundles_refused = Counter(
            "kernelctl_agent_bundles_refused", "Downloads refused by verification.", registry=r
        )
        self.trial_running = Gauge("kernelctl_agent_trial_running", "1 while a trial child runs.", registry=r)
        self._server: Any = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int | None:
        """Start the /metrics HTTP server (no-op for port 0); returns the bound port."""
        if port == 0:
            return None
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
