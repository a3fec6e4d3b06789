"""What ``kernelctl demo`` shows while it runs: a Rich live view on a terminal (:class:`LiveView`), timestamped
plain lines when the output is not a terminal or ``--json`` keeps stdout for the summary (:class:`PlainView`).

Both show the same things as soon as they happen: the phase, the controller's page and a viewer token (while the
controller runs), each rollout with its strata (state, step, clean samples so far against what the judge needs,
the slowest trial, the judge's latest word), canaries per phase, and each planned rollout as waiting, running,
ok or unexpected. Text that came from the controller is escaped (kernelctl.console).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kernelctl.console import clean, esc
from kernelctl.vocab import CANARY_PHASES, PROMOTED, TERMINAL_STATES

PLAIN_EVERY_S = 15.0  # a plain status line per running stratum at least this often


@dataclass
class StratumProgress:
    """One stratum of the running rollout, as shown."""

    stratum: str
    state: str
    step: int  # 1-based
    steps: int
    samples: int  # clean trial reports so far (the judge's samples)
    needed: int | None  # clean reports the judge needs to pass (a measured figure), None: one failure decides
    trials: int  # trial reports so far
    slowest_trial_s: float
    quiet_s: float  # seconds since the stratum's latest report (or the rollout's start)
    verdict: str  # the judge's latest word

    def line(self) -> str:
        samples = (f"{self.samples}/~{self.needed} clean samples" if self.needed is not None
                   else f"{self.trials} trial report(s)")
        last = (f", slowest trial {self.slowest_trial_s:.0f}s, last report {self.quiet_s:.0f}s ago" if self.trials
                else "")
        return f"{self.stratum}: {self.state}, step {self.step}/{self.steps}, {samples}{last}; judge: {self.verdict}"


@dataclass
class RolloutProgress:
    """The running rollout, as shown."""

    rollout_id: int
    ref: str
    state: str
    seconds: float
    strata: list[StratumProgress] = field(default_factory=list)
    by_version: dict[str, int] = field(default_factory=dict)  # nodes per active version
    phases: dict[str, int] = field(default_factory=dict)  # canaries per phase


@dataclass
class Planned:
    """One rollout the demo will run, and how it went (``state`` None: not started yet)."""

    ref: str
    expected: str
    state: str | None = None
    reason: str | None = None
    ended: bool = False  # the demo no longer follows it (it ended, or the demo stopped on a problem)

    @property
    def status(self) -> str:
        if self.state is None:
            return "waiting"
        if not self.ended:
            return "running"
        return "ok" if self.state == self.expected else "unexpected"


STATUS_STYLE = {"waiting": "dim", "running": "yellow", "ok": "green", "unexpected": "bold red"}


class View(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def phase(self, text: str) -> None: ...
    def link(self, url: str, viewer_token: str) -> None: ...
    def rollout(self, progress: RolloutProgress) -> None: ...
    def planned(self, plans: list[Planned]) -> None: ...


class LiveView:
    """The Rich live view (a terminal): redrawn four times a second."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.t0 = time.monotonic()
        self._phase = "starting"
        self._link: str | None = None
        self._progress: RolloutProgress | None = None
        self._plans: list[Planned] = []
        self._live = Live(get_renderable=self.render, console=console, refresh_per_second=4, transient=False)

    def start(self) -> None:
        self._live.start()

    def stop(self) -> None:
        self._live.stop()

    def phase(self, text: str) -> None:
        self._phase = text

    def link(self, url: str, viewer_token: str) -> None:
        self._link = f"follow it in a browser: {url}/ui/  (viewer token {viewer_token})"

    def rollout(self, progress: RolloutProgress) -> None:
        self._progress = progress

    def planned(self, plans: list[Planned]) -> None:
        self._plans = plans

    def render(self) -> Group:
        parts: list[Any] = [Panel(Text(f"{self._phase}   ({time.monotonic() - self.t0:.0f}s elapsed)"),
                                  title="kernelctl demo", expand=False)]
        if self._link:
            parts.append(Text(self._link))
        p = self._progress
        if p is not None:
            table = Table(title=f"rollout {p.rollout_id}: {esc(p.ref)}  {esc(p.state)}  ({p.seconds:.0f}s)",
                          expand=False)
            for col in ("stratum", "state", "step", "samples", "", "slowest trial", "latest verdict"):
                table.add_column(col, overflow="fold")
            for s in p.strata:
                done = s.state in TERMINAL_STATES
                if s.needed is None:
                    samples, bar = f"{s.trials} report(s)", ""
                else:
                    samples = f"{s.samples}/~{s.needed}"
                    bar = _bar(1.0 if s.state == PROMOTED else min(1.0, s.samples / s.needed), 12)
                table.add_row(Text(clean(s.stratum)), Text(clean(s.state), style="green" if done else ""),
                              f"{s.step}/{s.steps}", samples, bar,
                              f"{s.slowest_trial_s:.0f}s" if s.trials else "-", Text(clean(s.verdict)))
            parts.append(table)
            if p.by_version:
                parts.append(Text("nodes by active version: " + ", ".join(f"{k}={n}" for k, n in p.by_version.items())))
            if p.phases:  # trial before serve: staged (trialled, not served) -> verified -> serving
                parts.append(Text("canaries by phase: " + ", ".join(
                    f"{ph}={p.phases[ph]}" for ph in CANARY_PHASES if ph in p.phases)))
        for plan in self._plans:
            status = plan.status
            line = Text(f"{plan.ref}: ")
            line.append(status, style=STATUS_STYLE[status])
            line.append(f" (expected {plan.expected}" + (f", {plan.state})" if plan.state else ")"))
            if plan.reason and status != "waiting":
                line.append(f" {clean(plan.reason)}")
            parts.append(line)
        return Group(*parts)


def _bar(fraction: float, width: int) -> str:
    full = round(fraction * width)
    return "█" * full + "░" * (width - full)


class PlainView:
    """Timestamped lines (output redirected, or ``--json``: on stderr): each phase when it starts, the page's
    address as soon as the controller is up, each running stratum when it changes and every ``PLAIN_EVERY_S``."""

    def __init__(self, console: Console, every_s: float = PLAIN_EVERY_S) -> None:
        self.console = console
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._said: dict[str, tuple[tuple[Any, ...], float]] = {}
        self._states: dict[str, str | None] = {}

    def _print(self, text: str) -> None:
        self.console.print(Text(f"[{time.monotonic() - self.t0:5.0f}s] {clean(text)}"), soft_wrap=True,
                           highlight=False)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def phase(self, text: str) -> None:
        self._print(text)

    def link(self, url: str, viewer_token: str) -> None:
        self._print(f"follow it in a browser: {url}/ui/  (viewer token {viewer_token})")

    def rollout(self, progress: RolloutProgress) -> None:
        now = time.monotonic()
        for s in progress.strata:
            key = f"{progress.rollout_id}:{s.stratum}"
            changed = (s.state, s.step, s.samples, s.trials)
            last = self._said.get(key)
            if last is None or last[0] != changed or now - last[1] >= self.every_s:
                self._said[key] = (changed, now)
                self._print(f"rollout {progress.rollout_id} {progress.ref} ({progress.seconds:.0f}s) {s.line()}")

    def planned(self, plans: list[Planned]) -> None:
        for plan in plans:
            if self._states.get(plan.ref) != plan.state and plan.status in ("ok", "unexpected"):
                self._print(f"{plan.ref}: {plan.status}: {plan.state} (expected {plan.expected})"
                            + (f" {plan.reason}" if plan.reason else ""))
            self._states[plan.ref] = plan.state
