"""Drafter training in idle turns (the spot trainer): a generator with no work trains its drafter on the
policy's own recent rollouts.

    backend.take_traces() --add()--> TraceBuffer (bounded: tokens, and the last few policy versions)
    idle generator: run(should_yield) --> train_step() ... each step packs ~tokens_per_step tokens of
                    random traces into rows of row_tokens (block-causal mask: no attention across
                    samples) and takes one AdamW step; should_yield() is asked before every step, so
                    the generator gets the thread back within one (small) step of work arriving
    export() / load_shared() --> the drafter state shared with other generators, versioned (a newer
                    version from elsewhere replaces ours and restarts the optimizer)

Alignment (the bug in TLT's released code): the drafter input at token t + 1 is (hidden[t], tokens[t+1])
and its target is hidden[t + 1] — the hidden state that predicted the token after. Loss: KL(p || q)
between the policy's and the drafter's next-token distributions (temperature 1), which bounds the
acceptance rate's shortfall (1 - acceptance = total variation), plus a smooth-L1 on the hidden state
weighted 3: every draft after the first of a step is fed the drafter's own predicted hidden state, so a
state that stays close to the policy's is what later drafts are accepted on (on the 12-layer
tiny_longtail, weight 0.1 -> 3 raised the acceptance of a step's drafts 1 / 2 / 3 from 0.86 / 0.44 / 0.50
to 0.87 / 0.81 / 0.76). Optionally, unrolled passes feed the drafter its own predictions, as drafting
does at depth >= 2 (for the same training time, one pass beside weight 3 did worse there: 0.74 / 0.70 /
0.63). Many small steps beat fewer large ones: on the tiny model the drafter learns the task's lookup
after ~1000 steps, whatever their size.
Test: pytest tests/engine/generator/speculation/test_drafter.py
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.speculation.speculative import Trace


@dataclass(kw_only=True)
class SpotConfig:
    max_buffer_tokens: int = 1 << 17  # tokens of recent rollouts kept for training ...
    max_buffer_bytes: int = 256 << 20  # ... and at most this much memory of hidden states
    keep_versions: int = 3  # traces of older policy versions than newest - keep_versions + 1 are dropped
    tokens_per_step: int = 256  # packed tokens per step: the preemption granularity
    row_tokens: int = 256  # packed row length (a longer trace is cut): attention cost ~ row_tokens^2
    lr: float = 3e-3
    hidden_loss_weight: float = 3.0  # the smooth-L1 on predicted hidden states, beside the KL (see above)
    # Also train on the drafter's own predicted features, as every draft after the first of a step sees
    # them (drafter_passes): this many unrolled passes (depths 2 .. unroll + 1), each costing about
    # one more teacher-forced pass. Off by default: for the same training time, acceptance at depth >= 2
    # did not rise with one pass on the tiny model (0.862 without, 0.839 with), nor with 1-3 passes on
    # tiny_longtail (fewer steps in the time; the hidden-state weight did more).
    unroll: int = 0

    def __post_init__(self):
        for name in ("max_buffer_tokens", "max_buffer_bytes", "keep_versions", "tokens_per_step", "row_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"spot.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= int(self.unroll) < 8:
            raise ValueError(f"spot.unroll must lie in [0, 7] (unrolled passes), got {self.unroll}")
        if not self.lr > 0:
            raise ValueError(f"spot.lr must be > 0, got {self.lr}")
        if not self.hidden_loss_weight >= 0:
            raise ValueError(f"spot.hidden_loss_weight must be >= 0, got {self.hidden_loss_weight}")


class TraceBuffer:
    """Recent traces, oldest evicted first beyond max_tokens or keep_versions policy versions."""

    def __init__(self, max_tokens: int, keep_versions: int):
        self.max_tokens = max_tokens
        self.keep_versions = keep_versions
        self._traces: deque[Trace] = deque()
        self.num_tokens = 0
        self.newest_version = -1

    def __len__(self) -> int:
        return len(self._traces)

    def add(self, trace: Trace) -> None:
        if trace.tokens.numel() < 2 or trace.policy_version <= self.newest_version - self.keep_versions:
            return  # nothing to learn (no hidden state precedes a token), or too old a policy
        self._traces.append(trace)
        self.num_tokens += trace.tokens.numel()
        if trace.policy_version > self.newest_version:
            self.newest_version = trace.policy_version
            oldest_kept = self.newest_version - self.keep_versions + 1
            self._traces = deque(t for t in self._traces if t.policy_version >= oldest_kept)
            self.num_tokens = sum(t.tokens.numel() for t in self._traces)
        while self.num_tokens > self.max_tokens:
            self.num_tokens -= self._traces.popleft().tokens.numel()

    def sample(self, rng: random.Random, num_tokens: int) -> list[Trace]:
        """Random traces until their training positions reach num_tokens (the last may be cut)."""
        out, total = [], 0
        while self._traces and total < num_tokens:
            trace = self._traces[rng.randrange(len(self._traces))]
            out.append(trace)
            total += trace.tokens.numel() - 1
        return out


@dataclass
class Packed:
    """Training positions of traces packed into rows [R, T]: each row holds whole traces one after
    another, then padding. For t = 0 .. n - 2 of a trace: ids = tokens[t], features = hidden[t - 1]
    (zeros at t = 0), targets = hidden[t]; that is, hidden state t is the feature paired with token t + 1.
    segments: the trace's index in the batch, -1 on padding. loss: the positions whose prediction a
    draft can ever be (t >= num_prompt_tokens - 1); prompt positions are attended to, not learnt."""

    ids_RT: torch.Tensor
    features_RTH: torch.Tensor
    targets_RTH: torch.Tensor
    positions_RT: torch.Tensor
    segments_RT: torch.Tensor
    loss_RT: torch.Tensor


def _trace_positions(trace: Trace, num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = trace.hidden[:num]
    features = torch.cat((torch.zeros_like(hidden[:1]), hidden[:num - 1]))
    return trace.tokens[:num], features, hidden


def pack(traces: Iterable[Trace], max_tokens: int, row_tokens: int = 256,
         device: torch.device | str = "cpu") -> Packed:
    """Pack traces, in order, into rows of row_tokens positions (a longer trace is cut to one row),
    stopping at max_tokens positions in all (the last trace may be cut). Short rows keep attention
    cheap: its cost grows with the square of the row, not of the whole batch."""
    rows: list[list[tuple]] = [[]]  # (trace index, ids, features, targets, first loss position)
    used, total = 0, 0
    for j, trace in enumerate(traces):
        num = min(trace.tokens.numel() - 1, row_tokens, max_tokens - total)
        if num <= 0:
            break
        if used + num > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append((j, *_trace_positions(trace, num), max(trace.num_prompt_tokens - 1, 0)))
        used += num
        total += num
    if total == 0:
        raise ValueError("pack: no trace with at least two tokens")
    width = max(sum(entry[1].numel() for entry in row) for row in rows)
    hidden_size, dtype = rows[0][0][2].shape[-1], rows[0][0][2].dtype
    ids_RT = torch.zeros(len(rows), width, dtype=torch.long)
    features_RTH = torch.zeros(len(rows), width, hidden_size, dtype=dtype)
    targets_RTH = torch.zeros(len(rows), width, hidden_size, dtype=dtype)
    positions_RT = torch.zeros(len(rows), width, dtype=torch.long)
    segments_RT = torch.full((len(rows), width), -1, dtype=torch.long)
    loss_RT = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        col = 0
        for j, ids, features, targets, first_loss in row:
            span = slice(col, col + ids.numel())
            ids_RT[r, span], features_RTH[r, span], targets_RTH[r, span] = ids, features, targets
            positions_RT[r, span] = torch.arange(ids.numel())
            segments_RT[r, span] = j
            loss_RT[r, col + first_loss:col + ids.numel()] = True
            col += ids.numel()
    return Packed(*(t.to(device) for t in (ids_RT, features_RTH, targets_RTH, positions_RT, segments_RT, loss_RT)))


def block_causal_mask(segments_RT: torch.Tensor) -> torch.Tensor:
    """[R, 1, T, T] (True = attend): causal, and only within the same segment (padding, -1, sees
    padding only, so no query row is empty)."""
    index_T = torch.arange(segments_RT.shape[-1], device=segments_RT.device)
    same_RTT = segments_RT[:, :, None] == segments_RT[:, None, :]
    return (same_RTT & (index_T[None, :] <= index_T[:, None]))[:, None]


class KeyRecorder:
    """Stands in for the KV cache in a training forward: keeps the new keys/values it is handed and
    returns them after `earlier` ones (a pair of [R, h, T, d] tensors), if any."""

    def __init__(self, earlier: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.earlier = earlier
        self.keys = self.values = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int):
        self.keys, self.values = keys, values
        if self.earlier is None:
            return keys, values
        return torch.cat((self.earlier[0], keys), dim=2), torch.cat((self.earlier[1], values), dim=2)


def drafter_passes(drafter: Drafter, packed: Packed, unroll: int) -> list[tuple[str, torch.Tensor]]:
    """The drafter's predicted hidden states [R, T, H] on packed traces: ("tf", ...), then one pass per
    unrolled depth ("unroll", "unroll2", ...: `unroll` of them; True counts as 1).

    Teacher forced (the first draft of a step): position t gets the policy's hidden state of t - 1.
    Unrolled pass d (the (d + 1)-th draft of a step, whose pending token is t - d): position t gets pass
    d - 1's prediction for t - 1, and attends to the teacher-forced keys/values up to t - d (what the
    catch-up wrote from true features), to pass i's key at t - d + i for i = 1 .. d - 1 (the earlier
    drafts of the same step) and to its own key: exactly what a draft forward at depth d + 1 sees."""
    causal = block_causal_mask(packed.segments_RT)
    teacher = KeyRecorder()
    pred_RTH = drafter(packed.ids_RT, packed.features_RTH, packed.positions_RT, causal, cache=teacher)
    passes = [("tf", pred_RTH)]
    keys, values = [teacher.keys], [teacher.values]
    index_T = torch.arange(causal.shape[-1], device=causal.device)
    back_TT = index_T[:, None] - index_T[None, :]  # t - j
    same_R1TT = causal | causal.transpose(-1, -2)  # the same segment, either order
    first_RT1 = (packed.positions_RT == 0)[..., None]
    for depth in range(1, int(unroll) + 1):
        blocks = [causal & (back_TT >= depth)]  # teacher-forced keys up to t - depth
        blocks += [same_R1TT & (back_TT == depth - i) for i in range(1, depth + 1)]  # pass i's key at t - depth + i
        shifted = torch.cat((torch.zeros_like(pred_RTH[:, :1]), pred_RTH[:, :-1].detach()), dim=1)
        cache = KeyRecorder(earlier=(torch.cat(keys, dim=2), torch.cat(values, dim=2)))
        pred_RTH = drafter(packed.ids_RT, shifted.masked_fill(first_RT1, 0.0), packed.positions_RT,
                           torch.cat(blocks, dim=-1), cache=cache)
        keys.append(cache.keys)
        values.append(cache.values)
        passes.append(("unroll" if depth == 1 else f"unroll{depth}", pred_RTH))
    return passes


def drafter_loss(drafter: Drafter, packed: Packed, hidden_loss_weight: float, unroll: int):
    """(loss, metrics): KL(policy || drafter) + weighted smooth-L1 on the hidden state, averaged over
    the passes of drafter_passes. Pass d learns at positions >= d of a trace only (a draft at depth
    d + 1 has a pending token d positions before it)."""
    target_logp = torch.log_softmax(drafter.logits(packed.targets_RTH).float(), dim=-1)
    losses, metrics = [], {}
    for depth, (name, pred) in enumerate(drafter_passes(drafter, packed, unroll)):
        learn_RT = packed.loss_RT & (packed.positions_RT >= depth)
        num_learn = learn_RT.sum().clamp_min(1)
        logq = torch.log_softmax(drafter.logits(pred).float(), dim=-1)
        kl_RT = F.kl_div(logq, target_logp, log_target=True, reduction="none").sum(-1)
        hidden_RT = F.smooth_l1_loss(pred.float(), packed.targets_RTH.float(), reduction="none").mean(-1)
        kl = (kl_RT * learn_RT).sum() / num_learn
        losses.append(kl + hidden_loss_weight * (hidden_RT * learn_RT).sum() / num_learn)
        with torch.no_grad():
            accept_RT = torch.minimum(logq.exp(), target_logp.exp()).sum(-1)
            metrics[f"kl_{name}"] = float(kl)
            metrics[f"accept_{name}"] = float((accept_RT * learn_RT).sum() / num_learn)
    loss = sum(losses) / len(losses)
    metrics["loss"] = float(loss.detach())
    return loss, metrics


class SpotTrainer:
    """Trains `drafter` in place: the same object the backend drafts with, so train while the backend
    has no running rows (or call backend.drafter_changed() after). Not thread-safe."""

    def __init__(self, drafter: Drafter, config: SpotConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0):
        self.drafter = drafter
        self.config = config or SpotConfig()
        param = next(drafter.parameters())
        bytes_per_token = drafter.config.hidden_size * param.element_size()
        max_tokens = min(self.config.max_buffer_tokens, self.config.max_buffer_bytes // bytes_per_token)
        self.buffer = TraceBuffer(max_tokens, self.config.keep_versions)
        self.clock = clock
        self.num_steps = 0
        self.train_s = 0.0
        self.last_metrics: dict[str, float] = {}
        self._rng = random.Random(seed)
        self._device = param.device
        self._optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.drafter.parameters(), lr=self.config.lr, weight_decay=0.0)

    def add_traces(self, traces: Iterable[Trace]) -> None:
        for trace in traces:
            self.buffer.add(trace)

    def has_data(self) -> bool:
        return len(self.buffer) > 0

    def train_step(self) -> dict[str, float] | None:
        """One small optimizer step on ~tokens_per_step packed tokens; None when the buffer is empty."""
        if not self.has_data():
            return None
        start_s = self.clock()
        cfg = self.config
        packed = pack(self.buffer.sample(self._rng, cfg.tokens_per_step), cfg.tokens_per_step, cfg.row_tokens,
                      self._device)
        self.drafter.train().requires_grad_(True)
        try:
            loss, metrics = drafter_loss(self.drafter, packed, cfg.hidden_loss_weight, cfg.unroll)
            self._optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self._optimizer.step()
        finally:
            self.drafter.eval().requires_grad_(False)  # cheaper forwards while drafting
        self.num_steps += 1
        self.train_s += self.clock() - start_s
        self.last_metrics = metrics
        return metrics

    def run(self, should_yield: Callable[[], bool], max_steps: int | None = None) -> int:
        """Train until should_yield() (asked before every step), the buffer is empty or max_steps;
        returns the number of steps taken."""
        steps = 0
        while (max_steps is None or steps < max_steps) and not should_yield():
            if self.train_step() is None:
                break
            steps += 1
        return steps

    # ------------------------------------------------------------------ sharing

    def export(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, state) to publish as the "drafter" weights: the next version after the one this
        drafter started from; the publisher may renumber (load_shared then adopts its number)."""
        self.drafter.version += 1
        return self.drafter.version, self.drafter.export_state()

    def load_shared(self, state: dict[str, torch.Tensor], version: int) -> bool:
        """Adopt a drafter version trained elsewhere if it is newer than ours; the optimizer restarts
        (its moments belong to the weights it replaced). Returns whether it was adopted."""
        if version <= self.drafter.version:
            return False
        self.drafter.load_state(state, version)
        self._optimizer = self._new_optimizer()
        return True

    def stats(self) -> dict[str, float]:
        """Telemetry counters (role/group/name keys)."""
        out = {"generator/drafter/version": self.drafter.version, "generator/drafter/train_steps": self.num_steps,
               "generator/drafter/train_s": self.train_s, "generator/drafter/buffer_tokens": self.buffer.num_tokens}
        out.update({f"generator/drafter/{k}": v for k, v in self.last_metrics.items()})
        return out
