"""The start-up heap, frozen out of the cyclic garbage collector while a role serves.

A role builds its model, tokenizer and libraries (torch, transformers) before it serves: some 370,000 objects
that the collector tracks and that live as long as the process. Python's full (generation 2) collection walks
every one of them, holding the GIL, in whichever thread allocates at that moment (the event loop itself, or a
worker thread whose GIL the loop then waits for): in the faults benchmark that pause was the trainer's largest
trainer/loop/max_stall_ms (docs/benchmarks.md). `frozen()` collects once, before the role serves,
and moves what survives to the permanent generation (gc.freeze): later full collections walk only what the
run creates. Reference counting still frees frozen objects; only reference cycles among them wait until
`frozen()` exits and unfreezes them (for an in-process caller that goes on). Test: pytest tests/faults/test_gc_pause.py
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator

_depth = 0  # nested frozen() (two services in one process): unfrozen when the last one ends


@contextlib.asynccontextmanager
async def frozen() -> AsyncIterator[None]:
    """Freeze the heap as it is now for the duration of the block (async: it joins a service's `async with`;
    the one collection it runs is before the service binds its sockets)."""
    global _depth
    gc.collect()
    gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
