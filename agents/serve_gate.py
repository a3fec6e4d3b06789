"""Node-local gates before serving: the agent judges its own trial of a candidate before its serving processes
switch to it.

Peak memory and launches per call are deterministic measurements of the node's trial, so the node that
measured a regression does not wait for the controller's judge (which decides the same gates fleet-wide over
many reports, ``controller/gates.py``, and rolls the stratum back): it never serves the candidate, reports
the trial as usual (its ``detail`` starts with the verdict) and keeps serving the stable version. Over every
(op, tokens) cell the trial measured (its ``resources``, at the profiled sizes):

* ``headroom``: the candidate's peak memory past the node's free memory when the trial ran (free device
  memory on a GPU, the trial child's memory budget on CPU);
* ``memory``: the candidate's peak over stable's by more than the plan's memory margin
  (``TrialSpec.memory_margin``; :data:`kernelctl.vocab.DEFAULT_MEMORY_MARGIN` from a controller that sends
  none);
* ``launches``: more Triton launches per call than stable (a plan with ``launch_gate = "warn"``: noted in the
  verdict, not a refusal);
* ``outcome``: a trial that did not pass its hard gates (numerics, crash, OOM, ...) is never served either.

A first version (no stable) is judged on headroom and outcome only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernelctl.wire import CellResources, TrialReport, TrialSpec


@dataclass(frozen=True)
class ServeVerdict:
    """The node's own verdict on serving a candidate: ``gate`` names the first gate that failed (None: pass)."""

    candidate: str  # name@version
    gate: str | None
    failures: tuple[str, ...] = ()  # every failure, worst first: "<gate> <op>@<tokens>: figures"
    warnings: tuple[str, ...] = ()  # launches over stable under a plan's launch_gate "warn"

    @property
    def ok(self) -> bool:
        return self.gate is None

    def line(self) -> str:
        """One line for the log and the report's detail."""
        if self.ok:
            note = f" (warnings: {'; '.join(self.warnings)})" if self.warnings else ""
            return f"node-local gates passed for {self.candidate}{note}"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return f"node-local gate failed: {self.failures[0]}{more}; this node does not serve {self.candidate}"

    def as_state(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "gate": self.gate, "failures": list(self.failures[:20]),
                "warnings": list(self.warnings[:20])}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> ServeVerdict:
        return cls(str(d["candidate"]), d.get("gate"), tuple(d.get("failures") or ()),
                   tuple(d.get("warnings") or ()))


def size(n: float) -> str:
    """Bytes for people: 1.5 MiB, 512 KiB, 96 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


Severity = tuple[float, float]  # (ratio, bytes or calls): the worst cell first
GATES = ("headroom", "memory", "launches")


def _memory(c: CellResources, margin: float, free: int | None) -> list[tuple[str, Severity, str]]:
    """(gate, severity, text) of the memory gates failing at one cell."""
    out: list[tuple[str, Severity, str]] = []
    ca, st = c.candidate_peak_bytes, c.stable_peak_bytes
    if ca is None:
        return out
    cell = f"{c.op}@{c.tokens}"
    if free is not None and ca > free:
        out.append(("headroom", (ca / max(free, 1), ca),
                    f"{cell}: candidate peak {size(ca)} past the node's free memory {size(free)}"))
    if st is not None:
        ratio = ca / st if st > 0 else (1.0 if ca <= 0 else float("inf"))
        if ratio > 1 + margin:
            out.append(("memory", (ratio, ca),
                        f"{cell}: candidate peak {size(ca)} = {ratio:.2f}x stable's {size(st)} (margin {margin:.0%})"))
    return out


def judge_trial(report: TrialReport, spec: TrialSpec) -> ServeVerdict:
    """The node-local verdict on serving ``spec.candidate`` after this node's trial ``report`` (pure)."""
    cand = f"{spec.candidate.name}@{spec.candidate.version}"
    if report.outcome != "ok":
        return ServeVerdict(cand, "outcome", (f"outcome: the trial ended {report.outcome}",))
    found: dict[str, list[tuple[Severity, str]]] = {g: [] for g in GATES}
    warnings: list[str] = []
    for c in sorted(report.resources, key=lambda c: (c.op, c.tokens)):
        for gate, severity, text in _memory(c, spec.memory_margin, report.free_memory_bytes):
            found[gate].append((severity, f"{gate} {text}"))
        if c.candidate_launches is not None and c.stable_launches is not None \
                and c.candidate_launches > c.stable_launches:
            text = f"launches {c.op}@{c.tokens}: {c.candidate_launches} per call vs stable's {c.stable_launches}"
            if spec.launch_gate == "warn":
                warnings.append(text)
            else:
                found["launches"].append(((c.candidate_launches / max(c.stable_launches, 1), c.candidate_launches),
                                          text))
    # the gate that can take a serving process down first, then each gate's worst cell first
    ranked = [t for g in GATES for _s, t in sorted(found[g], key=lambda x: x[0], reverse=True)]
    gate = next((g for g in GATES if found[g]), None)
    return ServeVerdict(cand, gate, tuple(ranked), tuple(warnings))


def annotate(report: TrialReport, verdict: ServeVerdict) -> TrialReport:
    """The report with the verdict as the first line of its detail (what the controller stores and shows)."""
    detail = f"{verdict.line()}\n{report.detail}" if report.detail else verdict.line()
    return report.model_copy(update={"detail": detail[:8192]})
