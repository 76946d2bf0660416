"""A Parquet file's rows, read a bounded piece at a time (pyarrow, the `parquet` extra), in the order of
an epoch, from any position inside it.

In file order the rows stream through `ParquetFile.iter_batches`, starting at the row group that holds
the position. Shuffled (data.shuffle), an epoch draws an order of the row groups from data.seed and the
epoch, cuts that order into windows of whole row groups holding at most WINDOW_ROWS rows (a larger row
group is a window by itself), and shuffles the rows of each window together; only one window is in
memory at a time. A file that fits in one window is shuffled exactly as a JSONL file of the same rows.
Every order is a pure function of (seed, epoch, the file's row-group sizes), so a resumed run finds its
position without reading what came before. Test: pytest tests/engine/data/test_parquet_rows.py
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BATCH_ROWS = 1024  # rows converted to Python at once
WINDOW_ROWS = 65536  # rows shuffled together (data.shuffle), unless one row group holds more


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("data.source: Parquet files need pyarrow: pip install 'tailrace[parquet]'") from None
    return pq


class ParquetRows:
    """len() is the file's row count, read from its footer; epoch_rows() yields rows as dicts."""

    def __init__(self, path: str | Path):
        self.file = _pyarrow_parquet().ParquetFile(path)
        meta = self.file.metadata
        self.group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.num_rows = meta.num_rows

    def __len__(self) -> int:
        return self.num_rows

    def epoch_rows(self, epoch: int, offset: int, *, shuffle: bool, seed: int) -> Iterator[dict[str, Any]]:
        """Rows offset, offset + 1, ... of epoch `epoch`'s order."""
        if not shuffle:
            yield from self._in_file_order(offset)
            return
        windows = self.windows(epoch, seed)
        sizes = [sum(self.group_rows[g] for g in w) for w in windows]
        starts = list(itertools.accumulate(sizes, initial=0))
        w = bisect.bisect_right(starts, offset) - 1
        for index in range(w, len(windows)):
            yield from self._window(windows[index], self.window_order(epoch, seed, index, sizes[index]),
                                    offset - starts[index] if index == w else 0)

    def windows(self, epoch: int, seed: int) -> list[list[int]]:
        """The row groups of each window of an epoch, each window's in file order."""
        order = list(range(len(self.group_rows)))
        random.Random(f"{seed}/{epoch}/row-groups").shuffle(order)
        windows: list[list[int]] = []
        rows = 0
        for g in order:
            if not windows or rows + self.group_rows[g] > WINDOW_ROWS:
                windows.append([])
                rows = 0
            windows[-1].append(g)
            rows += self.group_rows[g]
        return [sorted(w) for w in windows]

    @staticmethod
    def window_order(epoch: int, seed: int, index: int, num_rows: int) -> list[int]:
        # Window 0 draws from the string a JSONL epoch draws from: a one-window file shuffles alike.
        order = list(range(num_rows))
        random.Random(f"{seed}/{epoch}" + (f"/window-{index}" if index else "")).shuffle(order)
        return order

    def _window(self, groups: list[int], order: list[int], skip: int) -> Iterator[dict[str, Any]]:
        if skip >= len(order):
            return
        table = self.file.read_row_groups(groups)
        for start in range(skip, len(order), BATCH_ROWS):
            yield from table.take(order[start:start + BATCH_ROWS]).to_pylist()

    def _in_file_order(self, offset: int) -> Iterator[dict[str, Any]]:
        starts = list(itertools.accumulate(self.group_rows, initial=0))
        first = bisect.bisect_right(starts, offset) - 1
        if offset >= self.num_rows:
            return
        skip = offset - starts[first]
        for batch in self.file.iter_batches(batch_size=BATCH_ROWS, row_groups=range(first, len(self.group_rows))):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            yield from batch.slice(skip).to_pylist()
            skip = 0
