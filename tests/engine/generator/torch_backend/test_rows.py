"""The running rows' shared state (engine/generator/torch_backend/rows.py) on its own: rows join with their
prompt's last token pending, budgets and stop ids; leaving rows are swap-removed with every per-row tensor
(registered ones too) and the cache's columns moving with them; the sampling batch is rebuilt only when
rows join or leave. The backend's tests (test_backend.py, speculation's) run it in the whole decode loop.
Run: pytest tests/engine/generator/torch_backend/test_rows.py
"""

from types import SimpleNamespace

import pytest
import torch

from tailrace.engine.generator.requests import Request
from tailrace.engine.generator.torch_backend.kv import SlotKVCache
from tailrace.engine.generator.torch_backend.rows import NO_TOKEN, RowState
from tailrace.protocol.messages import SamplingParams


def _rows(max_rows: int = 4) -> RowState:
    kv = SlotKVCache(num_layers=1, max_rows=max_rows, capacity=32, device="cpu")
    return RowState(kv, max_model_len=20, spare=3, eos_token_ids=[2, 2])


def _seq(group: int, prompt: list[int], **sampling) -> SimpleNamespace:
    return SimpleNamespace(request=Request(group, 0, prompt, SamplingParams(**sampling)), generator=torch.Generator())


def test_admitted_rows_feed_their_last_prompt_token_within_their_budget():
    rows = _rows()
    rows.admit([_seq(0, [5, 6, 7], max_new_tokens=4, stop_token_ids=[9]), _seq(1, list(range(3, 19)))])
    assert rows.num_rows == 2 and rows.out_tokens_RL.shape[1] == 20 + 3 + 1
    assert rows.pending_R[:2].tolist() == [7, 18] and rows.pos_R[:2].tolist() == [2, 15]
    assert rows.limit_R[:2].tolist() == [4, 4]  # the second: 20 - 16 prompt tokens left, under its 16
    assert rows.stop_RS[0, :3].tolist() == [2, 9, NO_TOKEN] and rows.stop_RS[1, :2].tolist() == [2, NO_TOKEN]


def test_removed_rows_are_filled_from_the_end_with_all_their_state():
    rows = _rows()
    extra_R = torch.zeros(4, 3)
    rows.add_row_state(extra_R)
    seqs = [_seq(g, [10 + g, 20 + g]) for g in range(4)]
    rows.admit(seqs)
    rows.kv.end = 4
    rows.kv.valid_RC[:4, :4] = torch.eye(4, dtype=torch.bool)  # row r holds column r only
    for r in range(4):
        rows.out_tokens_RL[r, :2] = torch.tensor([r, r])
        extra_R[r] = r
    rows.remove({0, 2})
    assert rows.seqs == [seqs[3], seqs[1]]  # row 3 moved into the hole at 0; row 2 just left
    assert rows.pending_R[:2].tolist() == [23, 21] and rows.out_tokens_RL[:2, :2].tolist() == [[3, 3], [1, 1]]
    assert extra_R[:2, 0].tolist() == [3.0, 1.0]
    assert rows.kv.valid_RC[0, :4].tolist() == [False, False, False, True] and rows.kv.lo == 1
    rows.add_copies([1], [_seq(7, [1])])  # a clone continues from row 1: same state, its own sample
    assert rows.num_rows == 3 and rows.pending_R[2] == 21 and extra_R[2, 0] == 1.0
    assert rows.kv.valid_RC[2].tolist() == rows.kv.valid_RC[1].tolist()
    rows.remove({0, 1, 2})
    assert rows.num_rows == 0 and rows.kv.lo == rows.kv.end == 0


def test_the_sampling_batch_is_rebuilt_only_when_rows_change():
    rows = _rows()
    rows.admit([_seq(0, [1, 2], temperature=0.5), _seq(1, [3, 4], temperature=1.0)])
    batch = rows.sampling()
    assert rows.sampling() is batch and batch.temperature_B.tolist() == [0.5, 1.0]
    rows.remove({0})
    assert rows.sampling() is not batch and rows.sampling().temperature_B.tolist() == [1.0]


def test_a_row_state_of_another_batch_size_is_refused():
    with pytest.raises(ValueError, match="row state: 3 rows"):
        _rows().add_row_state(torch.zeros(3, 2))
