"""Example instances of every wire message, a structural equality for messages holding tensors, and frames
that peers of older protocol versions really sent.

Shared by the protocol tests (test_codec*.py, test_versions.py, test_sessions.py). A new message kind
without an entry in `examples()` fails test_codec.py::test_every_kind_has_an_example.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from tailrace.protocol.messages import (
    Cancel,
    Credit,
    EnvClose,
    EnvError,
    EnvObservation,
    EnvReset,
    EnvStep,
    Error,
    Event,
    Heartbeat,
    Hello,
    Reject,
    Rollout,
    SamplingParams,
    Score,
    ScoreError,
    ScoreRequest,
    Shutdown,
    Span,
    Spans,
    Stats,
    WeightsAck,
    WeightsChunk,
    WeightsFetch,
    WeightsNotice,
    Welcome,
    Work,
    WorkItem,
    WorkRequest,
)

# The Hello of a version-1 reward server (encoded by the codec of commit 9e1c489, the first with a transport),
# and that of the version-2 reward server of SPEC.md version 2 ("Reward servers", as of commit ff36a35).
V1_HELLO = [bytes.fromhex("54 52 01 01"), bytes.fromhex(
    "97 a6 72 65 77 61 72 64 a8 67 72 61 64 65 72 2d 31 01 a5 30 2e 31 2e 30 91 a4 6d 61 74 68 04 80")]
V2_HELLO = [bytes.fromhex("54 52 02 01"), bytes.fromhex(
    "97 a6 72 65 77 61 72 64 a8 67 72 61 64 65 72 2d 31 02 a3 31 2e 30 91 a4 6d 61 74 68 04 80")]
# Reject(code=403, text="protocol version 1 not supported; this trainer speaks 4") as version 1's codec
# encoded it: frames a version-1 peer reads.
V1_REJECT = [bytes.fromhex("54 52 01 03"), bytes.fromhex("92 cd 01 93 d9 37") +
             b"protocol version 1 not supported; this trainer speaks 4"]


def rollout(num_prompt: int = 3, num_completion: int = 5, dtype: torch.dtype = torch.int32) -> Rollout:
    g = torch.Generator().manual_seed(num_prompt * 1000 + num_completion)
    return Rollout(
        group_id=12, sample_id=3,
        prompt_token_ids=torch.randint(0, 50_000, (num_prompt,), generator=g, dtype=dtype),
        completion_token_ids=torch.randint(0, 50_000, (num_completion,), generator=g, dtype=dtype),
        behaviour_logprobs=-torch.rand(num_completion, generator=g),
        policy_versions=torch.full((num_completion,), 5, dtype=dtype),
        min_policy_version=4, max_policy_version=5, finish_reason="stop",
        queue_s=0.01, decode_s=0.2, finished_wall_s=1795000000.0,
    )


def examples() -> list[tuple[object, int]]:
    """(message, exact number of frames it encodes to) — every kind at least once."""
    big = torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64)  # 128 KiB: its own frame
    return [
        (Hello(role="reward", name="math-grader", protocol_version=3, package_version="0.1.0",
               tasks=["math"], max_inflight=16, capabilities={"language": "go", "gpus": 0, "fast": True,
                                                             "ratio": 0.5, "none": None}), 2),
        (Welcome(run_id="r-20261129-1", policy_version=4, credits=64, heartbeat_interval_s=1.0,
                 peer_timeout_s=5.0, notice_endpoint="tcp://127.0.0.1:5556", max_message_bytes=1 << 28), 2),
        (Reject(code=403, text="protocol version 2 not supported; this trainer speaks 4"), 2),
        (WorkRequest(capacity=16, policy_version=3), 2),
        (Work(items=[WorkItem(group_id=1, prompt_token_ids=[1, 2], num_samples=4),
                     WorkItem(group_id=2, prompt_token_ids=list(range(300)), num_samples=8, first_sample_id=8,
                              sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=64,
                                                      stop_token_ids=[2, 3], seed=7),
                              task="copy", min_policy_version=3)], exhausted=False), 2),
        (Work(items=[], exhausted=True), 2),
        (Cancel(group_ids=[12, 13], reason="run stopping"), 2),
        (rollout(), 2),
        (rollout(400, 100), 3),  # prompt: 1600 bytes, a frame; completion: 400 bytes each, inline
        (ScoreRequest(request_id=77, task="copy", prompt="copy: abc\n", completion="abc",
                      metadata={"answer": "abc"}, timeout_s=10.0), 2),
        (Score(request_id=77, reward=1.0, details={"exact": 1.0}), 2),
        (ScoreError(request_id=77, code=504, text="score function timed out after 10.0 s"), 2),
        (WeightsNotice(model="policy", version=5, num_chunks=3, num_tensors=42, total_bytes=9437184), 2),
        (WeightsNotice(model="policy", version=5, num_chunks=3, num_tensors=42, total_bytes=9437184,
                       transport="broadcast", broadcast_store="127.0.0.1:41234", broadcast_group="w1",
                       broadcast_backend="gloo", broadcast_rank=1, broadcast_world_size=3,
                       broadcast_bucket_bytes=33554432, broadcast_layout="3f2a9c0d1b4e5f60718293a4b5c6d7e8",
                       broadcast_timeout_s=30.0), 2),
        (WeightsAck(model="policy", version=5, ok=True), 2),
        (WeightsFetch(model="policy", version=5, chunk_index=0), 2),
        (WeightsChunk(model="policy", version=5, chunk_index=0, num_chunks=3,
                      tensors={"model.embed_tokens.weight": big, "model.norm.weight": torch.ones(64),
                               "lm_head.bias": torch.zeros(0, dtype=torch.bfloat16)}), 3),
        (Stats(role="generator", name="gen-0", state="generating", policy_version=4,
               counters={"generator/queue/running": 12, "generator/throughput/tokens_per_s": 950.0},
               wall_s=1795000000.0), 2),
        (Event(role="trainer", name="trainer", event="peer_dead", text="gen-1 missed 5 heartbeats",
               fields={"peer": "gen-1"}, wall_s=1795000000.0), 2),
        (Spans(role="generator", name="gen-0", spans=[
            Span(state="decode", start_wall_s=1795000000.0, duration_s=0.012, value=24.0),
            Span(state="serve_weights", start_wall_s=1795000000.5, duration_s=0.003, track="net")]), 2),
        (Heartbeat(seq=41, wall_s=1795000000.0), 2),
        (Shutdown(reason="run finished"), 2),
        (Error(code=401, text="Rollout.sample_id: expected int, got str", ref_kind=20), 2),
        (Credit(credits=8), 2),
        (episode_rollout(), 2),
        (EnvReset(request_id=5, episode_id=9, group_id=12, sample_id=3, task="guess", prompt="Guess my number.",
                  metadata={"secret": 37}, timeout_s=30.0), 2),
        (EnvStep(request_id=6, episode_id=9, action="50", timeout_s=30.0), 2),
        (EnvObservation(request_id=6, episode_id=9, text="lower", done=False, info={"guesses": 1}), 2),
        (EnvObservation(request_id=7, episode_id=9, token_ids=[1, 2, 3], done=True, reward=1.0), 2),
        (EnvError(request_id=6, episode_id=9, code=504, text="step timed out after 30 s", reason="env_timeout"), 2),
        (EnvClose(episode_id=9), 2),
    ]


def episode_rollout() -> Rollout:
    """A multi-turn Rollout: 2 assistant turns around 3 observation tokens, with an environment reward."""
    base = rollout(3, 8)
    mask = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    return Rollout(**{**msgspec.structs.asdict(base), "behaviour_logprobs": base.behaviour_logprobs * mask,
                      "loss_mask": mask, "env_reward": 0.5, "num_turns": 2})


def as_torch(value):
    if isinstance(value, np.ndarray | np.generic):
        return torch.from_numpy(np.array(value, dtype=value.dtype.newbyteorder("=")))  # keeps 0-d as 0-d
    return value


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a, b, path: str = "msg") -> None:
    """a (what was sent; tensors may be numpy) equals b (what was decoded) field by field; tensors
    by dtype, shape and bytes, floats bitwise-equal up to NaN."""
    a = as_torch(a)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b).__name__} is not a tensor"
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), f"{path}: {a.dtype}{tuple(a.shape)} " \
                                                                       f"!= {b.dtype}{tuple(b.shape)}"
        assert tensor_bytes(a.detach().cpu()) == tensor_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: {b!r} is not NaN"
    elif type(a) is int and type(b) is float:  # an int given for a float field decodes as float
        assert float(a) == b, f"{path}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"
