"""The built-in torch backend: continuous batching over a Hugging Face causal LM, synchronous.

    add(request) -> waiting (FIFO) --admit: prefill prompt[:-1] into free rows--> running rows
    step():  admit (unless pause_admission) -> one decode forward for every running row
             -> sample one token per row -> rows that hit a stop token / eos / length leave
    update_weights() between steps: running rows keep their cache (PipelineRL-style in-flight update)

Every step feeds each running row exactly one token (a new row's first fed token is the last prompt
token), so sampling, log-probs, versions and stop checks happen once per step, batched. The running
rows (their samples, tokens to feed, positions, budgets, stop ids and completions) are rows.RowState,
self.rows, shared with speculative decoding; their key/value columns live in its kv.SlotKVCache.
Attention masks and positions are built here and passed to the model, so no Hugging Face mask or cache
logic is involved.
Speculative decoding (enable_speculation: a drafter and a depth policy, e.g. the bandit, choosing an arm:
off, eagle@k or the model-free suffix@k) replaces the decode step by speculative.SpeculativeDecoder.step
(one host sync per step): k drafted tokens verified by one policy_forward() with
T = k + 1 new tokens per row; each row then emits its own number of tokens and rejected columns are set
invalid in kv.valid_RC. Finished rows leave a speculative.Trace for the spot trainer (take_traces()).
Multi-turn episodes (Request.episode): a row whose assistant turn ends (any stop token: eos, the chat template's
end-of-turn token, the request's stop ids; a token that completes one of Request.stop_strings) leaves the batch
as Finished "turn" with its cached keys/values copied out (parked); resume(key, observation) brings it back into
a free row at a later admission and prefills the observation against that cache, then decoding goes on in the
same row; finish(key, reason) ends it. A parked row holds no batch row, but counts against capacity() until it
is finished, so the service never takes more samples than max_batch_size rows can hold when they all come back.
Stop strings (stop_strings.py) are scanned on the host, per row that has them, over the tokens each step emits.
Tree sampling (tree=tree.TreeSampling): a group's samples start as one trunk row that holds the others
and forks at fixed completion depths, or where the next token is uncertain, into clone rows (copies of
its cache row and outputs); see tree.py.
On a CUDA device the decode, verify and draft forwards run at fixed shapes and are replayed as CUDA graphs
(static_forwards, graphs.StaticForwards); elsewhere they run eagerly over the live window of columns.
Test: pytest tests/engine/generator/torch_backend/test_backend.py
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tailrace.engine.core.models import cache_kwarg, check_supported, sliding_window
from tailrace.engine.generator.requests import (
    BackendStats,
    Finished,
    Request,
    Weights,
    check_request,
    drain_by_stepping,
    weight_items,
)
from tailrace.engine.generator.sampling import SamplingBatch, processed_logprobs, request_generator, sample
from tailrace.engine.generator.speculation.speculative import (
    MAX_DRAFT_TOKENS,
    OFF,
    Arm,
    SpeculativeDecoder,
    as_arm,
)
from tailrace.engine.generator.stop_strings import StopScan
from tailrace.engine.generator.torch_backend.graphs import StaticForwards, resolve_mode
from tailrace.engine.generator.torch_backend.kv import SlotKVCache
from tailrace.engine.generator.torch_backend.rows import RowState
from tailrace.engine.generator.torch_backend.tree import TreeSampling, entropy, plan_forks, take_trunks


@dataclass
class _Seq:
    request: Request
    generator: torch.Generator
    added_s: float
    first_token_s: float = 0.0
    # Tree sampling: samples of this row's group that will fork from it, and its next fork depth index.
    branches: list[_Seq] = field(default_factory=list)
    next_fork: int = 0
    tree_done: bool = False  # a held sample given back: it runs as an ordinary request
    suffix: object = None  # speculative decoding: the sample's text in its prompt's suffix index
    num_turns: int = 1  # episodes: assistant turns so far, this one included
    stop_scan: StopScan | None = None  # Request.stop_strings: the current turn's scan


@dataclass
class _Parked:
    """An episode row between turns: its sample and the copies rows.RowState.take made of its row."""

    seq: _Seq
    saved: tuple


def masked_gqa_on_cpu() -> None:
    """Let Hugging Face's SDPA attention run grouped-query attention with a mask as one call on the key/value
    heads (enable_gqa) instead of copying every key/value head per query head (repeat_kv), as it does for
    any forward of more than one token with a mask unless TRANSFORMERS_SDPA_FORCE_GQA is set: PyTorch's CPU
    kernels take the mask with enable_gqa (its CUDA ones fall back to the math kernel, so it is set for a
    CPU backend only; a value the user set is kept). The same attention, without copying the cached
    keys/values of every layer at each speculative verify and prefill (docs/benchmarks.md).
    Process-wide: Transformers reads it at each call."""
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


class TorchBackend:
    """Continuous batching over a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3 families).

    Not thread-safe: one owner calls add/step/cancel/update_weights. `pause_admission = True` makes
    step() finish the running rows without admitting new ones (the "finish running sequences first"
    weight-update mode); drain() does that to the end. Implements interface.Backend and SpeculationHooks.
    Speculation (speculative.SpeculativeDecoder) uses only public members: rows, device, policy_version,
    lm_head, static_forwards and policy_forward()."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), device: torch.device | str = "cpu",
                 seed: int | None = None, tree: TreeSampling | None = None, static_forwards: str = "auto"):
        """static_forwards: auto | graphs | static | off (graphs.py): auto captures the decode, verify and
        draft forwards as CUDA graphs per batch bucket on a CUDA device, and runs them eagerly elsewhere."""
        self._check_args(model.config, max_batch_size, max_model_len)
        self.tree = tree
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.policy_version = 0
        self.pause_admission = False
        self.stats = BackendStats()
        self._model = model.to(self.device).eval()
        self._base = model.base_model
        self._lm_head = model.get_output_embeddings()
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._eager = model.config._attn_implementation == "eager"
        if self.device.type == "cpu":
            masked_gqa_on_cpu()
        self._cache_kwarg = cache_kwarg(self._base)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # Spare columns: a speculative step writes k + 1 columns even for a row one token from its end,
        # and completion entries for its k + 1 tokens past any row's budget.
        kv = SlotKVCache(num_layers=model.config.num_hidden_layers, max_rows=max_batch_size,
                         capacity=max_model_len + MAX_DRAFT_TOKENS, device=self.device)
        self.rows = RowState(kv, max_model_len=max_model_len, spare=MAX_DRAFT_TOKENS,
                             eos_token_ids=self.eos_token_ids)
        """The running rows (rows.RowState), shared with the speculative decoder."""
        mode = resolve_mode(static_forwards, self.device)
        self._static = None if mode == "off" else StaticForwards(kv, self._forward, mode)
        self._spec: SpeculativeDecoder | None = None
        self._depth_policy = None  # choose(num_running) -> k, update(num_running, k, num_tokens, seconds)
        self._waiting: deque[_Seq] = deque()
        self._num_unstamped = 0
        self._parked: dict[tuple[int, int], _Parked] = {}  # (group, sample) -> an episode row awaiting resume()
        self._resuming: deque[tuple[_Parked, list[int]]] = deque()  # with their observations, before admission

    @staticmethod
    def _check_args(config, max_batch_size: int, max_model_len: int) -> None:
        check_supported(config)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        if config._attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"the torch backend needs attn_implementation 'sdpa' or 'eager', got "
                             f"{config._attn_implementation!r}")
        window = sliding_window(config)
        if window is not None and max_model_len > window:
            raise ValueError(f"max_model_len {max_model_len} exceeds the sliding window {window}; the torch "
                             "backend supports sliding-window models only within their window")

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return self.rows.num_rows

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model(self) -> torch.nn.Module:
        """The policy (speculative decoding builds its drafter for it)."""
        return self._model

    @property
    def lm_head(self) -> torch.nn.Module:
        """The policy's output layer: logits from the final hidden states policy_forward returns."""
        return self._lm_head

    @property
    def static_forwards(self) -> StaticForwards | None:
        """The fixed-shape (CUDA graph) forwards, or None where forwards run eagerly (graphs.py)."""
        return self._static

    def close(self) -> None:
        """Nothing to release: the model is an ordinary module."""

    @property
    def num_waiting(self) -> int:
        """Requests not running yet, tree sampling's held branches and resumed episode rows included."""
        return len(self._waiting) + sum(len(s.branches) for s in self.rows.seqs) + len(self._resuming)

    @property
    def num_parked(self) -> int:
        """Episode rows between turns, waiting for resume() or finish()."""
        return len(self._parked)

    def capacity(self) -> int:
        """Requests this backend can take now without queueing beyond one batch (parked rows count: they
        come back)."""
        return max(0, self.max_batch_size - self.num_running - self.num_waiting - self.num_parked)

    # ------------------------------------------------------------------ speculative decoding

    def enable_speculation(self, drafter, depth_policy, *, max_traces: int | None = None) -> None:
        """Decode speculatively with `drafter` (a drafter.Drafter of this policy) or the model-free
        suffix drafter, as depth_policy.choose(num_running) picks each step (a speculative.Arm, or a
        depth k of the drafter; 0 = a plain step); depth_policy.update gets each step's arm, emitted
        tokens and seconds. Finished rollouts leave traces for the spot trainer
        (at most max_traces kept, default 4 x max_batch_size; 0 keeps none and skips capturing them).
        drafter None: suffix drafts only, none of the drafter's bookkeeping (no traces); a policy that
        picks an eagle arm then gets a ValueError. Call before any request runs."""
        if self.rows.seqs or self.rows.kv.end:
            raise ValueError("enable_speculation must be called before the backend runs any request")
        if self._spec is not None:
            raise ValueError("speculation is already enabled; update the drafter with update_drafter()")
        if self.tree is not None and self.tree.fork_entropy is not None:
            raise ValueError("tree sampling by entropy forks between the forward and the draw, which "
                             "speculative steps do not have; use fork_depths with speculation")
        self._spec = SpeculativeDecoder(self, drafter, 4 * self.max_batch_size if max_traces is None else max_traces)
        self._depth_policy = depth_policy

    @property
    def drafter(self):
        return None if self._spec is None else self._spec.drafter

    @property
    def spec_stats(self):
        """speculative.SpecStats, or None without speculation."""
        return None if self._spec is None else self._spec.stats

    @torch.no_grad()
    def update_drafter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new drafter weights between steps (validated first, as in Drafter.load_state)."""
        if self._spec is None or self._spec.drafter is None:
            raise ValueError("update_drafter: speculation is not enabled with an EAGLE drafter")
        self._spec.drafter.load_state(state_dict, version)
        self._spec.drafter_changed()

    def drafter_changed(self) -> None:
        """The drafter's weights were changed in place (the spot trainer trains the same object): running
        rows recompute their drafter keys/values at the next speculative step. Not needed while idle."""
        if self._spec is not None:
            self._spec.drafter_changed()

    def take_traces(self) -> list:
        """The speculative.Trace of every rollout finished since the last call (oldest dropped first
        beyond max_traces); empty without speculation."""
        if self._spec is None:
            return []
        out = list(self._spec.traces)
        self._spec.traces.clear()
        return out

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        """Queue one request; it joins the running batch at a later step(). Raises ValueError for a
        prompt that is empty, leaves no room for a completion token, or holds an id outside the vocab."""
        check_request(request, max_model_len=self.max_model_len, vocab_size=self._vocab_size)
        if request.episode and self.tree is not None:
            raise ValueError("tree sampling (generator.fork_depths) does not run multi-turn episodes (env.max_turns > 1)")
        if request.stop_strings is not None and self.tree is not None:
            raise ValueError("tree sampling (generator.fork_depths) does not run requests with stop strings")
        seed = request.sampling.seed
        gen = self._generator if seed is None else request_generator(seed, request.sample_id)
        scan = None if request.stop_strings is None else request.stop_strings.scan()
        self._waiting.append(_Seq(request, gen, time.monotonic(), stop_scan=scan))

    @torch.inference_mode()
    def cancel(self, group_ids: Iterable[int]) -> list[Finished]:
        """Remove every waiting and running sample of these groups; returns them as "cancelled" with
        the tokens generated so far."""
        groups = set(group_ids)
        out = [self._finished(s, _empty_completion(), "cancelled")
               for s in self._waiting if s.request.group_id in groups]
        self._waiting = deque(s for s in self._waiting if s.request.group_id not in groups)
        rows = [i for i, s in enumerate(self.rows.seqs) if s.request.group_id in groups]
        out += self._finish_rows(rows, ["cancelled"] * len(rows))
        resuming = [p for p, _ in self._resuming if p.seq.request.group_id in groups]
        self._resuming = deque(r for r in self._resuming if r[0].seq.request.group_id not in groups)
        parked = [key for key in self._parked if key[0] in groups]
        return out + [self._parked_finished(p, "cancelled") for p in resuming] + \
            [self.finish(key, "cancelled") for key in parked]

    def resume(self, key: tuple[int, int], observation_ids: Sequence[int]) -> None:
        """Continue a parked episode row (group_id, sample_id): its next admission prefills these tokens
        against its kept cache (after the token that ended its turn), then it decodes on. ValueError for an
        unknown key, an empty observation, ids outside the vocabulary, or one that leaves no room to decode."""
        parked = self._parked.get(key)
        if parked is None:
            raise ValueError(f"resume: group {key[0]} sample {key[1]} is not parked")
        ids = [int(t) for t in observation_ids]
        if not ids or min(ids) < 0 or max(ids) >= self._vocab_size:
            raise ValueError(f"resume: the observation must be 1 or more ids in [0, {self._vocab_size})")
        states = parked.saved[0]
        num_gen, limit = int(states[2]), int(states[3])  # rows.RowState's num_gen_R and limit_R
        if num_gen + len(ids) >= limit:
            raise ValueError(f"resume: {len(ids)} observation tokens leave no room in the episode's budget of "
                             f"{limit} completion tokens ({num_gen} used)")
        del self._parked[key]
        parked.seq.num_turns += 1
        if parked.seq.request.stop_strings is not None:  # the new turn's text starts empty
            parked.seq.stop_scan = parked.seq.request.stop_strings.scan()
        self._resuming.append((parked, ids))

    def finish(self, key: tuple[int, int], reason: str) -> Finished:
        """End a parked episode row with this finish reason (its completion as it stands)."""
        parked = self._parked.pop(key, None)
        if parked is None:
            raise ValueError(f"finish: group {key[0]} sample {key[1]} is not parked")
        if self._spec is not None and reason != "cancelled":
            self._spec.on_finish(parked.seq, parked.saved[0][5][:int(parked.saved[0][2])].tolist())
        return self._parked_finished(parked, reason)

    def _parked_finished(self, parked: _Parked, reason: str) -> Finished:
        states = parked.saved[0]
        length = int(states[2])
        return self._finished(parked.seq, tuple(t[:length].cpu() for t in states[5:9]), reason)

    # inference_mode, not no_grad: a quarter less per-op overhead on a CPU. Everything that leaves the
    # backend (Finished, traces) is copied out as ordinary tensors, since a trainer's autograd graph in
    # the same process refuses inference tensors; the backend's own buffers never leave it.
    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Admit waiting requests (unless paused), run one decode step for all running rows, and
        return the samples that finished in it."""
        if not self.pause_admission:
            self._admit_resumed()
            self._admit()
        if not self.rows.seqs:
            return []
        start_s = time.monotonic()
        num_rows, num_before = self.rows.num_rows, self.stats.num_generated_tokens
        arm = self._choose_arm(num_rows)
        if arm.k == 0:
            tokens_B, logprobs_B = self._decode_step()
            finished = self._record_and_collect(tokens_B, logprobs_B)
        else:
            finished = self._speculative_step(arm)
        if self.tree is not None:
            self._fork_rows()
        self.stats.num_steps += 1
        step_s = time.monotonic() - start_s
        self.stats.decode_s += step_s
        if self._depth_policy is not None:
            self._depth_policy.update(num_rows, arm, self.stats.num_generated_tokens - num_before, step_s)
        return finished

    def drain(self) -> list[Finished]:
        """Finish every running row without admitting new ones (waiting requests stay queued)."""
        return drain_by_stepping(self)

    @torch.no_grad()
    def update_weights(self, weights: Weights, version: int) -> None:
        """Load new weights (all or some tensors, by state-dict name, as a mapping or (name, tensor)
        pairs) between steps. Running rows keep their cache; tokens sampled from the next step on are
        stamped with `version`. Validates every tensor before copying any, so a bad update leaves the
        model untouched."""
        state_dict = dict(weight_items(weights))
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the loaded {self.policy_version}")
        targets = dict(self._model.named_parameters(remove_duplicate=False))
        targets.update(self._model.named_buffers(remove_duplicate=False))
        for name, value in state_dict.items():
            target = targets.get(name)
            if target is None:
                raise ValueError(f"update_weights: the model has no tensor named {name!r}")
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, the model's is "
                                 f"{tuple(target.shape)}")
        for name, value in state_dict.items():
            targets[name].copy_(value)
        self.policy_version = version

    # ------------------------------------------------------------------ admission (prefill)

    def _admit(self) -> None:
        num_new = min(self.max_batch_size - self.rows.num_rows, len(self._waiting))
        if num_new == 0:
            return
        start_s = time.monotonic()
        first = self.rows.num_rows
        if self.tree is None:
            new = [self._waiting.popleft() for _ in range(num_new)]
        else:  # a trunk holds the waiting samples of its group, so fewer rows may start
            new, self._waiting = take_trunks(self._waiting, num_new)
            num_new = len(new)
        # Samples of one group share their prompt: it is prefilled once, in the first row that holds it
        # (those rows come first), and its cached keys/values are copied to the others.
        new, source = _shared_prompts_first(new)
        num_unique = max(source, default=-1) + 1
        prompts = [s.request.fed_prompt for s in new]
        lengths = [len(p) - 1 for p in prompts]  # the last prompt token is fed by the decode step
        width = max(lengths)
        self.rows.kv.reserve_left(first, width)
        self.rows.kv.place_rows(first, lengths)
        ids_bT = hidden_bTH = None
        if width > 0:
            ids_bT, hidden_bTH = self._prefill(first, prompts[:num_unique], lengths[:num_unique], width)
            if num_unique < num_new:
                self.rows.kv.copy_rows([first + i for i in source[num_unique:]],
                                       list(range(first + num_unique, first + num_new)))
                index = torch.tensor(source, device=self.device)
                ids_bT, hidden_bTH = ids_bT[index], hidden_bTH[index]
        self.rows.admit(new)
        for row, seq in enumerate(new, start=first):
            if seq.request.observation_ids:  # prefilled above, after the prompt
                self.rows.append_fed(row, list(seq.request.observation_ids), self.policy_version)
        if self._spec is not None:
            self._spec.on_admit(first, lengths, ids_bT, hidden_bTH)
        self._num_unstamped = num_new  # rows at the end that get their first token this step
        self.stats.num_prefill_tokens += sum(lengths[:num_unique])
        self.stats.prefill_s += time.monotonic() - start_s

    def _admit_resumed(self) -> None:
        """Bring resumed episode rows back into free rows, one prefill forward each: the token that ended the
        turn and the observation but its last token, against the row's kept cache (the last observation token
        is fed by the decode step, as a prompt's last token is)."""
        kv = self.rows.kv
        while self._resuming and self.rows.num_rows < self.max_batch_size:
            start_s = time.monotonic()
            parked, obs = self._resuming.popleft()
            row, states = self.rows.num_rows, parked.saved[0]
            feed = [int(states[0])] + obs[:-1]  # pending_R: the token that ended the turn
            num_cached = int(parked.saved[1][0][0].shape[1])
            kv.reserve_left(row, num_cached + len(feed))
            self.rows.put(parked.seq, parked.saved, kv.end - len(feed))
            rows, start = slice(row, row + 1), kv.end - len(feed)
            kv.valid_RC[row, start:kv.end] = True
            ids_1T = torch.tensor([feed], dtype=torch.long, device=self.device)
            pos = int(states[1])
            positions_1T = torch.arange(pos, pos + len(feed), device=self.device)[None]
            kv.set_window(rows, start, kv.lo)
            hidden_1TH = self._forward(ids_1T, positions_1T, kv.attention_mask(rows, start, len(feed), kv.lo))
            self.rows.append_fed(row, obs, self.policy_version)
            num_gen = int(states[2]) + len(obs)
            self.rows.turn_end_R[row] = self.rows.turn_end(parked.seq.request, num_gen, int(states[3]))
            self.rows.pending_R[row] = obs[-1]
            self.rows.pos_R[row] = pos + len(feed)
            if self._spec is not None:
                self._spec.on_resume(row, ids_1T, positions_1T, hidden_1TH, num_cached)
            self.stats.num_prefill_tokens += len(feed)
            self.stats.prefill_s += time.monotonic() - start_s

    def _fork_rows(self) -> None:
        """Fixed-depth mode, after a step: fork every row that holds samples and reached its next depth."""
        depths = self.tree.fork_depths
        due = [i for i, s in enumerate(self.rows.seqs) if s.branches]
        if not depths or not due:
            return
        lengths = self.rows.num_gen_R[due].tolist()
        forks = [(row, self.tree.next_fork(n)) for row, n in zip(due, lengths, strict=True)
                 if n >= depths[self.rows.seqs[row].next_fork]]
        self._fork([row for row, _ in forks], [next_fork for _, next_fork in forks])

    def _fork_uncertain_rows(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """Entropy mode, between the forward and the draw: fork every row holding samples whose next
        token's distribution is uncertain enough; returns the logits with the clones' rows appended."""
        due = [i for i, s in enumerate(self.rows.seqs) if s.branches]
        if not due:
            return logits_BV
        seqs = [self.rows.seqs[i] for i in due]
        batch = SamplingBatch.build([s.request.sampling for s in seqs], [s.generator for s in seqs], self.device)
        entropy_b = entropy(processed_logprobs(logits_BV[due], batch)).tolist()
        rows = [row for row, h in zip(due, entropy_b, strict=True) if h > self.tree.fork_entropy]
        if not rows:
            return logits_BV
        self._stamp_first_tokens()  # before clones join the end of the batch
        sources = self._fork(rows, [self.rows.seqs[row].next_fork + 1 for row in rows])
        return torch.cat((logits_BV, logits_BV[sources])) if sources else logits_BV

    def _fork(self, rows: list[int], next_forks: list[int]) -> list[int]:
        """Fork these rows (tree.plan_forks) into clone rows appended to the batch, as far as free rows
        allow; samples a row will never fork go back to the queue. Returns the clones' source rows."""
        free = self.max_batch_size - self.rows.num_rows
        sources, clones, requeue = plan_forks(self.rows.seqs, rows, next_forks, self.tree, free)
        self._requeue(requeue)
        if clones:
            self.rows.add_copies(sources, clones)
        return sources

    def _requeue(self, seqs: list[_Seq]) -> None:
        """Held samples that will not fork run first among the waiting, as ordinary requests."""
        for seq in seqs:
            seq.tree_done = True
        self._waiting.extendleft(reversed(seqs))

    def _prefill(self, first: int, prompts: list[list[int]], lengths: list[int], width: int):
        """Cache prompt[:-1] of the new rows, left-padded to `width`, ending at column kv.end.
        Returns (ids [b, width], final hidden states [b, width, H])."""
        ids_bT = torch.tensor([[0] * (width - n) + p[:-1] for p, n in zip(prompts, lengths, strict=True)],
                              dtype=torch.long, device=self.device)
        pad_b = torch.tensor([width - n for n in lengths], device=self.device)
        positions_bT = (torch.arange(width, device=self.device) - pad_b[:, None]).clamp_min(0)
        rows = slice(first, first + len(prompts))
        start = self.rows.kv.end - width
        self.rows.kv.set_window(rows, start, start)
        hidden_bTH = self._forward(ids_bT, positions_bT, self.rows.kv.attention_mask(rows, start, width, start))
        return ids_bT, hidden_bTH

    # ------------------------------------------------------------------ decoding

    def _forward(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, mask_B1TK: torch.Tensor) -> torch.Tensor:
        """Run the decoder over T new tokens per row of the cache window set by the caller; returns
        the final hidden states [B, T, H] (the drafter of speculative decoding will want them)."""
        if self._eager:
            # Eager attention adds its mask to the scores, so it needs an additive float mask.
            neg = torch.finfo(self._lm_head.weight.dtype).min
            mask_B1TK = torch.zeros(mask_B1TK.shape, dtype=self._lm_head.weight.dtype,
                                    device=self.device).masked_fill(~mask_B1TK, neg)
        out = self._base(input_ids=ids_BT, position_ids=positions_BT, attention_mask=mask_B1TK,
                         use_cache=True, **{self._cache_kwarg: self.rows.kv})
        return out.last_hidden_state

    def policy_forward(self, num_rows: int, ids_BT: torch.Tensor, positions_BT: torch.Tensor,
                       write_col: int) -> torch.Tensor:
        """The policy over T new tokens for each of rows 0 .. num_rows - 1, written to the cache at columns
        write_col .. write_col + T - 1 (the caller has marked them valid), attending to the rows' valid
        columns: the final hidden states [num_rows, T, H]. A plain decode step feeds T = 1, a speculative
        verify T = k + 1; a fixed-shape (graph) forward where static_forwards are on, else the eager window."""
        if self._static is not None:
            return self._static.policy(num_rows, ids_BT, positions_BT, write_col)
        kv, rows = self.rows.kv, slice(0, num_rows)
        kv.set_window(rows, write_col, kv.lo)
        return self._forward(ids_BT, positions_BT, kv.attention_mask(rows, write_col, ids_BT.shape[1], kv.lo))

    def _decode_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows, kv = self.rows.num_rows, self.rows.kv
        kv.make_room(num_rows, 1)
        rows, col = slice(0, num_rows), kv.end
        kv.valid_RC[rows, col] = True
        if self._spec is not None:
            self._spec.before_plain_forward(num_rows, col)
        hidden_BTH = self.policy_forward(num_rows, self.rows.pending_R[rows, None], self.rows.pos_R[rows, None],
                                         col)
        kv.end += 1
        if self._spec is not None:
            self._spec.after_plain_forward(num_rows, hidden_BTH[:, -1])
        logits_BV = self._lm_head(hidden_BTH[:, -1])
        if self.tree is not None and self.tree.fork_entropy is not None:
            logits_BV = self._fork_uncertain_rows(logits_BV)
        return sample(logits_BV, self.rows.sampling())

    def _record_and_collect(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> list[Finished]:
        num_rows = self.rows.num_rows
        rows, arange_B = slice(0, num_rows), self.rows.arange_R[:num_rows]
        num_gen_B = self.rows.num_gen_R[rows]  # a view: the += below advances the row state itself
        self.rows.out_tokens_RL[arange_B, num_gen_B] = tokens_B
        self.rows.out_logprobs_RL[arange_B, num_gen_B] = logprobs_B
        self.rows.out_versions_RL[arange_B, num_gen_B] = self.policy_version
        num_gen_B += 1
        self.rows.pos_R[rows] += 1
        self.rows.pending_R[rows] = tokens_B
        self.stats.num_generated_tokens += num_rows
        hit_B = (self.rows.stop_RS[rows] == tokens_B[:, None]).any(-1)
        scanned = self._scan_stop_strings(tokens_B[:, None])
        if scanned is not None:
            hit_B |= scanned[1]
        return self._collect_done(hit_B, num_gen_B, rows)

    def _collect_done(self, hit_B: torch.Tensor, num_gen_B: torch.Tensor, rows: slice) -> list[Finished]:
        """After a step: stamp first-token times, finish rows that hit a stop token or their budget."""
        self._stamp_first_tokens()
        done_B = hit_B | (num_gen_B >= self.rows.turn_end_R[rows])
        if not bool(done_B.any()):
            return []
        done_rows = done_B.nonzero().flatten().tolist()
        # Short of the budget without a stop token: an episode's turn reached its cap, and ends as at a stop.
        stop_B = hit_B | (num_gen_B < self.rows.limit_R[rows])
        reasons = ["stop" if stop else "length" for stop in stop_B[done_rows].tolist()]
        return self._finish_rows(done_rows, reasons)

    def _stamp_first_tokens(self) -> None:
        now = time.monotonic()
        for seq in self.rows.seqs[self.rows.num_rows - self._num_unstamped:]:
            seq.first_token_s = now
        self._num_unstamped = 0

    # ------------------------------------------------------------------ speculative decoding

    def _choose_arm(self, num_rows: int) -> Arm:
        # Not capped by the rows' remaining budgets: that would make a seeded row's tokens depend on
        # the other rows of the batch (its uniforms per step depend on k); surplus drafts are cut.
        return OFF if self._spec is None else as_arm(self._depth_policy.choose(num_rows))

    def _speculative_step(self, arm: Arm) -> list[Finished]:
        """One speculative step (speculation/speculative.py): rows emit 1..k+1 tokens each, cut at stop tokens, after
        a token that completes a stop string, and at their budget: a row emits exactly the tokens a plain step
        would have, one by one, up to its end."""
        num_rows, k = self.rows.num_rows, arm.k
        rows, arange_B = slice(0, num_rows), self.rows.arange_R[:num_rows]
        tokens_BN, logprobs_BN, num_accepted_B, hidden_BNH = self._spec.step(arm)
        stop_BN = (self.rows.stop_RS[rows, None, :] == tokens_BN[:, :, None]).any(-1)
        num_new = k + 1
        first_stop_B = torch.where(stop_BN.any(-1), stop_BN.to(torch.int8).argmax(-1) + 1, num_new)
        num_gen_B = self.rows.num_gen_R[rows]  # a view: the += below advances the row state itself
        num_emit_B = torch.minimum(torch.minimum(num_accepted_B + 1, first_stop_B),
                                   self.rows.turn_end_R[rows] - num_gen_B)
        scanned = self._scan_stop_strings(tokens_BN, num_emit_B)  # cuts emission after a stop string
        if scanned is not None:
            num_emit_B = scanned[0]
        last_B = num_emit_B - 1
        # Emission is cut at the first stop, so only the last emitted token can be one.
        hit_B = stop_BN[arange_B, last_B] if scanned is None else stop_BN[arange_B, last_B] | scanned[1]
        done_B = hit_B | (num_gen_B + num_emit_B >= self.rows.turn_end_R[rows])
        stop_B = hit_B | (num_gen_B + num_emit_B < self.rows.limit_R[rows])  # as in _collect_done
        # The step's one host sync: emitted tokens (the total and the widest row), accepted drafts (for
        # the statistics), and the rows that finish.
        emit_counts, accepted, done, hit = torch.stack(
            (num_emit_B, num_accepted_B, done_B.to(torch.int64), stop_B.to(torch.int64))).tolist()
        num_emitted = sum(emit_counts)
        self._spec.commit(arm, tokens_BN, num_emit_B, emit_counts, hidden_BNH, accepted)
        # Entries past num_emit are written too (the buffers have room) and overwritten later.
        index_BN = num_gen_B[:, None] + torch.arange(num_new, device=self.device)
        self.rows.out_tokens_RL[rows].scatter_(1, index_BN, tokens_BN)
        self.rows.out_logprobs_RL[rows].scatter_(1, index_BN, logprobs_BN)
        self.rows.out_versions_RL[rows].scatter_(1, index_BN, self.policy_version)
        num_gen_B += num_emit_B
        self.rows.pos_R[rows] += num_emit_B
        self.rows.pending_R[rows] = tokens_BN[arange_B, last_B]
        self.stats.num_generated_tokens += num_emitted
        self._stamp_first_tokens()
        done_rows = [row for row, is_done in enumerate(done) if is_done]
        return self._finish_rows(done_rows, ["stop" if hit[row] else "length" for row in done_rows])

    def _scan_stop_strings(self, tokens_BN: torch.Tensor, num_emit_B: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Rows with stop strings (Request.stop_strings) scan the first num_emit_B of their step's tokens
        tokens_BN (all N without num_emit_B: a plain step's one), in order: emission ends after a token that
        completes a stop string. Returns the emission counts so cut (None without num_emit_B) and the rows cut
        there (bool [B]), or None when no running row has stop strings. A step with such rows takes one more
        host sync: their tokens."""
        scanning = [row for row, seq in enumerate(self.rows.seqs) if seq.stop_scan is not None]
        if not scanning:
            return None
        index = torch.tensor(scanning, device=self.device)
        num_B = tokens_BN.shape[0]
        host = (tokens_BN[index] if num_emit_B is None else
                torch.cat((tokens_BN[index], num_emit_B[index, None]), dim=1)).tolist()
        cut_rows, cuts = [], []
        for row, tokens in zip(scanning, host, strict=True):
            count = len(tokens) if num_emit_B is None else tokens.pop()
            num = self.rows.seqs[row].stop_scan.feed(tokens[:count])
            if num:
                cut_rows.append(row)
                cuts.append(num)
        hit_B = torch.zeros(num_B, dtype=torch.bool, device=self.device)
        if cut_rows:
            index = torch.tensor(cut_rows, device=self.device)
            hit_B[index] = True
            if num_emit_B is not None:
                num_emit_B = num_emit_B.clone()
                num_emit_B[index] = torch.tensor(cuts, dtype=num_emit_B.dtype, device=self.device)
        return num_emit_B, hit_B

    def _finish_rows(self, rows: list[int], reasons: list[str]) -> list[Finished]:
        """Build the Finished of these running rows and remove them from the batch."""
        if not rows:
            return []
        lengths = self.rows.num_gen_R[rows].tolist()
        out, requeue = [], []
        for row, length, reason in zip(rows, lengths, reasons, strict=True):
            completion = tuple(t.cpu() for t in self.rows.completion(row, length))
            seq = self.rows.seqs[row]
            if seq.request.episode and reason == "stop":  # the assistant turn ended: park the row
                self._parked[seq.request.group_id, seq.request.sample_id] = _Parked(seq, self.rows.take(row))
                reason = "turn"
            out.append(self._finished(seq, completion, reason))
            if reason == "turn":
                continue
            # Held samples of a row that ends before forking them start over as requests of their own.
            if reason == "cancelled":
                out += [self._finished(s, _empty_completion(), reason) for s in seq.branches]
            else:
                requeue += seq.branches
            seq.branches = []
            if self._spec is not None and reason != "cancelled":
                self._spec.on_finish(seq, completion[0].tolist())
            if self._spec is not None and self._spec.traces.maxlen and reason != "cancelled":
                prompt = torch.tensor(seq.request.prompt_ids, dtype=torch.long, device=self.device)
                self._spec.capture(row, torch.cat((prompt, self.rows.out_tokens_RL[row, :length])), len(prompt))
        self.rows.remove(set(rows))
        self._requeue(requeue)
        return out

    def _finished(self, seq: _Seq, completion: Sequence[torch.Tensor], reason: str) -> Finished:
        now = time.monotonic()
        first = seq.first_token_s or now
        with torch.inference_mode(False):  # ordinary tensors: see step()
            tokens, logprobs, versions, *sampled = (t.clone() for t in completion)
        req = seq.request
        return Finished(req.group_id, req.sample_id, req.prompt_ids, tokens, logprobs, versions, reason,
                        queue_s=first - seq.added_s, decode_s=now - first,
                        loss_mask=sampled[0] if req.episode and sampled else None, num_turns=seq.num_turns)


def _shared_prompts_first(seqs: list) -> tuple[list, list[int]]:
    """seqs reordered so that the first row of each distinct prompt comes first (in arrival order), then
    the rows that repeat one; and for each row of that order, the index of the row that holds its prompt
    first (source[i] == i for those)."""
    first_of: dict[tuple[int, ...], int] = {}
    keys = [tuple(s.request.fed_prompt) for s in seqs]
    order = [i for i, key in enumerate(keys) if first_of.setdefault(key, i) == i]
    position = {key: n for n, key in enumerate(keys[i] for i in order)}
    order += [i for i, key in enumerate(keys) if first_of[key] != i]
    return [seqs[i] for i in order], [position[keys[i]] for i in order]


def _empty_completion() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32),
            torch.zeros(0, dtype=torch.long))
