"""Version switches reach a running decode loop: eager path on CPU, CUDA graphs on a GPU (marked gpu).

Bound (docs/serving.md): the first decode step that starts after the agent's atomic rename of active.json
runs the new version; after a rollback, the first step that starts after it runs the stable one again.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernelpack import torch_ops
from kernelpack.integrations.graphs import SwitchingGraph, follow_switches
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import Serving


def test_generation_and_subscribers_follow_publication(serving: Serving) -> None:
    rt = serving.runtime
    seen: list[int] = []
    unsubscribe = rt.subscribe(seen.append)
    g0 = rt.poll()
    assert rt.poll() == g0  # nothing changed: no new generation
    key0 = rt.served_key("serve")
    serving.publish("0.2.0")
    g1 = rt.poll()
    assert g1 == g0 + 1 and seen[-1] == g1 and rt.served_key("serve") != key0
    serving.publish("0.1.0", stable=None)
    assert rt.poll() == g1 + 1 and rt.served_key("serve") == key0  # a rollback restores the first key
    unsubscribe()
    # the watcher notices without any poll from the serving code
    rt.watch(0.01)
    serving.publish("0.2.0")
    deadline = time.monotonic() + 5
    while rt.generation < g1 + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.generation == g1 + 2 and seen[-1] == g1 + 1  # unsubscribed: the callback heard no more


def _decode_step(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    y, h = torch.ops.kernelctl.add_rmsnorm(x, u, w)
    return torch.ops.kernelctl.swiglu(y, u) + h


def test_eager_decode_loop_follows_a_switch_and_a_rollback(serving: Serving) -> None:
    """A decode loop in one thread, the agent's publications in another: every step that starts after a
    publication returns runs the version it published (bound: one step)."""
    x, w, u = torch.randn(2, 64), torch.ones(64), 0.1 * torch.randn(2, 64)
    step = SwitchingGraph(lambda x: _decode_step(x, w, u), runtime=serving.runtime, bundle="serve")
    log: list[tuple[float, float, str]] = []  # (start, end, served version)
    stop = threading.Event()

    def loop() -> None:
        h = x
        while not stop.is_set():
            t0 = time.monotonic()
            h = step(h).clamp(-4, 4)
            log.append((t0, time.monotonic(), torch_ops.last_served("add_rmsnorm") or ""))

    th = threading.Thread(target=loop)
    th.start()

    def steps_after(t: float, n: int) -> None:
        deadline = time.monotonic() + 60
        while sum(1 for s in log if s[0] > t) < n and time.monotonic() < deadline:
            time.sleep(0.005)

    try:
        steps_after(0, 3)
        # A step that overlaps a publication in progress may run either version: the bound counts from the
        # moment the publication returned, and such steps belong to neither window.
        t_publishing = time.monotonic()
        serving.publish("0.2.0")  # the agent widens the canary to this node
        t_switch = time.monotonic()
        steps_after(t_switch, 3)
        t_rolling_back = time.monotonic()
        serving.publish("0.1.0", stable=None)  # rollback
        t_back = time.monotonic()
        steps_after(t_back, 3)
    finally:
        stop.set()
        th.join()
    before = [v for _, end, v in log if end < t_publishing]
    during = [v for t0, end, v in log if t_switch < t0 and end < t_rolling_back]
    after = [v for t0, _, v in log if t0 > t_back]
    assert set(before) == {"serve@0.1.0"}
    assert during and set(during) == {"serve@0.2.0"}, during
    assert after and set(after) == {"serve@0.1.0"}, after
    # the publication -> first step on the new version latency is below one step (+ the step itself)
    first_new = min(end for t0, end, v in log if t0 > t_switch and v == "serve@0.2.0")
    assert first_new - t_switch < 2 * max(end - t0 for t0, end, _ in log)


def test_follow_switches_resets_compiled_graphs_on_a_new_key(serving: Serving) -> None:
    resets: list[int] = []
    calls: list[int] = []
    fn = follow_switches(lambda a: calls.append(a) or a, runtime=serving.runtime, bundle="serve",
                         reset=lambda: resets.append(1))
    fn(1)
    fn(2)
    assert resets == []
    serving.publish("0.2.0")
    fn(3)
    assert resets == [1]
    fn(4)
    serving.publish("0.1.0", stable=None)
    fn(5)
    assert resets == [1, 1] and calls == [1, 2, 3, 4, 5]


@pytest.mark.gpu
def test_cuda_graph_decode_loop_recaptures_on_switch_and_rollback(serving: Serving) -> None:
    dev = torch.device("cuda")
    x, w, u = (torch.randn(8, 4096, device=dev, dtype=torch.bfloat16), torch.ones(4096, device=dev,
               dtype=torch.bfloat16), 0.1 * torch.randn(8, 4096, device=dev, dtype=torch.bfloat16))
    step = SwitchingGraph(lambda x: _decode_step(x, w, u), runtime=serving.runtime, bundle="serve")
    ref = _decode_step(x, w, u)
    out = step(x)
    assert step.captures == 1 and torch.allclose(out.float(), ref.float(), atol=0.05)
    for _ in range(3):
        step(x)
    assert step.captures == 1  # replays, no new capture
    key_stable = step.last_key
    serving.publish("0.2.0")
    t0 = time.perf_counter()
    out = step(x)
    torch.cuda.synchronize()
    recapture_s = time.perf_counter() - t0
    assert step.captures == 2 and step.last_key != key_stable
    assert torch_ops.last_served("add_rmsnorm") == "serve@0.2.0"  # captured from the new version's body
    assert torch.allclose(out.float(), ref.float(), atol=0.05)
    serving.publish("0.1.0", stable=None)
    step(x)
    assert step.captures == 2 and step.last_key == key_stable  # rollback replays the stable capture
    print(f"cuda-graph switch: first step on the new version took {recapture_s * 1e3:.1f} ms (capture included)")
