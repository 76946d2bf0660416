"""The torch backend's fixed-shape forwards (engine/generator/torch_backend/graphs.py): what CUDA graphs capture.

On a CPU the same bodies run uncaptured (static_forwards="static"), and a run of mixed requests (rows
joining and leaving, batches crossing bucket sizes, compaction, speculative steps of the EAGLE and suffix
drafters) must give what the eager window gives: the same tokens and, in float64, the same log-probs to
1e-9. The gpu-marked test captures real CUDA graphs and checks them against the eager path the same way.
Run: pytest tests/engine/generator/torch_backend/test_static_forwards.py   (the CUDA one: -m gpu on a GPU machine)
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.speculation.speculative import FixedDepth
from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
from tailrace.engine.generator.torch_backend.graphs import bucket_of, resolve_mode
from tailrace.protocol.messages import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def schedule(prompts):
    def schedule(seed: int = 5) -> dict[int, list[Request]]:
        """11 requests over 6 steps: groups of 1-3 samples, greedy and sampled, budgets 3-90 tokens, one
        stop token; running batches pass through 1..7 rows (buckets 1, 2, 4, 8), the columns in use past 64."""
        ps = prompts(6, seed=seed, max_len=14)
        out: dict[int, list[Request]] = {}
        gid = 0
        for step, (p, n, temp, budget) in enumerate(zip(ps, (1, 3, 2, 1, 3, 1), (0.0, 1.0, 0.7, 1.0, 0.0, 1.0),
                                                         (90, 12, 3, 25, 8, 20), strict=True)):
            params = SamplingParams(temperature=temp, max_new_tokens=budget, stop_token_ids=[7] if step == 3 else [])
            out[step * 2] = [Request(gid, i, p, params) for i in range(n)]
            gid += 1
        return out

    return schedule


def _backend(model, mode: str, spec: str | None, drafter=None, device="cpu") -> TorchBackend:
    backend = TorchBackend(model, max_batch_size=8, max_model_len=120, seed=11, static_forwards=mode, device=device)
    if spec is not None:
        backend.enable_speculation(drafter if spec == "eagle" else None, FixedDepth(3, spec))
    return backend


def _assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].completion_ids.tolist() == b[key].completion_ids.tolist(), key
        assert a[key].finish_reason == b[key].finish_reason
        torch.testing.assert_close(a[key].behaviour_logprobs, b[key].behaviour_logprobs, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def model64(make_model):
    return make_model("qwen2", seed=2).to(torch.float64)


@pytest.mark.parametrize("spec", [None, "eagle", "suffix"])
def test_static_forwards_equal_the_eager_window(model64, spec, run_spec, schedule):
    drafter = Drafter.for_policy(model64, seed=4).to(torch.float64) if spec == "eagle" else None
    eager = run_spec(_backend(model64, "off", spec, drafter), schedule())
    static_backend = _backend(model64, "static", spec, drafter)
    static = run_spec(static_backend, schedule())
    _assert_same(eager, static, atol=1e-6)
    shapes = static_backend.static_forwards._entries
    assert len({key[1] for key in shapes}) >= 3  # batches crossed row buckets
    assert {key[3] for key in shapes} == {64, 128}  # and column windows
    if spec is not None:
        assert static_backend.spec_stats.num_spec_steps > 0
        assert any(key[0] == "policy" and key[2] == 4 for key in shapes)  # verify of k = 3 drafts
    if spec == "eagle":
        assert any(key[0] == "drafter" for key in shapes)
    # Padding rows wrote into free cache rows: every buffer stays finite (a masked NaN would still poison
    # attention: a zero weight times NaN is NaN).
    kv = static_backend.rows.kv
    assert all(torch.isfinite(buf).all() for buf in kv._key_buffers())


class _HostSyncs(TorchDispatchMode):
    """Records the ops that read a tensor's values on the host (a CUDA stream cannot be captured across
    them): .item(), bool(tensor), nonzero and friends."""

    SYNCING = ("_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "unique")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(name.startswith(op) for op in self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", [None, "eagle"])
def test_the_bodies_a_graph_captures_never_read_values_on_the_host(model64, monkeypatch, spec, run_spec,
                                                                   schedule):
    drafter = Drafter.for_policy(model64, seed=4).to(torch.float64) if spec == "eagle" else None
    # Outside inference mode: a dispatch mode does not see the ops of inference tensors.
    monkeypatch.setattr(TorchBackend, "step", torch.no_grad()(TorchBackend.step.__wrapped__))
    backend = _backend(model64, "static", spec, drafter)
    spy, calls = _HostSyncs(), []
    for name in ("_policy_body", "_drafter_body"):
        body = getattr(backend.static_forwards, name)

        def spied(inputs, window, body=body, name=name):
            calls.append(name)
            with spy:
                return body(inputs, window)
        monkeypatch.setattr(backend.static_forwards, name, spied)
    run_spec(backend, schedule())
    assert "_policy_body" in calls and ("_drafter_body" in calls) == (spec == "eagle")
    assert spy.seen == []


def test_modes_and_buckets():
    assert [bucket_of(n, 32) for n in (1, 2, 3, 4, 5, 9, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]
    assert bucket_of(5, 6) == 6
    assert resolve_mode("auto", torch.device("cpu")) == "off"
    assert resolve_mode("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_mode("graphs", torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of"):
        resolve_mode("sometimes", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, "eagle", "suffix"])
def test_cuda_graphs_equal_the_eager_window(spec, run_spec, make_model, schedule):
    # On the device before the drafter is built: it aliases the policy's embedding and LM head.
    model = make_model("qwen2", seed=2).to(torch.float64).to("cuda")
    drafter = Drafter.for_policy(model, seed=4) if spec == "eagle" else None
    eager = run_spec(_backend(model, "off", spec, drafter, device="cuda"), schedule())
    graphed_backend = _backend(model, "auto", spec, drafter, device="cuda")
    graphed = run_spec(graphed_backend, schedule())
    _assert_same(eager, graphed, atol=1e-6)
    counters = graphed_backend.static_forwards.counters()
    assert counters["static_forwards_captured"] >= 4 and counters["static_forwards_replayed"] > 0
