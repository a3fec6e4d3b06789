"""The judged gates behind one interface (:class:`~controller.judge.gates.base.Gate`), in evaluation order."""

from controller.judge.gates.base import Breach, Gate, GateContext, MetricView, StepEvidence
from controller.judge.gates.latency import LatencyGate
from controller.judge.gates.launches import LaunchesGate
from controller.judge.gates.memory import MemoryGate
from controller.judge.gates.numeric import NumericGate

GATES: tuple[Gate, ...] = (MemoryGate(), LaunchesGate(), LatencyGate(), NumericGate())

__all__ = ["GATES", "Breach", "Gate", "GateContext", "LatencyGate", "LaunchesGate", "MemoryGate", "MetricView",
           "NumericGate", "StepEvidence"]
