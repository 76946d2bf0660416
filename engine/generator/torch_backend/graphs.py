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
    writes   new keys/values go to the write columns by index_copy_ (SlotKVCache.static), not by a
             slice whose bounds are Python ints

Graphs are keyed by (forward, row bucket, new tokens per row, W): the policy at 1 (plain decode) and k + 1
(verify of k drafts), the EAGLE drafter's one-token forwards; each is captured at its first use (two warm-up runs
on a side stream, then the capture, all in one memory pool) and replayed after. What a forward reads
besides its inputs (weights, cache buffers, valid_RC, the drafter's rotary table) is updated in place by
the backend, so replays see the current weights and cache. The sampling around the forwards stays eager.

mode ("graphs" | "static" | "off"): graphs on CUDA; static runs the same fixed-shape bodies without
capture (on a CPU: how tests check the graph path's forwards against the eager window's).
Test: pytest tests/engine/generator/torch_backend/test_static_forwards.py (static on a CPU; the gpu-marked one captures)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tailrace.engine.generator.torch_backend.kv import SlotKVCache

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
    inputs: dict[str, torch.Tensor]  # the static input buffers, [bucket rows, ...] each
    body: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # what runs (or is captured) over them
    output: torch.Tensor | None = None
    graph: object = None  # torch.cuda.CUDAGraph once captured


class StaticForwards:
    """The backend's fixed-shape forwards (see the module docstring). policy() and drafter() return
    views of static output buffers: valid until the next call of the same (forward, rows, tokens, window)."""

    def __init__(self, kv: SlotKVCache, forward: Callable[..., torch.Tensor], mode: str):
        """kv: the backend's cache (rows.RowState.kv); forward(ids_BT, positions_BT, mask_B1TW): the policy's
        final hidden states for new tokens written through kv's current window (the backend's eager forward)."""
        self.kv = kv
        self.forward = forward
        self.mode = mode
        self.max_rows = kv.max_rows
        self._col_C = torch.arange(kv.capacity, device=kv.device)
        self._drafter = None  # attach_drafter(): the EAGLE drafter and its cache layer
        self._drafter_layer = -1
        self._entries: dict[tuple[str, int, int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self.num_captured = 0
        self.num_replayed = 0

    def attach_drafter(self, drafter, layer: int) -> None:
        """The EAGLE drafter whose one-token forwards drafter() runs, writing its keys/values at cache layer
        `layer` (speculative.SpeculativeDecoder attaches it once; its weights change in place)."""
        self._drafter, self._drafter_layer = drafter, layer

    # ------------------------------------------------------------------ the forwards

    def policy(self, num_rows: int, ids_BT: torch.Tensor, positions_BT: torch.Tensor, write_col: int) -> torch.Tensor:
        """The policy's final hidden states [num_rows, T, H] for T new tokens per row written at
        write_col .. write_col + T - 1 (the caller has marked those columns valid for its rows)."""
        return self._run("policy", num_rows, write_col, ids=ids_BT, pos=positions_BT)

    def drafter(self, num_rows: int, ids_B1: torch.Tensor, feats_B1H: torch.Tensor, turns_B11c: torch.Tensor,
                write_col: int) -> torch.Tensor:
        """The EAGLE drafter's one-token forward (its predicted hidden state [num_rows, 1, H]) at write_col,
        from rotary factors turns_B11c (Drafter.rotary of the positions)."""
        return self._run("drafter", num_rows, write_col, ids=ids_B1, feats=feats_B1H, turns=turns_B11c)

    # ------------------------------------------------------------------ bodies (what a graph captures)

    def _mask(self, num_rows: int, cols_T: torch.Tensor, window: int) -> torch.Tensor:
        """[B, 1, T, W]: valid and causal (column <= the query's), or the query's own column."""
        col_W = self._col_C[:window]
        causal_TW = col_W[None, :] <= cols_T[:, None]
        own_TW = col_W[None, :] == cols_T[:, None]
        valid_BW = self.kv.valid_RC[:num_rows, :window]
        return ((valid_BW[:, None, :] & causal_TW) | own_TW)[:, None]

    def _policy_body(self, s: dict[str, torch.Tensor], window: int) -> torch.Tensor:
        num_rows, num_new = s["ids"].shape
        cols_T = s["col"] + self._col_C[:num_new]
        with self.kv.static(num_rows, cols_T, window):
            return self.forward(s["ids"], s["pos"], self._mask(num_rows, cols_T, window))

    def _drafter_body(self, s: dict[str, torch.Tensor], window: int) -> torch.Tensor:
        assert self._drafter is not None, "drafter(): no drafter attached"
        kv, num_rows = self.kv, s["ids"].shape[0]
        cols_T = s["col"] + self._col_C[:1]
        with kv.static(num_rows, cols_T, window):
            return self._drafter.forward(s["ids"], s["feats"], None, self._mask(num_rows, cols_T, window), cache=kv,
                                         layer_idx=self._drafter_layer, turns_B1Tc=s["turns"])

    # ------------------------------------------------------------------ capture and replay

    def _run(self, kind: str, num_rows: int, write_col: int, **inputs: torch.Tensor) -> torch.Tensor:
        """Copy `inputs` (each [num_rows, ...]) and the write column into the static buffers of their shape
        (made at its first use: rows padded to the bucket), run or replay the body of `kind` (policy or
        drafter) over them, and return its output's first num_rows rows."""
        num_new = inputs["ids"].shape[1]
        key = (kind, bucket_of(num_rows, self.max_rows), num_new,
               window_of(write_col + num_new, len(self._col_C)))
        entry = self._entries.get(key)
        if entry is None:
            static = {name: value.new_zeros(key[1], *value.shape[1:]) for name, value in inputs.items()}
            static["col"] = self._col_C.new_zeros(1)
            body = getattr(self, f"_{kind}_body")
            entry = self._entries[key] = _Entry(static, functools.partial(body, window=key[3]))
        for name, value in inputs.items():
            entry.inputs[name][:num_rows].copy_(value)
        entry.inputs["col"].fill_(write_col)
        if self.mode != "graphs":
            entry.output = entry.body(entry.inputs)
        elif entry.graph is None:
            entry.graph, entry.output = self._capture(entry.body, entry.inputs)
            entry.graph.replay()  # a capture records the launches without running them
            self.num_captured += 1
        else:
            entry.graph.replay()
            self.num_replayed += 1
        return entry.output[:num_rows]

    def _capture(self, body, inputs: dict[str, torch.Tensor]):
        """Warm up on a side stream (lazy initialisation, allocator, library workspaces), then capture.
        The warm-up runs write the same keys/values the replay after them writes, so they change nothing."""
        device = self.kv.device
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
