"""The whole tailrace wire vocabulary: one class per message, fields in wire order.

Field order is the wire contract: append new fields at the end (with a default), never insert; change
PROTOCOL_VERSION when a layout changes. Messages are msgspec Structs (protocol/schema.py); bounds are
`Meta(...)` annotations, which msgspec enforces while decoding. Byte-level details are in protocol/SPEC.md.
No logic here. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from msgspec import Meta, field

from tailrace.protocol.schema import (
    INT64_MAX,
    Array,
    Key,
    Scalar,
    TensorSpec,
    Text,
    UInt,
    WireStruct,
    message,
    struct,
)

PROTOCOL_VERSION = 5
"""Version of the wire protocol: the layout (frames, kinds, fields in order, bounds) and the meaning of its
codes. Any change to either makes a new version, with an entry in protocol/SPEC.md's changelog ("Versions")
and its layout recorded in tests/protocol/layouts/. Unrelated to the policy version of weights."""

ROLES = ("trainer", "generator", "reward", "tool", "env")
ENV_REASONS = ("env_error", "env_timeout", "env_dead", "no_env_server")  # why an episode's request failed
FINISH_REASONS = ("stop", "length", "cancelled", "error", *ENV_REASONS)  # an episode its environment failed: why
MODELS = ("policy", "drafter")
TRANSPORTS = ("chunks", "broadcast")  # how a WeightsNotice's version travels
BROADCAST_BACKENDS = ("", "gloo", "nccl")  # torch.distributed backends of a broadcast ("": chunks)
STATES = ("starting", "idle", "generating", "training", "syncing_weights", "scoring", "drafter_training",
          "checkpointing", "stopping")
Role = Literal[ROLES]
Model = Literal[MODELS]

MAX_TOKENS = 1 << 21
"""Upper bound on the number of tokens in one prompt or completion on the wire."""
MAX_VOCAB = 1 << 24

TokenId = Annotated[int, Meta(ge=0, le=MAX_VOCAB)]
Name = Annotated[str, Meta(max_length=128)]
LongText = Annotated[str, Meta(max_length=4096)]
Code = Annotated[int, Meta(ge=0, le=65535)]
Seconds = Annotated[float, Meta(ge=0.0)]
IntTokens = Annotated[Array, TensorSpec(dtypes=("int32", "int64"), ndim=1, max_len=MAX_TOKENS)]
MAX_TURNS = 1024
"""Upper bound on WorkItem.max_turns and Rollout.num_turns."""
EnvText = Annotated[str, Meta(max_length=1 << 22)]  # a prompt, an assistant turn or an observation


class ErrorCode:
    """Codes carried by Error, Reject and ScoreError. 4xx: the peer sent something wrong; 5xx: ours.
    Which ones to retry: protocol/SPEC.md, "Error codes"."""

    BAD_FRAME = 400         # header or frame layout is wrong
    BAD_FIELD = 401         # a field has the wrong type or is out of bounds
    UNKNOWN_KIND = 402      # message kind not in this protocol version
    VERSION_MISMATCH = 403  # protocol version not supported
    TOO_LARGE = 404         # frame or message over the size limit
    NOT_WELCOME = 405       # no session: a message before a successful handshake, or after the session ended
    NO_CREDIT = 406         # sent beyond the credits granted; message dropped
    UNSUPPORTED = 407       # valid message this endpoint does not serve
    UNAUTHORIZED = 408      # role or name not allowed
    TAKEN_OVER = 409        # a newer Hello under this name took the session over: exit, never say Hello again
    DECLARED_DEAD = 410     # the trainer heard nothing for peer_timeout_s and ended the session
    TIMEOUT = 504           # a request timed out (e.g. a reward function)
    INTERNAL = 500          # the handler failed; the endpoint keeps serving


# ---------------------------------------------------------------------------------------- structures


@struct
class SamplingParams(WireStruct):
    """How to sample one prompt's completions. temperature 0 is greedy.

    Example: SamplingParams(temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=256,
    stop_token_ids=[2], seed=7)
    """

    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0       # nucleus mass; 1.0 = off
    top_k: Annotated[int, Meta(ge=0, le=MAX_VOCAB)] = 0        # 0 = off
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 256
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = field(default_factory=list)
    seed: UInt | None = None  # None: generator's own stream


@struct
class WorkItem(WireStruct):
    """One prompt to sample `num_samples` times (a GRPO group, or part of one).

    eval: the trainer's evaluation (docs/algorithms.md, "Evaluation"): sampled and streamed like any work, answered by
    Rollouts with eval set, scored and reported by the trainer, never trained. min_policy_version: the
    oldest policy version that may sample it; it may name a version whose WeightsNotice is still to come
    (the trainer admits work for version V + 1 while it copies V + 1's weights for publishing): a generator
    holds such an item until it has loaded that version.

    max_turns > 1: each sample is an episode with an environment server of its task (SPEC.md,
    "Environment servers"): the generator asks for a first observation (EnvReset), then after each assistant
    turn for the next (EnvStep), appends it and decodes on, for at most max_turns assistant turns.

    Example: WorkItem(group_id=12, prompt_token_ids=[1, 57, 33], num_samples=8, first_sample_id=0,
    sampling=SamplingParams(), task="copy", min_policy_version=3, eval=False, max_turns=1)
    """

    group_id: UInt
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOKENS)]
    num_samples: Annotated[int, Meta(ge=1, le=4096)]
    first_sample_id: Annotated[int, Meta(ge=0, le=4096)] = 0  # sample ids are first..first+num_samples-1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    task: Annotated[str, Meta(max_length=256)] = ""
    min_policy_version: UInt = 0  # do not sample with weights older than this
    eval: bool = False  # evaluation work: scored and reported, never trained; its Rollouts say eval too
    max_turns: Annotated[int, Meta(ge=1, le=MAX_TURNS)] = 1  # assistant turns per episode; 1 = single-turn


# ---------------------------------------------------------------------------------------- handshake


@message(1)
class Hello(WireStruct):
    """First message a connecting peer sends; nothing else is served before a Welcome.

    role: one of ROLES. name: free-form, unique per run (e.g. "gen-0"). tasks: for reward servers, the
    task names it scores ("*" = any). max_inflight: how many requests (score requests, work items) this
    peer accepts at once. capabilities: free-form scalars (backend, vocab_size, max_model_len, ...).
    incarnation: larger for each new process under this name (our Client: wall-clock microseconds at
    start); a Hello whose name is connected takes that session over when incarnation >= the live one's.
    Its first four fields (role, name, protocol_version, package_version) are the same in every protocol
    version (HelloPrefix), so that a trainer can name a peer of any version that it refuses.

    Example: Hello(role="reward", name="math-grader", protocol_version=3, package_version="0.1.0",
    tasks=["math"], max_inflight=16, capabilities={"language": "go"})
    """

    role: Role
    name: Name
    protocol_version: Code
    package_version: Annotated[str, Meta(max_length=64)]
    tasks: Annotated[list[Text], Meta(max_length=1024)] = field(default_factory=list)
    max_inflight: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    capabilities: Annotated[dict[Key, Scalar], Meta(max_length=256)] = field(default_factory=dict)
    incarnation: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] = 0  # grows per process start; >= live one's: takeover


@message(2)
class Welcome(WireStruct):
    """The trainer accepts a peer. credits: messages the peer may have in flight toward the trainer
    (each Credit message returns some); heartbeat_interval_s / peer_timeout_s: liveness settings
    (seconds); notice_endpoint: where the PUB socket for notices is bound (same host for tcp).

    Example: Welcome(run_id="r-20261129-1", policy_version=4, credits=64, heartbeat_interval_s=1.0,
    peer_timeout_s=5.0, notice_endpoint="tcp://127.0.0.1:5556", max_message_bytes=268435456)
    """

    run_id: Name
    policy_version: UInt
    credits: Annotated[int, Meta(ge=1, le=1 << 20)]
    heartbeat_interval_s: Annotated[float, Meta(ge=0.001, le=3600.0)]
    peer_timeout_s: Annotated[float, Meta(ge=0.001, le=86400.0)]
    notice_endpoint: Annotated[str, Meta(max_length=1024)] = ""
    max_message_bytes: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 1 << 30
    drafter_version: UInt = 0


@message(3)
class Reject(WireStruct):
    """The trainer refuses a Hello. code 403: the protocol version is not the trainer's (exit: retrying
    cannot help); 408: not allowed now (name held by a live session, trainer full, role or key refused) and
    500: the trainer's admission check failed (retry both after a growing pause). The same two fields in
    every protocol version, and sent in the Hello's own version (its header's version byte), so that a
    peer of any version can read why it was refused.

    Example: Reject(code=403, text="protocol version 2 not supported; this trainer speaks 4")
    """

    code: Code
    text: LongText


class HelloPrefix(WireStruct, forbid_unknown_fields=False):
    """Not a message: the first four fields of a Hello, which every protocol version shares (SPEC.md,
    "Versions"). A trainer reads a Hello of another version with it, ignoring the fields after them, to
    say whom it refuses. role is any short text here: another version may have other roles.

    Example: HelloPrefix(role="reward", name="grader-1", protocol_version=1, package_version="0.1.0")
    """

    role: Name
    name: Name
    protocol_version: Code
    package_version: Annotated[str, Meta(max_length=64)]


# ---------------------------------------------------------------------------------------- work


@message(10)
class WorkRequest(WireStruct):
    """A generator asks for up to `capacity` samples of work (pull-based admission).

    Example: WorkRequest(capacity=16, policy_version=3)
    """

    capacity: Annotated[int, Meta(ge=0, le=1 << 20)]
    policy_version: UInt  # weights the generator holds now


@message(11)
class Work(WireStruct):
    """Work for a generator: zero or more items. An empty list means "none now" (staleness gate closed
    or prompts exhausted); `exhausted` is True when no more work will ever come.

    Example: Work(items=[WorkItem(group_id=1, prompt_token_ids=[1, 2], num_samples=4)], exhausted=False)
    """

    items: Annotated[list[WorkItem], Meta(max_length=4096)]
    exhausted: bool = False


@message(12)
class Cancel(WireStruct):
    """Stop sampling these groups; running samples end with finish_reason "cancelled".

    Example: Cancel(group_ids=[12, 13], reason="run stopping")
    """

    group_ids: Annotated[list[UInt], Meta(max_length=1 << 16)]
    reason: Annotated[str, Meta(max_length=1024)] = ""


# ---------------------------------------------------------------------------------------- rollouts


@message(20)
class Rollout(WireStruct):
    """One finished sample, streamed as soon as it ends.

    prompt_token_ids / completion_token_ids: int32 [P] / [T]. behaviour_logprobs: float32 [T], the
    log-probability under the sampling policy (after temperature/top-p/top-k) of each completion token.
    policy_versions: int32 [T], the policy version that sampled each token. min/max_policy_version: the
    oldest and newest of those. Times are seconds: queue_s (waiting before the first token), decode_s
    (first to last token), finished_wall_s (wall clock, Unix epoch, at the finish).

    A multi-turn episode (WorkItem.max_turns > 1): the completion is every turn after the prompt, the
    assistant's and the environment's observations alike. loss_mask: uint8 [T], 1 for the assistant's
    tokens, 0 for observation tokens (never trained; their behaviour_logprobs are 0, their policy_versions
    the version the generator held when it appended them); nil: all 1. env_reward: the sum of the rewards the
    environment gave, the sample's reward when not nil (no reward server is asked); num_turns: assistant
    turns taken. An episode whose environment failed ends with finish_reason its EnvError's reason
    (env_error, env_timeout, env_dead, no_env_server): the trainer discards it under that reason.

    Example: Rollout(group_id=12, sample_id=3, prompt_token_ids=int32[3], completion_token_ids=int32[5],
    behaviour_logprobs=float32[5], policy_versions=int32[5], min_policy_version=4, max_policy_version=5,
    finish_reason="stop", queue_s=0.01, decode_s=0.2, finished_wall_s=1795000000.0)
    """

    group_id: UInt
    sample_id: Annotated[int, Meta(ge=0, le=1 << 20)]
    prompt_token_ids: IntTokens
    completion_token_ids: IntTokens
    behaviour_logprobs: Annotated[Array, TensorSpec(dtypes=("float32",), ndim=1, max_len=MAX_TOKENS)]
    policy_versions: IntTokens
    min_policy_version: UInt
    max_policy_version: UInt
    finish_reason: Literal[FINISH_REASONS]
    queue_s: Seconds = 0.0
    decode_s: Seconds = 0.0
    finished_wall_s: Seconds = 0.0
    eval: bool = False  # the sample answers a WorkItem with eval set (the trainer checks it)
    loss_mask: Annotated[Array, TensorSpec(dtypes=("uint8",), ndim=1, max_len=MAX_TOKENS)] | None = None
    env_reward: float | None = None  # the sum of the environment's rewards (None: it gave none)
    num_turns: Annotated[int, Meta(ge=0, le=MAX_TURNS)] = 1  # assistant turns in the episode

    def __post_init__(self):
        num = self.completion_token_ids.shape[0]
        if self.behaviour_logprobs.shape[0] != num or self.policy_versions.shape[0] != num:
            raise ValueError(
                f"completion_token_ids has {num} tokens but behaviour_logprobs has "
                f"{self.behaviour_logprobs.shape[0]} and policy_versions {self.policy_versions.shape[0]}"
            )
        if self.loss_mask is not None and self.loss_mask.shape[0] != num:
            raise ValueError(f"completion_token_ids has {num} tokens but loss_mask has {self.loss_mask.shape[0]}")
        if self.min_policy_version > self.max_policy_version:
            raise ValueError("min_policy_version is greater than max_policy_version")


# ---------------------------------------------------------------------------------------- rewards


@message(30)
class ScoreRequest(WireStruct):
    """Score one completion. request_id: echoed back; every attempt (a retry too) gets a new one, unique for
    the trainer process. metadata: task data such as the reference answer. timeout_s: the budget left for
    this attempt, in seconds from when the server receives it (the trainer started the attempt when it
    queued it and gives up a second after the budget runs out); 0 = no limit but the server's own.

    Example: ScoreRequest(request_id=77, task="copy", prompt="copy: abc\\n", completion="abc",
    metadata={"answer": "abc"}, timeout_s=10.0)
    """

    request_id: UInt
    task: Annotated[str, Meta(max_length=256)]
    prompt: Annotated[str, Meta(max_length=1 << 24)]
    completion: Annotated[str, Meta(max_length=1 << 24)]
    metadata: Annotated[dict[Key, Scalar], Meta(max_length=256)] = field(default_factory=dict)
    timeout_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 60.0


@message(31)
class Score(WireStruct):
    """The reward for one ScoreRequest. reward must be finite: a NaN or infinity decodes, and the trainer
    discards the sample (reward_nan). details: optional named finite components, not trained on (the
    trainer does not record them yet).

    Example: Score(request_id=77, reward=1.0, details={"exact": 1.0})
    """

    request_id: UInt
    reward: float
    details: Annotated[dict[Key, float], Meta(max_length=256)] = field(default_factory=dict)


@message(32)
class ScoreError(WireStruct):
    """A ScoreRequest could not be scored (the function raised, returned NaN, or timed out). The
    trainer may retry elsewhere or count the sample as discarded with this reason.

    Example: ScoreError(request_id=77, code=504, text="score function timed out after 10.0 s")
    """

    request_id: UInt
    code: Code
    text: LongText


# ---------------------------------------------------------------------------------------- environments


@message(70)
class EnvReset(WireStruct):
    """Start an episode: generator -> trainer, which forwards it to one environment server of `task` (its
    own request_id and episode_id), and answers the generator with EnvObservation (the first observation)
    or EnvError. request_id: echoed back, unique per sender session; episode_id: chosen by the sender,
    names the episode in its EnvStep and EnvClose. group_id / sample_id: the sample the episode is (all
    samples of a group face the same prompt). task, prompt (the prompt's text) and metadata (the data row's
    scalars, as in ScoreRequest): the trainer fills them in from the prompt it handed out under group_id, so
    a generator may leave prompt and metadata empty. timeout_s: the budget for the answer, in seconds from
    when the receiver gets it; 0 = no limit but the receiver's own.

    Example: EnvReset(request_id=5, episode_id=9, group_id=12, sample_id=3, task="guess",
    prompt="Guess my number (1-100).", metadata={"secret": 37}, timeout_s=30.0)
    """

    request_id: UInt
    episode_id: UInt
    group_id: UInt
    sample_id: Annotated[int, Meta(ge=0, le=1 << 20)]
    task: Annotated[str, Meta(max_length=256)]
    prompt: EnvText
    metadata: Annotated[dict[Key, Scalar], Meta(max_length=256)] = field(default_factory=dict)
    timeout_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 30.0


@message(71)
class EnvStep(WireStruct):
    """The assistant's turn in an open episode (its decoded text), answered like EnvReset.

    Example: EnvStep(request_id=6, episode_id=9, action="50", timeout_s=30.0)
    """

    request_id: UInt
    episode_id: UInt
    action: EnvText
    timeout_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 30.0


@message(72)
class EnvObservation(WireStruct):
    """The answer to EnvReset or EnvStep. text: the environment's turn, appended with the chat template;
    token_ids: when not nil, appended verbatim instead. done: the episode is over (text then is not
    appended). reward: a finite reward for this turn, or nil; the sample's reward is the sum of them.
    info: scalars for logs.

    Example: EnvObservation(request_id=6, episode_id=9, text="lower", token_ids=None, done=False,
    reward=None, info={"guesses": 1})
    """

    request_id: UInt
    episode_id: UInt
    text: EnvText = ""
    token_ids: Annotated[list[TokenId], Meta(max_length=1 << 16)] | None = None
    done: bool = False
    reward: float | None = None
    info: Annotated[dict[Key, Scalar], Meta(max_length=256)] = field(default_factory=dict)

    def __post_init__(self):
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")


@message(73)
class EnvError(WireStruct):
    """EnvReset or EnvStep failed; the episode is over. code: see ErrorCode (from an environment server:
    500 the environment raised, 504 it ran past timeout_s, 406 over capacity, 407 task not served or no
    such episode, 401 a bad observation). reason (one of ENV_REASONS), which the generator discards the
    sample under: env_error, env_timeout, env_dead (the environment server died or left mid-episode),
    no_env_server (none attached for the task within env.wait_for_server_s).

    Example: EnvError(request_id=6, episode_id=9, code=504, text="step timed out after 30 s",
    reason="env_timeout")
    """

    request_id: UInt
    episode_id: UInt
    code: Code
    text: LongText
    reason: Literal[ENV_REASONS] = "env_error"


@message(74)
class EnvClose(WireStruct):
    """The episode is over (done, turn or token budget, cancelled, failed): forget it. Not answered.

    Example: EnvClose(episode_id=9)
    """

    episode_id: UInt


# ---------------------------------------------------------------------------------------- weights


@message(40)
class WeightsNotice(WireStruct):
    """Version `version` of `model` ("policy" or "drafter") can be fetched in `num_chunks` chunks.
    Published on the notice socket and sent directly to generators. A generator also sends it to the
    trainer for a drafter it trained (model "drafter"); the trainer then fetches that version from it and
    republishes it to every generator as drafter version max(served + 1, version) (see Drafter sharing).

    transport "broadcast" (sent to one generator that offered weights_broadcast in its Hello, see SPEC.md,
    "Weights by broadcast"): instead of fetching, join the torch.distributed group `broadcast_group` as
    rank `broadcast_rank` of `broadcast_world_size` (rank 0: the trainer) through the TCPStore at
    `broadcast_store` (host:port; a wildcard host means the trainer's address) with `broadcast_backend`,
    and receive the version as buckets of `broadcast_bucket_bytes` in the order the layout gives
    (`broadcast_layout`, its digest); every wait is bounded by `broadcast_timeout_s`. Answer with
    WeightsAck; on any failure fetch the same version by chunks.

    Example: WeightsNotice(model="policy", version=5, num_chunks=3, num_tensors=42, total_bytes=9437184,
    transport="broadcast", broadcast_store="127.0.0.1:41234", broadcast_group="w1", broadcast_backend="gloo",
    broadcast_rank=1, broadcast_world_size=3, broadcast_bucket_bytes=33554432,
    broadcast_layout="3f2a9c0d1b4e5f60718293a4b5c6d7e8", broadcast_timeout_s=30.0)
    """

    model: Model
    version: UInt
    num_chunks: Annotated[int, Meta(ge=0, le=1 << 20)]
    num_tensors: UInt
    total_bytes: UInt
    transport: Literal[TRANSPORTS] = "chunks"
    broadcast_store: Annotated[str, Meta(max_length=300)] = ""
    broadcast_group: Name = ""
    broadcast_backend: Literal[BROADCAST_BACKENDS] = ""
    broadcast_rank: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    broadcast_world_size: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    broadcast_bucket_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    broadcast_layout: Annotated[str, Meta(max_length=64)] = ""
    broadcast_timeout_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 0.0

    def __post_init__(self):
        if self.transport != "broadcast":
            return
        if not self.broadcast_store or not self.broadcast_group or not self.broadcast_backend:
            raise ValueError("a broadcast WeightsNotice needs broadcast_store, broadcast_group and broadcast_backend")
        if not 1 <= self.broadcast_rank < self.broadcast_world_size:
            raise ValueError(f"broadcast_rank {self.broadcast_rank} is not in 1..broadcast_world_size - 1 "
                             f"({self.broadcast_world_size})")
        if self.broadcast_bucket_bytes < 1 or self.broadcast_timeout_s <= 0:
            raise ValueError("a broadcast WeightsNotice needs broadcast_bucket_bytes >= 1 and broadcast_timeout_s > 0")


@message(41)
class WeightsFetch(WireStruct):
    """Ask for one chunk of a weights version. Answered by WeightsChunk, or Error when the version is
    no longer served (fetch the newer one announced instead). Generators send it to the trainer; the
    trainer sends it (model "drafter") to the generator that announced a drafter.

    Example: WeightsFetch(model="policy", version=5, chunk_index=0)
    """

    model: Model
    version: UInt
    chunk_index: UInt


@message(42)
class WeightsChunk(WireStruct):
    """Some named tensors of one weights version (parameter name -> tensor, any dtype and shape).

    Example: WeightsChunk(model="policy", version=5, chunk_index=0, num_chunks=3,
    tensors={"model.embed_tokens.weight": float32[512, 64]})
    """

    model: Model
    version: UInt
    chunk_index: UInt
    num_chunks: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    tensors: Annotated[dict[Key, Array], Meta(max_length=1 << 16)]


@message(43)
class WeightsAck(WireStruct):
    """A generator's answer to a broadcast WeightsNotice: ok when it received and checked the version by
    broadcast; not ok (text says why) when it could not join or receive it, and fetches it by chunks instead.

    Example: WeightsAck(model="policy", version=5, ok=True, text="")
    """

    model: Model
    version: UInt
    ok: bool
    text: LongText = ""


# ---------------------------------------------------------------------------------------- telemetry


@message(50)
class Stats(WireStruct):
    """A snapshot of one process, sent every few seconds and republished to tools on the notice socket.

    state: one of STATES. counters: metric name (role/group/name) -> value, each the sender's value now,
    never a difference from its last Stats: counts are totals since the process started, the rest are
    levels, rates or means (SPEC.md, "Stats and Spans"). wall_s: Unix epoch seconds.

    Example: Stats(role="generator", name="gen-0", state="generating", policy_version=4,
    counters={"generator/queue/running": 12, "generator/throughput/tokens_per_s": 950.0},
    wall_s=1795000000.0)
    """

    role: Role
    name: Name
    state: Literal[STATES]
    policy_version: UInt
    counters: Annotated[dict[Key, float], Meta(max_length=1024)] = field(default_factory=dict)
    wall_s: Seconds = 0.0


@message(51)
class Event(WireStruct):
    """Something that happened (peer joined, died, weights published, sample discarded, ...).

    Example: Event(role="trainer", name="trainer", event="peer_dead", text="gen-1 missed 5 heartbeats",
    fields={"peer": "gen-1"}, wall_s=1795000000.0)
    """

    role: Role
    name: Name
    event: Name
    text: Annotated[str, Meta(max_length=1 << 16)] = ""
    fields: Annotated[dict[Key, Scalar], Meta(max_length=256)] = field(default_factory=dict)
    wall_s: Seconds = 0.0


@struct
class Span(WireStruct):
    """One interval of a process's time on one of its tracks (a track never holds two spans at once).
    state: what it did, e.g. "decode", "prefill", "wait_data", "scoring" (see SPEC.md, "Stats and Spans").
    start_wall_s: Unix epoch seconds (wall clock: spans of several processes share one time axis).
    value: a number that goes with the state (decode: the running batch), 0 when none.

    Example: Span(state="decode", start_wall_s=1795000000.0, duration_s=0.012, track="main", value=24.0)
    """

    state: Name
    start_wall_s: Seconds
    duration_s: Seconds
    track: Name = "main"
    value: float = 0.0


@message(52)
class Spans(WireStruct):
    """A batch of a process's spans since its last Spans (its bounded ring buffer, drained once per stats
    interval). dropped: spans the ring overwrote before they could be sent. The trainer writes them to
    runs/<name>/trace.jsonl and republishes them to tools on the notice socket.

    Example: Spans(role="generator", name="gen-0", spans=[Span(state="decode", start_wall_s=1795000000.0,
    duration_s=0.012, value=24.0)], dropped=0)
    """

    role: Role
    name: Name
    spans: Annotated[list[Span], Meta(max_length=4096)]
    dropped: UInt = 0


# ---------------------------------------------------------------------------------------- control


@message(60)
class Heartbeat(WireStruct):
    """Liveness, both directions, every heartbeat_interval_s. Any message also counts as a sign of life.
    seq: counts up from 0 in each session of a peer; the trainer keeps one count for all its sessions.
    No receiver checks it.

    Example: Heartbeat(seq=41, wall_s=1795000000.0)
    """

    seq: UInt
    wall_s: Seconds = 0.0


@message(61)
class Shutdown(WireStruct):
    """The sender is stopping (trainer: the run ends, peers should exit; peer: it is leaving).

    Example: Shutdown(reason="run finished")
    """

    reason: LongText = ""


@message(62)
class Error(WireStruct):
    """The receiver could not handle a message, or (codes 405, 409, 410, from the trainer) no longer has a
    session with the sender. code: see ErrorCode. ref_kind: kind of the offending message (0 when unknown
    or none).

    Example: Error(code=401, text="Rollout.sample_id: expected int, got str", ref_kind=20)
    """

    code: Code
    text: LongText
    ref_kind: Annotated[int, Meta(ge=0, le=255)] = 0


@message(63)
class Credit(WireStruct):
    """Grants `credits` more messages in flight toward the sender (see flow control in SPEC.md).

    Example: Credit(credits=8)
    """

    credits: Annotated[int, Meta(ge=1, le=1 << 20)]
