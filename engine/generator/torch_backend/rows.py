"""The running rows of the torch backend's continuous batch: the state the backend and its speculative
decoder share, behind one public API instead of each reaching into the other.

    seqs            the running samples (backend._Seq: request, generator, tree and suffix bookkeeping), in
                    row order: row i of every tensor below, and of the cache, belongs to seqs[i]
    kv              kv.SlotKVCache: the rows' keys/values and the column bookkeeping (valid_RC, lo, end)
    pending_R       the next token to feed each row; pos_R its position
    num_gen_R       tokens generated so far; limit_R the completion length cap; turn_end_R where the current
                    assistant turn ends (limit_R but for an episode's per-turn cap); stop_RS the stop ids
                    (padded with NO_TOKEN)
    out_tokens_RL   the rows' completions so far: tokens, behaviour log-probs (out_logprobs_RL), the
                    policy version that sampled each token (out_versions_RL), and whether the policy sampled
                    it (out_sampled_RL; False for a multi-turn episode's observation tokens)
    arange_R        0 .. max_rows - 1 on the device
    sampling()      the rows' sampling.SamplingBatch, rebuilt only after rows joined or left

Rows join (admit, add_copies), leave (remove: the last rows move into the holes) and move (move_rows)
only through this object, so every per-row tensor moves with them: the backend's own, the cache's, and
any another component registers with add_row_state() (speculation's pending drafter features).
The backend decides what rows emit; speculation/speculative.py reads the rows and writes its own state.
Test: pytest tests/engine/generator/torch_backend/test_rows.py tests/engine/generator/torch_backend/test_backend.py
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tailrace.engine.generator.sampling import SamplingBatch
from tailrace.engine.generator.torch_backend.kv import SlotKVCache
from tailrace.protocol.messages import SamplingParams

NO_TOKEN = -1  # fills unused stop-id slots; never a sampled token
MAX_STOP_IDS = 64  # SamplingParams.stop_token_ids max_len


class RowState:
    """Per-row state of the running batch, rows 0 .. num_rows - 1 (see the module docstring).

    kv: the cache the rows live in; max_model_len: a row's prompt plus completion at most; spare: extra
    completion entries past any row's budget (a speculative step writes its k + 1 tokens before they are
    cut); eos_token_ids: stop every row, besides its own stop ids."""

    def __init__(self, kv: SlotKVCache, *, max_model_len: int, spare: int, eos_token_ids: Iterable[int]):
        rows, length, dev = kv.max_rows, max_model_len + spare + 1, kv.device
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.seqs: list = []
        self.pending_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.num_gen_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.limit_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.turn_end_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.stop_RS = torch.full((rows, MAX_STOP_IDS + len(self.eos_token_ids)), NO_TOKEN, dtype=torch.long,
                                  device=dev)
        self.out_tokens_RL = torch.zeros(rows, length, dtype=torch.long, device=dev)
        self.out_logprobs_RL = torch.zeros(rows, length, dtype=torch.float32, device=dev)
        self.out_versions_RL = torch.zeros(rows, length, dtype=torch.long, device=dev)
        self.out_sampled_RL = torch.ones(rows, length, dtype=torch.bool, device=dev)
        self.arange_R = torch.arange(rows, device=dev)
        self._states = [self.pending_R, self.pos_R, self.num_gen_R, self.limit_R, self.stop_RS,
                        self.out_tokens_RL, self.out_logprobs_RL, self.out_versions_RL, self.out_sampled_RL,
                        self.turn_end_R]
        self._sampling: SamplingBatch | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def add_row_state(self, state: torch.Tensor) -> None:
        """Register a tensor [max_rows, ...] of another component: it moves with the rows from now on."""
        if state.shape[0] != self.kv.max_rows:
            raise ValueError(f"row state: {state.shape[0]} rows, the batch has {self.kv.max_rows}")
        self._states.append(state)

    def sampling(self) -> SamplingBatch:
        """The running rows' sampling settings and generators, built once per batch composition (the same
        object until rows join or leave)."""
        if self._sampling is None:
            self._sampling = SamplingBatch.build([s.request.sampling for s in self.seqs],
                                                 [s.generator for s in self.seqs], self.device)
        return self._sampling

    def completion(self, row: int, length: int) -> tuple[torch.Tensor, ...]:
        """The first `length` completion tokens, log-probs, versions and sampled flags of a row (views on the
        device)."""
        return (self.out_tokens_RL[row, :length], self.out_logprobs_RL[row, :length],
                self.out_versions_RL[row, :length], self.out_sampled_RL[row, :length])

    # ------------------------------------------------------------------ rows join, leave and move

    def admit(self, new: list) -> None:
        """Append running rows for new samples (their prompts already placed in the cache): each feeds its
        last prompt token next, at that token's position, with a budget of max_new_tokens or what the
        model's length leaves."""
        first, dev = self.num_rows, self.device
        rows = slice(first, first + len(new))
        prompts = [s.request.fed_prompt for s in new]
        self.pending_R[rows] = torch.tensor([p[-1] for p in prompts], device=dev)
        self.pos_R[rows] = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        self.num_gen_R[rows] = 0
        self.out_sampled_RL[rows] = True
        limits = [min(s.request.sampling.max_new_tokens, self.max_model_len - len(s.request.prompt_ids))
                  for s in new]
        self.limit_R[rows] = torch.tensor(limits, device=dev)
        self.turn_end_R[rows] = torch.tensor([self.turn_end(s.request, len(s.request.observation_ids), limit)
                                              for s, limit in zip(new, limits, strict=True)], device=dev)
        self.stop_RS[rows] = torch.tensor([self._stop_row(s.request.sampling) for s in new], device=dev)
        self.seqs.extend(new)
        self._sampling = None

    @staticmethod
    def turn_end(request, num_gen: int, limit: int) -> int:
        """Where an assistant turn starting after num_gen completion tokens ends at the latest."""
        return min(limit, num_gen + request.max_turn_tokens) if request.max_turn_tokens else limit

    def append_fed(self, row: int, ids: list[int], version: int) -> None:
        """Record tokens fed to a row (an episode's observation) as its next completion entries: log-prob 0,
        `version`, not sampled. The caller feeds them."""
        num_gen, dev = int(self.num_gen_R[row]), self.device
        span = slice(num_gen, num_gen + len(ids))
        self.out_tokens_RL[row, span] = torch.tensor(ids, dtype=torch.long, device=dev)
        self.out_logprobs_RL[row, span] = 0.0
        self.out_versions_RL[row, span] = version
        self.out_sampled_RL[row, span] = False
        self.num_gen_R[row] = num_gen + len(ids)

    def _stop_row(self, sampling: SamplingParams) -> list[int]:
        ids = sorted(set(sampling.stop_token_ids[:MAX_STOP_IDS]) | set(self.eos_token_ids))
        return ids + [NO_TOKEN] * (self.stop_RS.shape[1] - len(ids))

    def add_copies(self, sources: list[int], seqs: list) -> None:
        """Append rows for `seqs` that continue from rows `sources`, pairwise: the same cache, completion
        and budget (tree sampling's clones)."""
        first = self.num_rows
        self.move_rows(sources, list(range(first, first + len(sources))))
        self.seqs.extend(seqs)
        self._sampling = None

    def remove(self, drop: set[int]) -> None:
        """Remove these rows by swap-remove: the last rows that stay move into the holes, so removing d rows
        copies at most d rows of cache and state, not the whole batch (rows have no order that matters)."""
        num_keep = self.num_rows - len(drop)
        holes = sorted(row for row in drop if row < num_keep)
        movers = [row for row in range(num_keep, self.num_rows) if row not in drop]
        if holes:
            self.move_rows(movers, holes)
            for source, dest in zip(movers, holes, strict=True):
                self.seqs[dest] = self.seqs[source]
        del self.seqs[num_keep:]
        self._sampling = None
        # Leaving rows may have been the longest ones: narrowing the window shortens attention.
        self.kv.trim_lo(num_keep)

    def move_rows(self, sources: list[int], dests: list[int]) -> None:
        """Copy the cache and every per-row tensor of rows `sources` over rows `dests`, pairwise (not seqs)."""
        self.kv.copy_rows(sources, dests)
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(dests, dtype=torch.long, device=self.device)
        for state in self._states:
            state[dst] = state[src]

    # ------------------------------------------------------------------ episode rows parked between turns

    def take(self, row: int) -> tuple[list[torch.Tensor], tuple]:
        """Copies of one row's state tensors (every registered one) and of its cached columns (kv.take_row),
        for put() to bring back after an environment's turn; the row itself is left to remove()."""
        return [state[row].clone() for state in self._states], self.kv.take_row(row)

    def put(self, seq, saved: tuple[list[torch.Tensor], tuple], stop_col: int) -> int:
        """Append a running row for `seq` from what take() copied, its cached columns ending at stop_col;
        returns the number of cached columns."""
        row = self.num_rows
        states, (layers, column_states) = saved
        for state, value in zip(self._states, states, strict=True):
            state[row] = value
        num = self.kv.put_row(row, layers, column_states, stop_col)
        self.seqs.append(seq)
        self._sampling = None
        return num
