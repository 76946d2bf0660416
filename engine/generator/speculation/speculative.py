"""Lossless speculative decoding inside the torch backend's continuous batch.

One speculative step with depth k, for every running row at once:

    catch up  the drafter runs over the columns whose drafter keys/values are stale (the previous step's
              accepted tokens, now with the policy's true hidden states; prompts of new rows; tokens
              decoded plainly) up to the pending token        -> q_1, draw d_1 ~ q_1
    draft     k - 1 more one-token drafter forwards, each fed its own predicted hidden state
                                                              -> q_2..q_k, d_2..d_k
    verify    ONE policy forward over [pending, d_1..d_k] (k + 1 columns) -> p_1..p_{k+1}
    accept    d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)) while all before it were kept; at
              the first rejection j one token is drawn from normalise(max(0, p_j - q_j)); if all k are
              kept, one more from p_{k+1}. Each emitted token is then exactly distributed as the policy's
              (Leviathan et al. 2023). p and q are both sampling.processed_logprobs (temperature,
              top-k, top-p), so truncation is identical; at temperature 0 both are one-hot and the rule
              reduces to exact greedy.
    commit    rows emit their own number of tokens (stop tokens and budgets cut it); columns of rejected
              tokens are marked invalid, so they leave the cache (kv.compact() squeezes them out when
              room runs short). Behaviour log-probs are the policy's processed log-probs of the emitted
              tokens; every token is stamped with the current policy version.

Two drafters, chosen per step (an Arm: off, eagle@k, suffix@k):
    eagle     the drafter model above (catch up + k - 1 draft forwards), q its processed distribution;
    suffix    suffix.SuffixDrafter, model-free: the text that followed the longest match of the row's
              last tokens in its prompt and its prompt's other samples; q is a point mass, so d_j is kept
              with probability p_j(d_j) and a rejection draws from p_j without d_j (accept_point_drafts).
              The drafter model's keys/values of a suffix step's columns are left stale, as after plain
              steps, and caught up at the next eagle step.

Randomness: each row draws 2k + 1 uniforms per eagle step from its own generator (k for drafting, k for
the acceptance tests, one for the final token), however many tokens it accepts, so a seeded sequence
decodes the same alone or in any batch for the same k; a suffix step draws k + 1 (its drafts, and so a
seeded row's tokens, depend on the other samples of its prompt).
The backend is used through its public members only (tests/engine/generator/speculation/test_backend_access.py
checks it): backend.rows, the running rows both share (torch_backend/rows.py: samples, cache, tokens to feed,
positions, completions, sampling batch), device, policy_version, lm_head, static_forwards and policy_forward().
Test: pytest tests/engine/generator/speculation/test_speculative.py
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.sampling import SamplingBatch, processed_logprobs
from tailrace.engine.generator.speculation.suffix import SuffixDrafter, pad_drafts

MAX_DRAFT_TOKENS = 8
"""Largest speculation depth k; the backend keeps this many spare cache columns for it."""
DRAFTERS = ("eagle", "suffix")


class Arm(NamedTuple):
    """What one decode step does: plain (OFF) or k drafts of one drafter, verified in one forward."""

    drafter: str  # "off" | "eagle" | "suffix"
    k: int

    def __str__(self) -> str:
        return "off" if self.k == 0 else f"{self.drafter}@{self.k}"


OFF = Arm("off", 0)


def as_arm(choice) -> Arm:
    """An Arm from an Arm, a depth (k drafts of the eagle drafter; 0 = off) or a label "suffix@4"."""
    if isinstance(choice, Arm):
        arm = choice
    elif isinstance(choice, int):
        arm = Arm("eagle", choice)
    else:
        drafter, _, depth = str(choice).partition("@")
        if drafter == "off" and not depth:
            return OFF
        if drafter not in DRAFTERS or not depth.isdigit():
            raise ValueError(f"speculation arm {choice!r} is not off, eagle@K or suffix@K")
        arm = Arm(drafter, int(depth))
    if not 0 <= arm.k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculation depth k must lie in [0, {MAX_DRAFT_TOKENS}], got {arm.k}")
    if arm.k and arm.drafter not in DRAFTERS:
        raise ValueError(f"speculation drafter {arm.drafter!r} is not one of {', '.join(DRAFTERS)}")
    return OFF if arm.k == 0 else arm


@dataclass
class Trace:
    """What the spot trainer learns from, one finished rollout. hidden[t] is the policy's last hidden
    state after token t, the one that predicted tokens[t + 1]; the drafter's input at token t + 1 is
    (hidden[t], tokens[t + 1]) and its target there is hidden[t + 1]."""

    tokens: torch.Tensor  # int64 [n]
    hidden: torch.Tensor  # [n - 1, H], the policy's dtype, CPU
    policy_version: int
    num_prompt_tokens: int = 1  # drafts only ever predict tokens after the prompt


@dataclass
class SpecStats:
    """Counters since construction. accept_len_hist[a]: row-steps that accepted a drafted tokens."""

    num_spec_steps: int = 0
    num_plain_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    accept_len_hist: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFT_TOKENS + 1))
    # Per depth j = 1..MAX_DRAFT_TOKENS (index j - 1): row-steps whose j-th draft was tested (drafted, with
    # every draft before it accepted), and those of them that accepted it.
    tested_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    accepted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    # Per drafter (DRAFTERS): speculative steps, drafted and accepted tokens.
    steps_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFTERS, 0))
    drafted_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFTERS, 0))
    accepted_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFTERS, 0))
    draft_s: float = 0.0   # seconds in drafting (drafter catch-up, draft forwards, sampling the drafts)
    verify_s: float = 0.0  # seconds in verification (the policy forward over k + 1 tokens, the acceptance rule)

    @property
    def mean_accept_len(self) -> float:
        """Drafted tokens accepted per row and speculative step."""
        row_steps = sum(self.accept_len_hist)
        return self.num_accepted / row_steps if row_steps else 0.0

    @property
    def accept_rate_by_depth(self) -> list[float]:
        """The rate at which the j-th draft was accepted given that every draft before it was, for the
        depths j = 1, 2, ... that were tested."""
        return [a / t for a, t in zip(self.accepted_by_depth, self.tested_by_depth, strict=True) if t]

    def record(self, k: int, accept_counts: list[int], drafter: str = "eagle") -> None:
        """One speculative step of depth k; accept_counts[a]: rows that accepted a drafts."""
        self.num_spec_steps += 1
        self.steps_by[drafter] += 1
        self.drafted_by[drafter] += k * sum(accept_counts)
        for a, count in enumerate(accept_counts):
            self.accept_len_hist[a] += count
            self.num_accepted += a * count
            self.accepted_by[drafter] += a * count
            for j in range(min(a + 1, k)):  # depths 1 .. a + 1 were tested, 1 .. a accepted
                self.tested_by_depth[j] += count
                self.accepted_by_depth[j] += count * (j < a)

    def counters(self) -> dict[str, float]:
        """Telemetry (role/group/name keys): steps, drafted/accepted tokens, acceptance lengths."""
        out = {"generator/spec/spec_steps": self.num_spec_steps, "generator/spec/plain_steps": self.num_plain_steps,
               "generator/spec/drafted": self.num_drafted, "generator/spec/accepted": self.num_accepted,
               "generator/spec/mean_accept_len": self.mean_accept_len,
               "generator/spec/accept_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
               "generator/spec/draft_s": self.draft_s, "generator/spec/verify_s": self.verify_s}
        out.update({f"generator/spec/accept_len_{a}": n for a, n in enumerate(self.accept_len_hist)})
        for name in DRAFTERS:
            drafted = self.drafted_by[name]
            out[f"generator/spec/{name}/steps"] = self.steps_by[name]
            out[f"generator/spec/{name}/accept_rate"] = self.accepted_by[name] / drafted if drafted else 0.0
        out.update({f"generator/spec/accept_rate_depth_{j + 1}": rate
                    for j, rate in enumerate(self.accept_rate_by_depth)})
        return out


def telemetry(backend, *sources) -> dict[str, float]:
    """The speculation counters of a backend (with its drafter version) merged with each source's
    stats() (the bandit's choices, the spot trainer's progress); empty without speculation."""
    if backend.spec_stats is None:
        return {}
    out = backend.spec_stats.counters()
    if backend.drafter is not None:
        out["generator/spec/drafter_version"] = backend.drafter.version
    for source in sources:
        out.update(source.stats())
    return out


def accept_drafts(p_logprobs_BNV: torch.Tensor, q_logprobs_BKV: torch.Tensor, drafts_BK: torch.Tensor,
                  u_accept_BK: torch.Tensor, u_final_B: torch.Tensor):
    """The lossless acceptance rule. p: the policy's processed log-probs at the k + 1 verified positions
    [B, k+1, V]; q: the drafter's at the k drafted ones [B, k, V]; drafts were drawn from q.
    Returns (num_accepted [B], tokens [B, k+1], policy log-probs of those tokens [B, k+1]): row b emits
    tokens[b, :num_accepted[b] + 1]; later entries are meaningless."""
    return accept_drafts_q_probs(p_logprobs_BNV, q_logprobs_BKV.exp(), drafts_BK, u_accept_BK, u_final_B)


def accept_drafts_q_probs(p_logprobs_BNV: torch.Tensor, q_probs_BKV: torch.Tensor, drafts_BK: torch.Tensor,
                          u_accept_BK: torch.Tensor, u_final_B: torch.Tensor):
    """accept_drafts with q given as probabilities, exp(q log-probs): drafting has them already, having
    drawn from them (the same values, so the same rule bit for bit)."""
    batch, num_drafts = drafts_BK.shape
    p_draft_BK = p_logprobs_BNV[:, :num_drafts].gather(-1, drafts_BK[..., None]).squeeze(-1).exp()
    q_draft_BK = q_probs_BKV.gather(-1, drafts_BK[..., None]).squeeze(-1)
    # u < p/q without dividing; q(d) > 0 because d was drawn from q.
    kept_BK = u_accept_BK * q_draft_BK < p_draft_BK
    num_accepted_B = kept_BK.to(torch.int64).cumprod(-1).sum(-1)
    rows_B = torch.arange(batch, device=drafts_BK.device)
    p_at_BV = p_logprobs_BNV[rows_B, num_accepted_B].exp()
    # q is 0 after the last draft, so "all accepted" draws from p_{k+1} itself.
    q_pad_BNV = torch.cat((q_probs_BKV, torch.zeros_like(q_probs_BKV[:, :1])), dim=1)
    residual_BV = (p_at_BV - q_pad_BNV[rows_B, num_accepted_B]).clamp_min(0.0)
    return _finish(p_logprobs_BNV, drafts_BK, num_accepted_B, p_at_BV, residual_BV, u_final_B)


def accept_point_drafts(p_logprobs_BNV: torch.Tensor, drafts_BK: torch.Tensor, u_accept_BK: torch.Tensor,
                        u_final_B: torch.Tensor):
    """accept_drafts for drafts that are certain (q = one-hot(d), a model-free drafter), without
    building q: d_j is kept with probability p_j(d_j); at the first rejection j the token is drawn from
    p_j with d_j removed (that is normalise(max(0, p_j - q_j))); if all k are kept, from p_{k+1}."""
    batch, num_drafts = drafts_BK.shape
    p_draft_BK = p_logprobs_BNV[:, :num_drafts].gather(-1, drafts_BK[..., None]).squeeze(-1).exp()
    num_accepted_B = (u_accept_BK < p_draft_BK).to(torch.int64).cumprod(-1).sum(-1)
    rows_B = torch.arange(batch, device=drafts_BK.device)
    p_at_BV = p_logprobs_BNV[rows_B, num_accepted_B].exp()
    rejected_B1 = (num_accepted_B < num_drafts)[:, None]
    draft_at_B1 = drafts_BK.gather(1, num_accepted_B.clamp_max(num_drafts - 1)[:, None])
    residual_BV = torch.where(rejected_B1, p_at_BV.scatter(1, draft_at_B1, 0.0), p_at_BV)
    return _finish(p_logprobs_BNV, drafts_BK, num_accepted_B, p_at_BV, residual_BV, u_final_B)


def _finish(p_logprobs_BNV: torch.Tensor, drafts_BK: torch.Tensor, num_accepted_B: torch.Tensor,
            p_at_BV: torch.Tensor, residual_BV: torch.Tensor, u_final_B: torch.Tensor):
    """The token after the kept drafts, drawn from the residual (from p itself when all k were kept, or
    when rounding alone emptied a rejection's residual, whose mass is positive in exact arithmetic), and
    the log-probs under p of every emitted token: (num_accepted [B], tokens [B, k+1], logprobs [B, k+1])."""
    empty_B1 = residual_BV.sum(-1, keepdim=True) <= 0
    final_B1 = sample_probs(torch.where(empty_B1, p_at_BV, residual_BV), u_final_B[:, None])
    tokens_BN = torch.cat((drafts_BK, final_B1), dim=1)
    tokens_BN.scatter_(1, num_accepted_B[:, None], final_B1)
    logprobs_BN = p_logprobs_BNV.gather(-1, tokens_BN[..., None]).squeeze(-1)
    return num_accepted_B, tokens_BN, logprobs_BN


def sample_probs(weights_BV: torch.Tensor, uniforms_B1: torch.Tensor, out_B1: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF draw [B, 1] from non-negative, unnormalised weights and uniforms [B, 1]; zero-weight
    tokens never come out (rounding can put the target at the total: the last token with mass wins).
    out_B1: where to write the draw (a column of a preallocated [B, k] buffer)."""
    cdf_BV = torch.cumsum(weights_BV, dim=-1)
    tokens_B1 = torch.searchsorted(cdf_BV, uniforms_B1 * cdf_BV[:, -1:], right=True)
    if out_B1 is None:
        return torch.minimum(tokens_B1, cdf_BV.argmax(-1, keepdim=True))
    return torch.minimum(tokens_B1, cdf_BV.argmax(-1, keepdim=True), out=out_B1)


def draw_uniforms_many(generators, num: int, device) -> torch.Tensor:
    """num U[0, 1) per row [B, num], row i from generators[i], drawn on the CPU."""
    u_BU = torch.empty(len(generators), num, dtype=torch.float32)
    for i, gen in enumerate(generators):
        u_BU[i].uniform_(generator=gen)
    return u_BU.to(device, non_blocking=True)


def repeat_batch(batch: SamplingBatch, num: int) -> SamplingBatch:
    """The sampling settings of each row repeated num times (row-major): for [B * num, V] logits."""
    return dataclasses.replace(
        batch, temperature_B=batch.temperature_B.repeat_interleave(num),
        top_k_B=batch.top_k_B.repeat_interleave(num), top_p_B=batch.top_p_B.repeat_interleave(num),
        truncates_B=batch.truncates_B.repeat_interleave(num), divisor_B1=batch.divisor_B1.repeat_interleave(num, 0),
        generators=tuple(g for g in batch.generators for _ in range(num)))


class SpeculativeDecoder:
    """The drafter's share of the backend: its cache layer, per-column token ids and hidden states,
    per-row pending features, and the speculative step. Created by TorchBackend.enable_speculation."""

    def __init__(self, backend, drafter: Drafter | None, max_traces: int):
        """backend: a torch_backend.TorchBackend (its public members: see the module docstring).
        drafter None: model-free (suffix) drafts only, without the EAGLE drafter's cache layer, column
        states and per-step bookkeeping (and without traces: they are the drafter's training data)."""
        self.backend = backend
        self.rows = backend.rows
        self.drafter = None if drafter is None else drafter.eval()
        kv = self.rows.kv
        if self.eagle:
            self.layer = kv.add_layer()
            hidden, dtype = drafter.config.hidden_size, backend.lm_head.weight.dtype
            self.ids_RC = kv.add_column_state(1, torch.long)[..., 0]  # a view: layout changes move it in place
            self.pos_RC = kv.add_column_state(1, torch.long)[..., 0]  # the token's position (not its column)
            self.feats_RCH = kv.add_column_state(hidden, dtype)       # input feature: the previous token's h
            self.pending_feat_RH = torch.zeros(kv.max_rows, hidden, dtype=dtype, device=backend.device)
            self.rows.add_row_state(self.pending_feat_RH)  # moves with its row
            if backend.static_forwards is not None:
                backend.static_forwards.attach_drafter(self.drafter, self.layer)
        else:
            max_traces = 0
        self.stale_back = 0  # columns end - stale_back .. end - 1 lack true-feature drafter keys/values
        self._stale_carry = 0  # a suffix step's stale columns before its own (commit adds them)
        self.suffix = SuffixDrafter()
        self.stats = SpecStats()
        self.traces: deque[Trace] = deque(maxlen=max_traces)
        self._batches: dict[int, SamplingBatch] = {}
        self._batch_of: SamplingBatch | None = None
        self._arange_of: dict[int, torch.Tensor] = {}

    @property
    def eagle(self) -> bool:
        """Whether the EAGLE drafter is attached (else suffix drafts only, none of its bookkeeping)."""
        return self.drafter is not None

    # ------------------------------------------------------------------ bookkeeping hooks (plain paths)

    def on_admit(self, first: int, lengths: list[int], ids_bT: torch.Tensor | None,
                 hidden_bTH: torch.Tensor | None) -> None:
        """New rows first.. were prefilled with ids_bT (left-padded, ending at column end)."""
        if not self.eagle:
            return
        kv, rows = self.rows.kv, slice(first, first + len(lengths))
        self.pending_feat_RH[rows] = 0.0
        if ids_bT is None:
            return
        width = ids_bT.shape[1]
        start = kv.end - width
        self.ids_RC[rows, start:kv.end] = ids_bT
        pad_b1 = torch.tensor([width - n for n in lengths], device=kv.device)[:, None]
        self.pos_RC[rows, start:kv.end] = (torch.arange(width, device=kv.device) - pad_b1).clamp_min(0)
        shifted_bTH = torch.cat((torch.zeros_like(hidden_bTH[:, :1]), hidden_bTH[:, :-1]), dim=1)
        # The first token of each row has no predecessor: its feature is zero, not a padding column's.
        is_first_bT = torch.arange(width, device=kv.device)[None, :] == pad_b1
        self.feats_RCH[rows, start:kv.end] = shifted_bTH.masked_fill(is_first_bT[..., None], 0.0)
        has_prefill_b1 = torch.tensor(lengths, device=kv.device)[:, None] > 0
        self.pending_feat_RH[rows] = torch.where(has_prefill_b1, hidden_bTH[:, -1], 0.0)
        self.stale_back = max(self.stale_back, width)

    def on_resume(self, row: int, ids_1T: torch.Tensor, positions_1T: torch.Tensor, hidden_1TH: torch.Tensor,
                  num_cached: int) -> None:
        """An episode row came back (backend.TorchBackend.resume) with its cached columns and per-column state
        copied, and was prefilled with ids_1T ending at column end. Its drafter inputs for the new columns are
        set as a plain step would (the first one's feature is the row's pending one, restored with it), and
        the drafter keys/values of its whole span are recomputed at the next eagle step: they moved columns
        and may predate a drafter update. Drafts only change acceptance, never the tokens' distribution."""
        if not self.eagle:
            return
        kv, width = self.rows.kv, ids_1T.shape[1]
        cols = slice(kv.end - width, kv.end)
        self.ids_RC[row, cols] = ids_1T[0]
        self.pos_RC[row, cols] = positions_1T[0]
        self.feats_RCH[row, cols] = torch.cat((self.pending_feat_RH[row, None], hidden_1TH[0, :-1]))
        self.pending_feat_RH[row] = hidden_1TH[0, -1]
        self.stale_back = max(self.stale_back, num_cached + width)

    def before_plain_forward(self, num_rows: int, col: int) -> None:
        if not self.eagle:
            return
        self.ids_RC[:num_rows, col] = self.rows.pending_R[:num_rows]
        self.pos_RC[:num_rows, col] = self.rows.pos_R[:num_rows]
        self.feats_RCH[:num_rows, col] = self.pending_feat_RH[:num_rows]

    def after_plain_forward(self, num_rows: int, hidden_BH: torch.Tensor) -> None:
        self.stats.num_plain_steps += 1
        if self.eagle:
            self.pending_feat_RH[:num_rows] = hidden_BH
            self.stale_back += 1

    def drafter_changed(self) -> None:
        """New drafter weights: every cached drafter key/value is recomputed at the next step."""
        if not self.eagle:
            return
        kv = self.rows.kv
        self.stale_back = kv.end - kv.lo

    def capture(self, row: int, tokens: torch.Tensor, num_prompt_tokens: int) -> None:
        """Keep the trace of a finished row (prompt + completion `tokens`) for the spot trainer."""
        kv = self.rows.kv
        cols = kv.valid_RC[row, kv.lo:kv.end].nonzero().flatten() + kv.lo
        hidden = torch.cat((self.feats_RCH[row, cols[1:]], self.pending_feat_RH[row, None]))
        assert hidden.shape[0] == tokens.numel() - 1, "trace: hidden states and tokens out of step"
        with torch.inference_mode(False):  # ordinary tensors: the spot trainer learns from them
            trace = Trace(tokens.to("cpu", copy=True), hidden.to("cpu", copy=True), self.backend.policy_version,
                          num_prompt_tokens)
        self.traces.append(trace)

    # ------------------------------------------------------------------ the speculative step

    def step(self, arm: Arm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One speculative step of k drafts from arm's drafter for every running row. Returns (tokens
        [B, k+1], policy log-probs [B, k+1], accepted drafts [B], hidden states [B, k+1, H]); nothing is
        committed."""
        k, suffix = arm.k, arm.drafter == "suffix"
        assert 1 <= k <= MAX_DRAFT_TOKENS
        if not (suffix or self.eagle):
            raise ValueError(f"speculation arm {arm}: speculation was enabled without an EAGLE drafter")
        b, kv = self.backend, self.rows.kv
        num_rows = self.rows.num_rows
        kv.make_room(num_rows, k + 1)
        batch = self._sampling()
        num_uniforms = k + 1 if suffix else 2 * k + 1
        uniforms_BU = (torch.zeros(num_rows, num_uniforms, device=b.device) if batch.all_greedy
                       else draw_uniforms_many(batch.generators, num_uniforms, b.device))
        start_s = time.perf_counter()
        if suffix:
            drafts_BK = self._suffix_draft(num_rows, k)
        else:
            drafts_BK, q_BKV = self._draft(num_rows, k, batch, uniforms_BU[:, :k])
        drafted_s = time.perf_counter()
        hidden_BNH, p_BNV = self._verify(num_rows, k, drafts_BK)
        if suffix:
            num_accepted_B, tokens_BN, logprobs_BN = accept_point_drafts(
                p_BNV, drafts_BK, uniforms_BU[:, :k], uniforms_BU[:, k])
        else:
            num_accepted_B, tokens_BN, logprobs_BN = accept_drafts_q_probs(
                p_BNV, q_BKV, drafts_BK, uniforms_BU[:, k:2 * k], uniforms_BU[:, 2 * k])
        # Host clocks: on an accelerator they time the launches unless something synchronises (the
        # backend's commit does, right after).
        self.stats.draft_s += drafted_s - start_s
        self.stats.verify_s += time.perf_counter() - drafted_s
        return tokens_BN, logprobs_BN, num_accepted_B, hidden_BNH

    def _suffix_draft(self, num_rows: int, k: int) -> torch.Tensor:
        """Drafts [B, k] from the suffix indexes: each row's new tokens are added to its prompt's index
        first (one host copy of the columns some row has not added yet), then the longest match of its
        last tokens proposes; rows with a short or no proposal are padded with their pending token."""
        rows = self.rows
        # The pending column gets its drafter inputs as in a plain step; its drafter keys/values, and
        # those of this step's columns, are computed at the next eagle step.
        if self.eagle:
            self.before_plain_forward(num_rows, rows.kv.end)
            self._stale_carry = self.stale_back + 1
        texts = []
        for seq in rows.seqs:
            if seq.suffix is None:
                seq.suffix = self.suffix.start(seq.request.prompt_ids)
            texts.append(seq.suffix)
        num_gen = rows.num_gen_R[:num_rows].tolist()
        lo, hi = min(t.num_indexed for t in texts), max(num_gen)
        block = rows.out_tokens_RL[:num_rows, lo:hi].tolist() if hi > lo else None
        proposals, fallback = [], []
        for row, text in enumerate(texts):
            if num_gen[row] > text.num_indexed:
                text.index.extend(text.seq_id, block[row][text.num_indexed - lo:num_gen[row] - lo])
                text.num_indexed = num_gen[row]
            proposals.append(self.suffix.propose(text, k))
            fallback.append(text.index.seqs[text.seq_id][-1])
        return pad_drafts(proposals, k, fallback).to(rows.device, non_blocking=True)

    def on_finish(self, seq, completion_ids: list[int]) -> None:
        """A finished sample's text joins its prompt's index, for the prompt's later samples."""
        if seq.suffix is None:
            seq.suffix = self.suffix.start(seq.request.prompt_ids)
        self.suffix.add_tokens(seq.suffix, completion_ids)

    def _sampling(self) -> SamplingBatch:
        """The rows' sampling batch; the repeats made of the previous one are dropped when it changed."""
        batch = self.rows.sampling()
        if self._batch_of is not batch:
            self._batch_of, self._batches = batch, {}
        return batch

    def _repeated(self, num: int) -> SamplingBatch:
        if num not in self._batches:
            self._batches[num] = repeat_batch(self._batch_of, num)
        return self._batches[num]

    def _draft(self, num_rows: int, k: int, batch: SamplingBatch, u_BK: torch.Tensor):
        """Catch the drafter up to the pending token, then draft k tokens. Returns (drafts [B, k],
        the drafter's processed probabilities [B, k, V], exp of its processed log-probs)."""
        b, state, rows = self.backend, self.rows, slice(0, num_rows)
        kv, end = state.kv, state.kv.end
        # The pending column and the k - 1 draft columns the drafter itself writes; a forward at column
        # c attends only up to c, so later ones being marked already changes nothing.
        kv.valid_RC[rows, end:end + k] = True
        self.ids_RC[rows, end] = state.pending_R[rows]
        self.pos_RC[rows, end] = state.pos_R[rows]
        self.feats_RCH[rows, end] = self.pending_feat_RH[rows]
        start = max(end - self.stale_back, kv.lo)
        kv.set_window(rows, start, kv.lo)
        mask = kv.attention_mask(rows, start, end + 1 - start, kv.lo)
        window = slice(start, end + 1)
        # forward() called directly: nn.Module.__call__'s hook handling costs more than it does here.
        # Every op of the loop below runs k times per step, and on a CPU each dispatch costs about as
        # much as its arithmetic: so the rotary factors of the k positions are looked up once, and the
        # draws and probabilities are written into their [B, k] buffers instead of being concatenated.
        forward, logits, static = self.drafter.forward, self.drafter.logits, b.static_forwards
        hidden_B1H = forward(self.ids_RC[rows, window], self.feats_RCH[rows, window], self.pos_RC[rows, window],
                             mask, cache=kv, layer_idx=self.layer)[:, -1:]
        self.stale_back = self._stale_carry = 0
        turns_B1Kc = self.drafter.rotary(state.pos_R[rows, None] + self._aranges(k))
        drafts_BK, q_BKV = torch.empty(num_rows, k, dtype=torch.long, device=b.device), None
        # One-token draft forwards: their masks are prefixes of this one (columns lo .. end + k - 1).
        mask_B11K = kv.valid_RC[rows, kv.lo:end + k][:, None, None]
        for j in range(k):
            if j > 0 and static is not None:
                hidden_B1H = static.drafter(num_rows, drafts_BK[:, j - 1:j], hidden_B1H, turns_B1Kc[:, :, j:j + 1],
                                            end + j)
            elif j > 0:
                col = end + j
                kv.set_window(rows, col, kv.lo)
                hidden_B1H = forward(drafts_BK[:, j - 1:j], hidden_B1H, None, mask_B11K[..., :col + 1 - kv.lo],
                                     cache=kv, layer_idx=self.layer, turns_B1Tc=turns_B1Kc[:, :, j:j + 1])
            q_logprobs_BV = processed_logprobs(logits(hidden_B1H[:, 0]), batch)
            if q_BKV is None:
                q_BKV = q_logprobs_BV.new_empty(num_rows, k, q_logprobs_BV.shape[-1])
            q_BV = torch.exp(q_logprobs_BV, out=q_BKV[:, j])
            sample_probs(q_BV, u_BK[:, j:j + 1], out_B1=drafts_BK[:, j:j + 1])
        return drafts_BK, q_BKV

    def _aranges(self, num: int) -> torch.Tensor:
        """0 .. num - 1 on the device, made once per length."""
        if num not in self._arange_of:
            self._arange_of[num] = torch.arange(num, device=self.backend.device)
        return self._arange_of[num]

    def _verify(self, num_rows: int, k: int, drafts_BK: torch.Tensor):
        """One policy forward over [pending, drafts]: hidden [B, k+1, H] and processed log-probs."""
        b, state, rows = self.backend, self.rows, slice(0, num_rows)
        end = state.kv.end
        state.kv.valid_RC[rows, end:end + k + 1] = True
        ids_BN = torch.cat((state.pending_R[rows, None], drafts_BK), dim=1)
        positions_BN = state.pos_R[rows, None] + self._aranges(k + 1)
        hidden_BNH = b.policy_forward(num_rows, ids_BN, positions_BN, end)
        logits_MV = b.lm_head(hidden_BNH).flatten(0, 1)
        p_BNV = processed_logprobs(logits_MV, self._repeated(k + 1)).view(num_rows, k + 1, -1)
        return hidden_BNH, p_BNV

    def commit(self, arm: Arm, tokens_BN: torch.Tensor, num_emit_B: torch.Tensor, emit_counts: list[int],
               hidden_BNH: torch.Tensor, accepted: list[int]) -> None:
        """Keep the fed columns of emitted tokens, drop the rest, advance the pending token (emit_counts:
        num_emit_B on the host; accepted: each row's accepted drafts, on the host). The columns no row keeps (past the widest row's emitted tokens) are
        handed back: end advances by that many, not k + 1, so a batch of one never leaves holes and
        attention windows stay short."""
        state, kv, k = self.rows, self.rows.kv, arm.k
        num_rows = tokens_BN.shape[0]
        rows, end = slice(0, num_rows), kv.end
        arange_N = self._aranges(k + 1)
        # The pending token and the first num_emit - 1 drafts stay; the last emitted token is pending.
        kv.valid_RC[rows, end:end + k + 1] = arange_N[None, :] < num_emit_B[:, None]
        max_emit = max(emit_counts)
        kv.end = end + max_emit
        if self.eagle:
            self.ids_RC[rows, end + 1:end + k + 1] = tokens_BN[:, :k]
            self.pos_RC[rows, end + 1:end + k + 1] = state.pos_R[rows, None] + arange_N[1:]
            self.feats_RCH[rows, end + 1:end + k + 1] = hidden_BNH[:, :k]
            last_B = num_emit_B - 1
            self.pending_feat_RH[rows] = hidden_BNH[state.arange_R[:num_rows], last_B]
            # After an eagle step the pending column's drafter keys/values were computed from its true
            # feature; the emitted drafts after it were fed predicted features, so they are recomputed
            # at the next step. A suffix step adds its columns to the stale ones it found (_stale_carry).
            self.stale_back = max_emit - 1 + self._stale_carry
            self._stale_carry = 0
        self.stats.num_drafted += k * num_rows
        self.stats.num_emitted += sum(emit_counts)
        accept_counts = [0] * (k + 1)
        for num in accepted:
            accept_counts[num] += 1
        self.stats.record(k, accept_counts, arm.drafter)


class FixedDepth:
    """A speculation policy that always uses depth k of one drafter (tests, benchmarks); the bandit is the
    adaptive one."""

    def __init__(self, k: int, drafter: str = "eagle"):
        self.arm = as_arm(Arm(drafter, k))
        self.k = k

    def choose(self, num_running: int) -> Arm:
        return self.arm

    def update(self, num_running: int, arm, num_tokens: int, seconds: float) -> None:
        pass
