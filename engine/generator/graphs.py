"""Static-shape decode, verify and draft forwards for the torch backend, captured as CUDA graphs per
running-batch bucket (as TLT captures its drafter and verifier) when the backend runs on a CUDA device.

A decode step of a small batch on a GPU costs its kernel launches, not its arithmetic: a 12-layer policy
launches a few hundred kernels per forward, and the drafter's k one-token forwards a few dozen each. A CUDA
graph replays a captured sequence of launches at once, but only at the shapes and addresses it was
captured with. So these forwards run at fixed shapes:

    rows     the batch is padded to a bucket (1, 2, 4, ... up to max_batch_size); padding rows feed token
             0 at position 0, write their keys/values into free cache rows (finite, never valid: a row
             admitted there later masks them) and attend to their own column only, so they stay finite
    columns  a forward attends to columns 0 .. W - 1, W the write columns' end rounded up to a power of two
             (at least 64, at most the cache's capacity), its mask built inside the graph from kv.valid_RC
             (read live) and the write column (a device scalar copied in before each replay): valid and
             causal, or the query's own column. The eager window (lo .. end) sees the same valid columns,
             so the two differ only in float summation order; W keeps a decode step's attention within
             twice the columns in use instead of the whole capacity (max_model_len)
    writes   new keys/values go to the write columns by index_copy_ (SlotKVCache.set_static), not by a
             slice whose bounds are Python ints

Graphs are keyed by (forward, row bucket, new tokens per row, W): the policy at 1 (plain decode) and k + 1
(verify of k drafts), the EAGLE drafter's one-token forwards; each is captured at its first use (two warm-up runs
on a side stream, then the capture, all in one memory pool) and replayed after. What a forward reads
besides its inputs (weights, cache buffers, valid_RC, the drafter's rotary table) is updated in place by
the backend, so replays see the current weights and cache. The sampling around the forwards stays eager.

mode ("graphs" | "static" | "off"): graphs on CUDA; static runs the same fixed-shape bodies without
capture (on a CPU: how tests check the graph path's forwards against the eager window's).
Test: pytest tests/engine/test_static_forwards.py (static on a CPU; the gpu-marked one captures)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MODES = ("auto", "graphs", "static", "off")


def resolve_mode(mode: str, device: torch.device) -> str:
    """auto: graphs on a CUDA device, off elsewhere (the eager window is cheaper on a CPU: it attends to
    the live columns only)."""
    if mode not in MODES:
        raise ValueError(f"static forwards mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "off"
    if mode == "graphs" and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the backend runs on {device}")
    return mode


MIN_WINDOW = 64


def bucket_of(num_rows: int, max_rows: int) -> int:
    """The smallest power of two >= num_rows, capped at max_rows."""
    return min(max_rows, 1 << max(0, num_rows - 1).bit_length())


def window_of(stop: int, capacity: int) -> int:
    """The columns a forward writing up to column stop - 1 attends to: stop rounded up to a power of two,
    at least MIN_WINDOW, at most capacity."""
    return min(capacity, max(MIN_WINDOW, 1 << (stop - 1).bit_length()))


@dataclass
class _Entry:
    inputs: dict[str, torch.Tensor]
    window: int  # columns attended: 0 .. window - 1
    output: torch.Tensor | None = None
    graph: object = None  # torch.cuda.CUDAGraph once captured
    runs: int = field(default=0)


class StaticForwards:
    """The backend's fixed-shape forwards (see the module docstring). policy() and drafter() return
    views of static output buffers: valid until the next call of the same (forward, rows, tokens, window)."""

    def __init__(self, backend, mode: str):
        self.backend = backend
        self.mode = mode
        kv = backend._kv
        self.max_rows = kv.max_rows
        self._col_C = torch.arange(kv.capacity, device=backend.device)
        self._arange = torch.arange(64, device=backend.device)
        self._entries: dict[tuple[str, int, int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self.num_captured = 0
        self.num_replayed = 0

    # ------------------------------------------------------------------ the forwards

    def policy(self, num_rows: int, ids_BT: torch.Tensor, positions_BT: torch.Tensor, write_col: int) -> torch.Tensor:
        """The policy's final hidden states [num_rows, T, H] for T new tokens per row written at
        write_col .. write_col + T - 1 (the caller has marked those columns valid for its rows)."""
        num_new = ids_BT.shape[1]
        entry = self._entry("policy", num_rows, num_new, write_col, lambda b: {
            "ids": torch.zeros(b, num_new, dtype=torch.long, device=self.backend.device),
            "pos": torch.zeros(b, num_new, dtype=torch.long, device=self.backend.device),
            "col": torch.zeros(1, dtype=torch.long, device=self.backend.device)})
        s = entry.inputs
        s["ids"][:num_rows].copy_(ids_BT)
        s["pos"][:num_rows].copy_(positions_BT)
        s["col"].fill_(write_col)
        return self._run(entry, "policy")[:num_rows]

    def drafter(self, num_rows: int, ids_B1: torch.Tensor, feats_B1H: torch.Tensor, turns_B11c: torch.Tensor,
                write_col: int) -> torch.Tensor:
        """The EAGLE drafter's one-token forward (its predicted hidden state [num_rows, 1, H]) at write_col,
        from rotary factors turns_B11c (Drafter.rotary of the positions)."""
        spec = self.backend._spec
        dev, dtype = self.backend.device, feats_B1H.dtype
        entry = self._entry("drafter", num_rows, 1, write_col, lambda b: {
            "ids": torch.zeros(b, 1, dtype=torch.long, device=dev),
            "feats": torch.zeros(b, 1, spec.drafter.config.hidden_size, dtype=dtype, device=dev),
            "turns": torch.zeros(b, 1, 1, turns_B11c.shape[-1], dtype=turns_B11c.dtype, device=dev),
            "col": torch.zeros(1, dtype=torch.long, device=dev)})
        s = entry.inputs
        s["ids"][:num_rows].copy_(ids_B1)
        s["feats"][:num_rows].copy_(feats_B1H)
        s["turns"][:num_rows].copy_(turns_B11c)
        s["col"].fill_(write_col)
        return self._run(entry, "drafter")[:num_rows]

    # ------------------------------------------------------------------ bodies (what a graph captures)

    def _mask(self, num_rows: int, cols_T: torch.Tensor, window: int) -> torch.Tensor:
        """[B, 1, T, W]: valid and causal (column <= the query's), or the query's own column."""
        col_W = self._col_C[:window]
        causal_TW = col_W[None, :] <= cols_T[:, None]
        own_TW = col_W[None, :] == cols_T[:, None]
        valid_BW = self.backend._kv.valid_RC[:num_rows, :window]
        return ((valid_BW[:, None, :] & causal_TW) | own_TW)[:, None]

    def _policy_body(self, s: dict[str, torch.Tensor], window: int) -> torch.Tensor:
        b = self.backend
        num_rows, num_new = s["ids"].shape
        cols_T = s["col"] + self._arange[:num_new]
        b._kv.set_static(num_rows, cols_T, window)
        try:
            return b._forward(s["ids"], s["pos"], self._mask(num_rows, cols_T, window))
        finally:
            b._kv.set_static(0, None, 0)

    def _drafter_body(self, s: dict[str, torch.Tensor], window: int) -> torch.Tensor:
        spec, kv = self.backend._spec, self.backend._kv
        num_rows = s["ids"].shape[0]
        cols_T = s["col"] + self._arange[:1]
        kv.set_static(num_rows, cols_T, window)
        try:
            return spec.drafter.forward(s["ids"], s["feats"], None, self._mask(num_rows, cols_T, window), cache=kv,
                                        layer_idx=spec.layer, turns_B1Tc=s["turns"])
        finally:
            kv.set_static(0, None, 0)

    # ------------------------------------------------------------------ capture and replay

    def _entry(self, kind: str, num_rows: int, num_new: int, write_col: int,
               make_inputs: Callable[[int], dict[str, torch.Tensor]]) -> _Entry:
        key = (kind, bucket_of(num_rows, self.max_rows), num_new, window_of(write_col + num_new, len(self._col_C)))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(make_inputs(key[1]), window=key[3])
        return entry

    def _run(self, entry: _Entry, kind: str) -> torch.Tensor:
        body = functools.partial(self._policy_body if kind == "policy" else self._drafter_body, window=entry.window)
        if self.mode != "graphs":
            entry.output = body(entry.inputs)
        elif entry.graph is None:
            entry.graph, entry.output = self._capture(body, entry.inputs)
            entry.graph.replay()  # a capture records the launches without running them
            self.num_captured += 1
        else:
            entry.graph.replay()
            self.num_replayed += 1
        entry.runs += 1
        return entry.output

    def _capture(self, body, inputs: dict[str, torch.Tensor]):
        """Warm up on a side stream (lazy initialisation, allocator, library workspaces), then capture.
        The warm-up runs write the same keys/values the replay after them writes, so they change nothing."""
        device = self.backend.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body(inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = body(inputs)
        return graph, output

    def counters(self) -> dict[str, int]:
        return {"static_forwards_captured": self.num_captured, "static_forwards_replayed": self.num_replayed,
                "static_forwards_shapes": len(self._entries)}
