"""Slot key/value cache for continuous batching: preallocated per-layer buffers, sequences right-aligned.

Layout (per layer, keys and values alike):

    buffer [max_rows, kv_heads, capacity, head_dim]
             row 0:  . . . . a a a a a a  <- every row writes its next token at column `end`
             row 1:  . . b b b b b b b b
             row 2:  . . . . . . . c c c  <- joined later with a short prompt: left padding
                         lo ^             ^ end

Running sequences occupy rows 0..num_rows-1. `valid` [max_rows, capacity] marks the columns that hold
a real token of that row; everything else is masked, so the stale contents of a column never matter
(buffers start at zero, so they are always finite and a zero attention weight stays exactly zero).
Because all rows end at the same column, one decode step writes one column for the whole batch, and a
new sequence is prefilled into its own row without touching the running ones. Holes inside a row are
allowed (speculative decoding invalidates rejected columns; compact() squeezes them out when room runs
short); positions count valid columns only.

Speculative decoding adds one more layer (add_layer(): the drafter's keys/values, written by the drafter
through the same update()) and per-column state buffers [max_rows, capacity, D] (add_column_state(): the
token id and the policy's hidden state of each column); every layout change moves them with the keys.

A multi-turn episode's row leaves the batch between turns with its keys/values (take_row: its valid columns,
copied out) and comes back into a free row ending where new tokens will be fed (put_row), so the next turn
is prefilled against the kept cache instead of recomputing it (backend.TorchBackend.resume).

The object is handed to a Hugging Face model as its `cache`: the model calls update() once per layer.
Test: pytest tests/engine/generator/torch_backend/test_backend.py
"""

from __future__ import annotations

import contextlib

import torch


class SlotKVCache:
    """Per-layer key/value buffers shared by the running batch, and the column bookkeeping."""

    def __init__(self, *, num_layers: int, max_rows: int, capacity: int, device: torch.device | str):
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.capacity = capacity
        self.device = torch.device(device)
        # Allocated at the first update, from the key/value shapes the model actually produces.
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.column_states: list[torch.Tensor] = []  # [max_rows, capacity, D] each, moved with the keys
        self.valid_RC = torch.zeros(max_rows, capacity, dtype=torch.bool, device=self.device)
        self.lo = 0   # no row holds a valid column left of lo
        self.end = 0  # next column to write, shared by all rows
        self._rows = slice(0, 0)
        self._write = 0
        self._vis_lo = 0
        self._static_rows = 0  # static(): rows 0.. of a fixed-shape forward, writing at _static_cols
        self._static_cols: torch.Tensor | None = None
        self._static_window = 0

    # ------------------------------------------------------------------ the model-facing interface

    def set_window(self, rows: slice, write_col: int, vis_lo: int) -> None:
        """Where the next forward writes (rows, first column) and from which column it attends."""
        self._rows, self._write, self._vis_lo = rows, write_col, vis_lo

    @contextlib.contextmanager
    def static(self, num_rows: int, cols_T: torch.Tensor, window: int):
        """Fixed-shape forwards (graphs.py): within the block, updates write rows 0..num_rows-1 at the
        columns in cols_T (a device tensor, all below window) and return columns 0..window-1; after it,
        the window of set_window again."""
        self._static_rows, self._static_cols, self._static_window = num_rows, cols_T, window
        try:
            yield
        finally:
            self._static_cols = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by each attention layer: store the new keys/values [b, h, T, d], return the visible
        ones [b, h, K, d] (a view; masked columns included, the attention mask hides them)."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states, value_states)
        if self._static_cols is not None:
            rows, window = self._static_rows, self._static_window
            keys, values = self.keys[layer_idx][:rows, :, :window], self.values[layer_idx][:rows, :, :window]
            keys.index_copy_(2, self._static_cols, key_states)
            values.index_copy_(2, self._static_cols, value_states)
            return keys, values
        num_new = key_states.shape[-2]
        stop = self._write + num_new
        assert stop <= self.capacity, "backend must make room before a forward"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._rows, :, self._write:stop] = key_states
        values[self._rows, :, self._write:stop] = value_states
        return keys[self._rows, :, self._vis_lo:stop], values[self._rows, :, self._vis_lo:stop]

    def add_layer(self) -> int:
        """Append one more key/value layer (allocated at its first update); returns its layer index."""
        self.keys.append(None)
        self.values.append(None)
        self.num_layers += 1
        return self.num_layers - 1

    def add_column_state(self, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed [max_rows, capacity, dim] buffer that moves with the columns it describes."""
        buf = torch.zeros(self.max_rows, self.capacity, dim, dtype=dtype, device=self.device)
        self.column_states.append(buf)
        return buf

    def _key_buffers(self) -> list[torch.Tensor]:
        return [buf for buf in (*self.keys, *self.values) if buf is not None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write - self._vis_lo

    def _allocate(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, key_dim = key_states.shape
        shape = (self.max_rows, heads, self.capacity)
        self.keys[layer_idx] = torch.zeros(*shape, key_dim, dtype=key_states.dtype, device=self.device)
        self.values[layer_idx] = torch.zeros(
            *shape, value_states.shape[-1], dtype=value_states.dtype, device=self.device
        )

    # ------------------------------------------------------------------ masks and positions

    def attention_mask(self, rows: slice, write_col: int, num_new: int, vis_lo: int) -> torch.Tensor:
        """Boolean mask [b, 1, T, K] (True = attend) for a forward of T new tokens per row written at
        write_col..write_col+T-1 and attending from vis_lo: valid columns, causal among the new ones.
        A query always sees its own column, so a padding query never gets an all-masked row (NaN)."""
        stop = write_col + num_new
        valid_bK = self.valid_RC[rows, vis_lo:stop]
        if num_new == 1:
            return valid_bK[:, None, None, :]
        col_K = torch.arange(vis_lo, stop, device=self.device)
        query_col_T = torch.arange(write_col, stop, device=self.device)
        causal_TK = col_K[None, :] <= query_col_T[:, None]
        own_TK = col_K[None, :] == query_col_T[:, None]
        return ((valid_bK[:, None, :] & causal_TK) | own_TK)[:, None]

    # ------------------------------------------------------------------ layout changes

    def make_room(self, num_rows: int, num_cols: int) -> None:
        """Ensure `num_cols` columns are free right of end, shifting rows 0..num_rows-1 to column 0
        when needed. Right alignment guarantees the live span end - lo fits whenever every row does."""
        if self.end + num_cols <= self.capacity:
            return
        self.trim_lo(num_rows)
        if self.end - self.lo + num_cols > self.capacity:
            self.compact(num_rows)
        span = self.end - self.lo
        assert span + num_cols <= self.capacity, "a sequence outgrew max_model_len"
        self._shift(num_rows, -self.lo)

    def reserve_left(self, num_rows: int, num_cols: int) -> None:
        """Ensure end >= num_cols, so a new row can place num_cols prompt tokens ending at end."""
        if num_rows == 0:
            self.lo = self.end = num_cols
            return
        if self.end < num_cols:
            # Shifting right ends the live columns at num_cols, which fits because a prompt does.
            self._shift(num_rows, num_cols - self.end)

    def _shift(self, num_rows: int, delta: int) -> None:
        """Move the live columns lo..end of rows 0..num_rows-1 by delta (either direction)."""
        if delta == 0:
            return
        lo, end = self.lo, self.end
        for buf in self._key_buffers():
            buf[:num_rows, :, lo + delta:end + delta] = buf[:num_rows, :, lo:end].clone()
        for buf in self.column_states:
            buf[:num_rows, lo + delta:end + delta] = buf[:num_rows, lo:end].clone()
        moved = self.valid_RC[:num_rows, lo:end].clone()
        self.valid_RC[:num_rows] = False
        self.valid_RC[:num_rows, lo + delta:end + delta] = moved
        self.lo, self.end = lo + delta, end + delta

    def trim_lo(self, num_rows: int) -> None:
        """Advance lo to the first column any running row still uses (one host sync)."""
        if num_rows == 0:
            self.lo = self.end = 0
            return
        used_C = self.valid_RC[:num_rows, self.lo:self.end].any(0)
        if bool(used_C.any()):
            self.lo += int(used_C.int().argmax())
        else:
            self.lo = self.end

    def copy_rows(self, sources: list[int], dests: list[int]) -> None:
        """Copy the cached columns of rows `sources` over rows `dests`, pairwise (removing rows fills
        holes this way; tree sampling's forks make clones): the copies hold the same keys/values at the
        same columns, so they continue as if decoded alone."""
        if not sources:
            return
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(dests, dtype=torch.long, device=self.device)
        lo, end = self.lo, self.end
        for buf in self._key_buffers():
            buf[dst, :, lo:end] = buf[src, :, lo:end]
        for buf in self.column_states:
            buf[dst, lo:end] = buf[src, lo:end]
        self.valid_RC[dst] = self.valid_RC[src]

    def compact(self, num_rows: int) -> None:
        """Squeeze the holes out of rows 0..num_rows-1: each row's valid columns keep their order and
        move right to end at end - 1. Columns only move right, so a span of columns counted back from
        end still holds (at least) the same tokens afterwards. Costs one gather of the live span."""
        lo, end = self.lo, self.end
        valid_bW = self.valid_RC[:num_rows, lo:end]
        width = end - lo
        if num_rows == 0 or width == 0:
            return
        count_b = valid_bW.sum(-1)
        # Valid columns first, in order (stable sort), then the holes.
        order_bW = torch.sort((~valid_bW).to(torch.int8), dim=-1, stable=True).indices
        dest_W = torch.arange(width, device=self.device)
        first_b = width - count_b  # the first destination column that receives a valid one
        rank_bW = (dest_W[None, :] - first_b[:, None]).clamp_min(0)
        src_bW = order_bW.gather(-1, rank_bW)
        for buf in self._key_buffers():
            heads, dim = buf.shape[1], buf.shape[3]
            index = src_bW[:, None, :, None].expand(num_rows, heads, width, dim)
            buf[:num_rows, :, lo:end] = buf[:num_rows, :, lo:end].gather(2, index)
        for buf in self.column_states:
            index = src_bW[:, :, None].expand(num_rows, width, buf.shape[2])
            buf[:num_rows, lo:end] = buf[:num_rows, lo:end].gather(1, index)
        self.valid_RC[:num_rows, lo:end] = dest_W[None, :] >= first_b[:, None]
        self.trim_lo(num_rows)

    def place_rows(self, first_row: int, lengths: list[int]) -> None:
        """Mark rows first_row.. as new sequences whose cached tokens (lengths[i] each) end at end."""
        rows = slice(first_row, first_row + len(lengths))
        length_b = torch.tensor(lengths, device=self.device)
        col_C = torch.arange(self.capacity, device=self.device)
        self.valid_RC[rows] = (col_C >= self.end - length_b[:, None]) & (col_C < self.end)
        self.lo = min(self.lo, self.end - max(lengths, default=0))

    # ------------------------------------------------------------------ rows parked between turns

    def take_row(self, row: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Copies of one row's valid columns, in order: per layer keys then values [heads, n, dim] (None for a
        layer not allocated yet, e.g. the drafter's before its first step), and each column state [n, D]."""
        cols = self.valid_RC[row, self.lo:self.end].nonzero().flatten() + self.lo
        layers = [None if buf is None else buf[row][:, cols].clone() for buf in (*self.keys, *self.values)]
        return layers, [buf[row, cols].clone() for buf in self.column_states]

    def put_row(self, row: int, layers: list[torch.Tensor | None], states: list[torch.Tensor], stop_col: int) -> int:
        """Write what take_row copied into `row`, its columns ending at stop_col (exclusive), and make them the
        row's only valid ones; returns the number of columns. A layer allocated since is left stale there: only
        the drafter's can be, and the caller has it recomputed (speculative.SpeculativeDecoder.on_resume)."""
        num = next(t.shape[1] for t in layers if t is not None)
        start = stop_col - num
        assert start >= 0, "put_row: the caller must reserve the columns first"
        for buf, saved in zip((*self.keys, *self.values), layers, strict=True):
            if buf is not None and saved is not None:
                buf[row, :, start:stop_col] = saved
        for buf, saved in zip(self.column_states, states, strict=True):
            buf[row, start:stop_col] = saved
        self.valid_RC[row] = False
        self.valid_RC[row, start:stop_col] = True
        self.lo = min(self.lo, start)
        return num
