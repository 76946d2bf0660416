"""Tree-sampled rollouts in the torch backend: a group forks from one trunk row at fixed depths.

References: plain greedy decoding, and each branch decoded alone from its full prefix (prompt plus the
trunk tokens) with the same seeded stream, which checks the copied key/value rows.
Run: pytest tests/engine/generator/torch_backend/test_tree_sampling.py
"""

import pytest
import torch

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.requests import Request, requests_for
from tailrace.engine.generator.speculation.speculative import FixedDepth
from tailrace.engine.generator.torch_backend.backend import TorchBackend
from tailrace.engine.generator.torch_backend.tree import TreeSampling, split_samples
from tailrace.protocol.messages import SamplingParams, WorkItem

torch.set_num_threads(1)

PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("qwen2")


def item(num_samples: int, sampling: SamplingParams, group_id: int = 7, first: int = 100) -> WorkItem:
    return WorkItem(group_id=group_id, prompt_token_ids=PROMPT, num_samples=num_samples,
                    first_sample_id=first, sampling=sampling)


def run_tree(model, work: WorkItem, *, max_batch_size: int = 8, **tree) -> tuple[dict, int]:
    """Finished samples of one item, and the most rows that ran at once."""
    backend = TorchBackend(model, max_batch_size=max_batch_size, max_model_len=64, tree=TreeSampling(**tree))
    for req in requests_for(work):
        backend.add(req)
    done, most_rows = {}, 0
    for _ in range(500):
        for fin in backend.step():
            assert (fin.group_id, fin.sample_id) not in done
            done[fin.group_id, fin.sample_id] = fin
        most_rows = max(most_rows, backend.num_running)
        if not backend.num_running and not backend.num_waiting:
            return done, most_rows
    raise AssertionError("backend did not finish")


def test_tree_sampling_validates_and_splits():
    with pytest.raises(ValueError, match="fork_depths"):
        TreeSampling(fork_depths=(4, 2))
    with pytest.raises(ValueError, match="branching"):
        TreeSampling(fork_depths=(2,), branching=1)
    with pytest.raises(ValueError, match="exactly one"):
        TreeSampling(fork_depths=(2,), fork_entropy=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        TreeSampling()
    assert split_samples(list("abcde"), 2) == [list("abc"), list("de")]
    assert TreeSampling(fork_depths=(2, 5)).next_fork(5) == 2


def test_greedy_branches_equal_plain_greedy(model, greedy_reference):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    done, _ = run_tree(model, item(6, sampling), fork_depths=(2, 5), branching=2)
    expected = greedy_reference(model, PROMPT, 10)
    assert sorted(s for _, s in done) == list(range(100, 106))
    for fin in done.values():
        assert fin.completion_ids.tolist() == expected and fin.finish_reason == "length"


def test_sampled_branches_share_the_trunk_and_match_a_branch_decoded_alone(model, run):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    done, _ = run_tree(model, item(4, sampling), fork_depths=(3, 7), branching=2)
    assert sorted(s for _, s in done) == [100, 101, 102, 103]
    fins = list(done.values())
    trunk = fins[0]
    for fin in fins:
        assert len(fin.completion_ids) == 12 and fin.finish_reason == "length"
        assert fin.completion_ids[:3].tolist() == trunk.completion_ids[:3].tolist()
        assert torch.equal(fin.behaviour_logprobs[:3], trunk.behaviour_logprobs[:3])
    # At depth 3 the row of {100..103} keeps {100, 101} and clone 102 takes {102, 103}; at depth 7
    # each pair splits (clones 101 and 103).
    tails = {s: done[7, s].completion_ids for s in range(100, 104)}
    assert not torch.equal(tails[100][3:], tails[102][3:])  # distinct seeded streams after the fork
    # A clone starts its own seeded stream at the fork: decoding its full prefix alone, with the same
    # sample id and seed, must give the same continuation (same cached keys/values, same draws).
    for sample_id, depth in ((102, 3), (101, 7), (103, 7)):
        fin = done[7, sample_id]
        prefix = PROMPT + fin.completion_ids[:depth].tolist()
        alone_params = SamplingParams(temperature=1.0, max_new_tokens=12 - depth, seed=5)
        alone = run(TorchBackend(model, max_batch_size=1, max_model_len=64),
                    {0: [Request(7, sample_id, prefix, alone_params)]})[7, sample_id]
        assert alone.completion_ids.tolist() == fin.completion_ids[depth:].tolist()
        torch.testing.assert_close(alone.behaviour_logprobs, fin.behaviour_logprobs[depth:], atol=1e-5, rtol=0)


def test_forks_respect_capacity_and_lose_no_sample(model):
    # 7 samples, branching 4, but only 3 rows: forks take what fits, held samples beyond the last
    # depth start over as requests of their own; every sample id finishes exactly once.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    done, most_rows = run_tree(model, item(7, sampling), max_batch_size=3, fork_depths=(2, 4), branching=4)
    assert most_rows == 3
    assert sorted(s for _, s in done) == list(range(100, 107))
    assert all(len(f.completion_ids) == 6 and f.finish_reason == "length" for f in done.values())


def test_stop_before_the_fork_requeues_the_held_samples(model, greedy_reference):
    # The greedy trunk's first token is a stop token: it finishes before any fork, and the held
    # samples run on as ordinary requests to the same stop.
    first = greedy_reference(model, PROMPT, 1)[0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[first])
    done, _ = run_tree(model, item(3, sampling), fork_depths=(2,))
    assert sorted(s for _, s in done) == [100, 101, 102]
    for fin in done.values():
        assert fin.completion_ids.tolist() == [first] and fin.finish_reason == "stop"


def test_cancel_returns_held_branches(model):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1)
    backend = TorchBackend(model, max_batch_size=4, max_model_len=64, tree=TreeSampling(fork_depths=(10,)))
    for req in requests_for(item(3, sampling)):
        backend.add(req)
    backend.step()
    assert backend.num_running == 1 and backend.num_waiting == 2
    out = backend.cancel([7])
    assert sorted(f.sample_id for f in out) == [100, 101, 102]
    assert all(f.finish_reason == "cancelled" for f in out)
    assert backend.num_running == 0 and backend.num_waiting == 0


def test_forked_rows_cache_equals_recompute(model, row_cache_matches_recompute):
    # Right after the fork at depth 3 every row (trunk and clones) holds the keys/values of the prompt
    # and the trunk tokens fed so far, exactly as a full forward over them would.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    backend = TorchBackend(model, max_batch_size=4, max_model_len=64,
                           tree=TreeSampling(fork_depths=(3,), branching=4))
    for req in requests_for(item(4, sampling)):
        backend.add(req)
    for _ in range(3):
        backend.step()
    assert backend.num_running == 4 and backend.num_waiting == 0
    for row in range(4):
        generated = backend.rows.out_tokens_RL[row, :3].tolist()
        row_cache_matches_recompute(model, backend, row, PROMPT + generated[:-1])
        assert generated == backend.rows.out_tokens_RL[0, :3].tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_tree_with_speculation_greedy(model, k, run, greedy_reference):
    backend = TorchBackend(model, max_batch_size=4, max_model_len=64, tree=TreeSampling(fork_depths=(2, 5)))
    backend.enable_speculation(Drafter.for_policy(model, seed=1), FixedDepth(k))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=9)
    done = run(backend, {0: requests_for(item(5, sampling))})
    assert sorted(s for _, s in done) == list(range(100, 105))
    expected = greedy_reference(model, PROMPT, 9)
    assert all(f.completion_ids.tolist() == expected for f in done.values())


@pytest.fixture(scope="module")
def plain_samples(run):
    def plain_samples(model, work: WorkItem) -> dict:
        return run(TorchBackend(model, max_batch_size=8, max_model_len=64), {0: requests_for(work)})

    return plain_samples


def test_entropy_mode_forks_before_the_uncertain_draw(model, run, plain_samples):
    # Threshold 0 forks at every position until max_forks: the row of {100..103} forks before its
    # first draw (clone 102 is then an ordinary sample), and both rows fork before the second draw.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=21)
    work = item(4, sampling)
    done, _ = run_tree(model, work, fork_entropy=0.0, max_forks=2, branching=2)
    assert sorted(s for _, s in done) == [100, 101, 102, 103]
    plain = plain_samples(model, work)
    assert done[7, 100].completion_ids[0] == done[7, 101].completion_ids[0]
    assert torch.equal(done[7, 100].behaviour_logprobs[:1], done[7, 101].behaviour_logprobs[:1])
    for key in ((7, 100), (7, 102)):  # own streams from the first draw on
        assert done[key].completion_ids.tolist() == plain[key].completion_ids.tolist()
        torch.testing.assert_close(done[key].behaviour_logprobs, plain[key].behaviour_logprobs, atol=1e-5, rtol=0)
    for sample_id, trunk in ((101, 100), (103, 102)):
        fin = done[7, sample_id]
        assert fin.completion_ids[0] == done[7, trunk].completion_ids[0]
        alone = run(TorchBackend(model, max_batch_size=1, max_model_len=64),
                    {0: [Request(7, sample_id, PROMPT + fin.completion_ids[:1].tolist(),
                                 SamplingParams(temperature=1.0, max_new_tokens=7, seed=21))]})[7, sample_id]
        assert alone.completion_ids.tolist() == fin.completion_ids[1:].tolist()


def test_entropy_mode_without_uncertainty_gives_ordinary_samples(model, plain_samples):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)
    work = item(3, sampling)
    # The trunk never forks; its two held samples then run side by side as ordinary requests.
    done, most_rows = run_tree(model, work, fork_entropy=1e9)
    assert most_rows == 2
    plain = plain_samples(model, work)
    assert sorted(done) == sorted(plain)
    for key, fin in plain.items():
        assert done[key].completion_ids.tolist() == fin.completion_ids.tolist()


def test_entropy_mode_refuses_speculation(model):
    backend = TorchBackend(model, max_batch_size=2, max_model_len=64, tree=TreeSampling(fork_entropy=1.0))
    with pytest.raises(ValueError, match="entropy"):
        backend.enable_speculation(Drafter.for_policy(model), FixedDepth(1))
