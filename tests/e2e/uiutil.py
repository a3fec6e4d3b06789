"""Helpers for the browser tests: a small fleet of simulated nodes speaking the real agent protocol over
HTTP to a real controller, and a headless Debian chromium driven through its chromedriver.

The nodes do what ``controller.sim_fleet``'s agents do, in one thread: register with the enrollment token,
heartbeat, switch to the desired active version at once, and when the heartbeat reply carries a trial spec,
send a trial report whose candidate/stable latency ratio is ``exp(effect + N(0, noise))``. The controller's
judge (real) decides on those reports.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests import provision
from tests.controller.serverutil import ControllerProcess, inventory

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SimNode:
    name: str
    arch: str
    driver: str
    gpu_name: str
    client: httpx.Client | None = None
    active: dict[str, Any] | None = None
    staged: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_trial: float = 0.0
    trials: int = 0


class SimFleet:
    """Simulated nodes in one background thread (``start``/``stop``); ``effect`` is ln(candidate/stable)."""

    def __init__(self, ctl: ControllerProcess, nodes: list[SimNode], *, period: float = 0.3,
                 trial_every: float = 0.3, effect: float = 0.0, noise: float = 0.01, seed: int = 7) -> None:
        self.ctl, self.nodes, self.period, self.trial_every = ctl, nodes, period, trial_every
        self.effect, self.noise = effect, noise
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.reports_accepted = 0
        # candidate version -> a failing numeric check its trials report (outcome numeric_error)
        self.numeric_faults: dict[str, dict[str, Any]] = {}

    def register(self) -> None:
        for n in self.nodes:
            with self.ctl.client("enroll") as c:
                inv = inventory(n.arch, driver=n.driver)
                inv["gpu_name"] = n.gpu_name
                r = c.post("/v1/agents/register", json={"node_name": n.name, "inventory": inv})
                assert r.status_code == 200, r.text
            n.client = self.ctl.client(token=r.json()["node_token"])

    def start(self) -> SimFleet:
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for n in self.nodes:
            if n.client is not None:
                n.client.close()

    def active_versions(self) -> dict[str, str | None]:
        return {n.name: (n.active or {}).get("version") for n in self.nodes}

    def _run(self) -> None:
        while not self._stop.is_set():
            for n in self.nodes:
                try:
                    self._round(n)
                except httpx.HTTPError as exc:  # the controller may be busy; the next round retries
                    self.errors.append(f"{n.name}: {type(exc).__name__}: {exc}")
            self._stop.wait(self.period)

    def _round(self, n: SimNode) -> None:
        assert n.client is not None
        body = {"node_name": n.name, "staged": list(n.staged.values()), "active": [n.active] if n.active else []}
        r = n.client.post("/v1/agents/heartbeat", json=body)
        if r.status_code != 200:
            self.errors.append(f"{n.name}: heartbeat {r.status_code} {r.text[:200]}")
            return
        reports = []
        for d in r.json().get("desired", []):
            for ref in (d["active"], d.get("stable")):
                if ref is not None:
                    n.staged[ref["version"]] = ref
            n.active = d["active"]
            trial = d.get("trial")
            now = time.monotonic()
            if trial is not None and d["role"] == "candidate" and now - n.last_trial >= self.trial_every:
                n.last_trial = now
                reports.append(self._report(n, trial))
        if reports:
            rr = n.client.post("/v1/agents/reports", json={"node_name": n.name, "reports": reports})
            if rr.status_code == 200:
                self.reports_accepted += rr.json()["accepted"]
            else:
                self.errors.append(f"{n.name}: reports {rr.status_code} {rr.text[:200]}")

    def _report(self, n: SimNode, trial: dict[str, Any]) -> dict[str, Any]:
        n.trials += 1
        ratio = math.exp(self.effect + self.rng.gauss(0.0, self.noise))
        stable_s = 1e-4 * (1 + 0.05 * self.rng.random())
        fault = self.numeric_faults.get(trial["candidate"]["version"])
        if fault is not None:
            return {"idempotency_key": f"ui-{n.name}-{n.trials}-{self.rng.getrandbits(32):08x}",
                    "rollout_id": trial["rollout_id"], "stratum": trial["stratum"], "candidate": trial["candidate"],
                    "stable": trial["stable"], "outcome": "numeric_error",
                    "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.2,
                    "latency": [], "numerics": [fault]}
        return {
            "idempotency_key": f"ui-{n.name}-{n.trials}-{self.rng.getrandbits(32):08x}",
            "rollout_id": trial["rollout_id"], "stratum": trial["stratum"],
            "candidate": trial["candidate"], "stable": trial["stable"], "outcome": "ok",
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.2,
            "latency": [{"op": "bias_gelu", "tokens": 8, "stable_s": stable_s, "candidate_s": stable_s * ratio}],
            "numerics": [{"op": "bias_gelu", "dtype": "fp16", "shape": {"M": 8, "N": 64}, "max_abs_err": 1e-4,
                          "max_rel_err": 1e-3, "within_tolerance": True}],
        }


# ------------------------------------------------------------------------------------------ browser
def start_chromium(download_dir: Path | None = None):  # type: ignore[no-untyped-def]
    """A headless chromium WebDriver session (selenium, through Debian's chromedriver: installed with apt-get when
    missing, tests/provision.py; selenium downloads nothing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = provision.chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,1000", "--disable-extensions", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--metrics-recording-only"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver, log_output=str(download_dir / "chromedriver.log") if download_dir else None)
    return webdriver.Chrome(service=service, options=opts)


def artifacts_dir() -> Path:
    """Where the browser tests write screenshots (``KERNELCTL_TEST_ARTIFACTS`` or test-artifacts/ui)."""
    root = Path(os.environ.get("KERNELCTL_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))
    out = root / "ui"
    out.mkdir(parents=True, exist_ok=True)
    return out


def full_page_screenshot(driver, path: Path) -> None:  # type: ignore[no-untyped-def]
    """A screenshot of the whole page (the window grows to the document's height first)."""
    height = driver.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    driver.set_window_size(1440, max(900, min(int(height) + 40, 6000)))
    time.sleep(0.2)
    driver.save_screenshot(str(path))
    driver.set_window_size(1440, 1000)
