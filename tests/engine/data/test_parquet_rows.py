"""Parquet prompt files read a bounded piece at a time: file order through iter_batches, shuffled epochs
by windows of row groups, exact resume inside an epoch, never the whole file at once (the reads are
counted). Needs pyarrow (the `parquet` extra). Run: pytest tests/engine/data/test_parquet_rows.py
"""

import json

import pytest

from tailrace.engine.config import DataConfig
from tailrace.engine.data import parquet_rows
from tailrace.engine.data.prompt_sources import PromptSource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 50 + 4 for c in text]


def _parquet(tmp_path, n, row_group_size, name="p.parquet"):
    path = tmp_path / name
    table = pa.table({"prompt": [f"p{i}" for i in range(n)], "answer": [str(i) for i in range(n)]})
    pq.write_table(table, path, row_group_size=row_group_size)
    assert pq.ParquetFile(path).num_row_groups == max(1, -(-n // row_group_size))
    return str(path)


def _texts(cfg, position=0):
    return [p.text for p in PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100, position=position)]


@pytest.fixture
def reads(monkeypatch):
    """Rows each read of the Parquet file materialised: one entry per read_row_groups / per batch."""
    sizes = []
    real_read, real_iter = pq.ParquetFile.read_row_groups, pq.ParquetFile.iter_batches

    def read_row_groups(self, groups, *args, **kwargs):
        table = real_read(self, groups, *args, **kwargs)
        sizes.append(table.num_rows)
        return table

    def iter_batches(self, *args, **kwargs):
        for batch in real_iter(self, *args, **kwargs):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", read_row_groups)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read the whole file"))
    return sizes


def test_file_order_streams_in_batches_and_resumes_inside_a_row_group(tmp_path, monkeypatch, reads):
    monkeypatch.setattr(parquet_rows, "BATCH_ROWS", 4)
    cfg = DataConfig(source=_parquet(tmp_path, 50, row_group_size=10), epochs=2)
    full = _texts(cfg)
    assert full == [f"p{i}" for i in range(50)] * 2
    assert reads and max(reads) <= 4
    for position in (0, 13, 49, 50, 77):
        assert _texts(cfg, position) == full[position:]
    record = next(PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100, position=13))
    assert record.prompt_id == 13 and record.metadata["answer"] == "13"


def test_shuffled_epochs_by_windows_resume_exactly_and_hold_one_window(tmp_path, monkeypatch, reads):
    monkeypatch.setattr(parquet_rows, "WINDOW_ROWS", 25)
    cfg = DataConfig(source=_parquet(tmp_path, 100, row_group_size=10), epochs=2, shuffle=True, seed=3)
    full = _texts(cfg)
    first, second = full[:100], full[100:]
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(100))
    assert first != second and first != [f"p{i}" for i in range(100)]
    assert max(reads) <= 20  # windows of two row groups: 25 rows do not hold three
    assert full == _texts(cfg)
    assert full != _texts(DataConfig(source=cfg.source, epochs=2, shuffle=True, seed=4))
    for position in (1, 19, 20, 55, 99, 100, 163):  # window edges and insides, both epochs
        assert _texts(cfg, position) == full[position:]
    # Rows of one window stay together in the epoch; windows are whole row groups in a drawn order.
    windows = parquet_rows.ParquetRows(cfg.source).windows(0, 3)
    assert sorted(g for w in windows for g in w) == list(range(10)) and all(len(w) == 2 for w in windows)
    groups = [int(t[1:]) // 10 for t in first[:20]]
    assert sorted(set(groups)) == windows[0]


def test_a_file_within_one_window_shuffles_as_the_same_rows_in_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(30)))
    for seed in (0, 5):
        jsonl = DataConfig(source=str(path), shuffle=True, seed=seed, epochs=2)
        parquet = DataConfig(source=_parquet(tmp_path, 30, row_group_size=7), shuffle=True, seed=seed, epochs=2)
        assert _texts(parquet) == _texts(jsonl)


def test_empty_row_groups_and_an_empty_file(tmp_path):
    path = tmp_path / "gaps.parquet"
    schema = pa.schema([("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for rows in (["a0", "a1", "a2"], [], ["b0", "b1"], []):
            writer.write_table(pa.table({"prompt": rows}, schema=schema))
    assert [g for g in parquet_rows.ParquetRows(path).group_rows] == [3, 0, 2, 0]
    for shuffle in (False, True):
        cfg = DataConfig(source=str(path), shuffle=shuffle, epochs=2, seed=1)
        full = _texts(cfg)
        assert sorted(full) == sorted(["a0", "a1", "a2", "b0", "b1"] * 2)
        assert all(_texts(cfg, position) == full[position:] for position in range(11))
    empty = DataConfig(source=_parquet(tmp_path, 0, row_group_size=5, name="empty.parquet"))
    source = PromptSource(empty, CharTokenizer(), max_prompt_tokens=100)
    assert list(source) == [] and source.num_rows == 0
