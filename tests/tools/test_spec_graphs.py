"""bench spec's CUDA-graph race (tools/benches/spec.py measure_cuda_graphs), run on a CPU with the
uncaptured fixed-shape forwards: both backends decode every request, the figures are there, and without a
CUDA device the default call says it measured nothing.
Run: pytest tests/tools/test_spec_graphs.py"""

import pytest
import torch

from tools.benches import spec


def test_the_race_runs_both_backends_over_every_request():
    from tailrace.engine.core.models import load_tokenizer

    torch.set_num_threads(1)
    prompts = spec._prompts(load_tokenizer("tiny"), 1, seed=2, min_chars=20)
    lines = []
    out = spec.measure_cuda_graphs("tiny", prompts, lines.append, device="cpu", mode="static", batch_sizes=(1, 4))
    assert set(out["cuda_graphs_speedup_by_batch"]) == set(out["cuda_graphs_suffix_speedup_by_batch"]) == {"1", "4"}
    assert all(0.05 < x < 20 for x in out["cuda_graphs_speedup_by_batch"].values())
    assert out["cuda_graphs_captured"] == 0 and out["cuda_graphs_replayed"] == 0  # nothing captured on a CPU
    assert len(lines) == 4 and all("static forwards" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_without_a_cuda_device_it_says_so():
    assert spec.measure_cuda_graphs("tiny", [], print) == {"cuda_graphs": "not measured: no CUDA device"}
