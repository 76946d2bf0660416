"""Multi-turn samples: the loss mask (TrainSample.loss_mask, False on observation tokens) through every loss path.

float64 gradients of naive, replay (kept and recomputed forwards) and packed strategies equal a per-sample
reference written out here (plain HF forward, full log-softmax, per-token PPO-clip + KL times the mask) to
1e-9, token-mean and sample-mean, with observations at the start, middle and end of completions and a group
whose episodes share two whole turns (prompt + turn 1 + obs 1 + turn 2 + obs 2) before they diverge; so do the
loss statistics. A learner step of 2 PPO epochs x 2 minibatches, and one with groups accumulated early, equal
the reference algorithm; an all-True mask is bit-identical to None; staleness and the token counts use
assistant tokens only.
Run: pytest tests/engine/trainer/test_loss_mask.py
"""

import copy

import pytest
import torch

from tailrace.engine.config import TrainConfig
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.replay.packed import PackedForwardBackward
from tailrace.engine.replay.replay import ReplayForwardBackward
from tailrace.engine.replay.replay import sample_logprobs as trie_sample_logprobs
from tailrace.engine.replay.trie import build_trie
from tailrace.engine.trainer.learner import Learner, NaiveForwardBackward, sample_logprobs
from tailrace.engine.trainer.loss import LossConfig, StepLoss

torch.set_num_threads(1)
F64 = torch.float64
CLIP_LOW, CLIP_HIGH, IS_CAP, KL_COEF = 0.2, 0.28, 2.0, 0.3
OBS_VERSION = -7  # what a generator might stamp on observation tokens: must never reach staleness


def _episode(parts, gen, *, group_id=0, sample_id=0, assistant_version=0):
    """A sample from ("p"|"a"|"o", tokens) parts: prompt, assistant turns, observations (loss_mask False).
    Observation tokens carry behaviour log-prob 0.0 and a bogus policy version, as the spec allows."""
    prompt = [t for kind, toks in parts if kind == "p" for t in toks]
    completion, mask = [], []
    for kind, toks in parts:
        if kind != "p":
            completion += toks
            mask += [kind == "a"] * len(toks)
    mask_t = torch.tensor(mask)
    behaviour = torch.where(mask_t, -1.5 - 2 * torch.rand(len(mask), generator=gen), torch.zeros(len(mask)))
    versions = torch.where(mask_t, torch.full((len(mask),), assistant_version), torch.full((len(mask),), OBS_VERSION))
    return TrainSample(group_id=group_id, sample_id=sample_id, prompt_ids=prompt, completion_ids=completion,
                       behaviour_logprobs=behaviour, policy_versions=versions, reward=float(torch.rand((), generator=gen)),
                       advantage=float(torch.randn((), generator=gen)), temperature=[1.0, 0.8][sample_id % 2],
                       loss_mask=mask_t)


def _rand(gen, n, vocab):
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def multi_turn_samples(vocab, seed=0, group_id=0, assistant_version=0):
    """Observations at the start, middle and end of completions; four episodes that share prompt + turn 1 +
    obs 1 + turn 2 + obs 2 and then diverge (two of them share turn 3 too); one that shares the deep prefix
    but calls the same tokens of turn 2 an observation (per-sample masks on shared trie nodes); one sample
    without a mask."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda n: _rand(gen, n, vocab)  # noqa: E731
    prompt, turn1, obs1, turn2, obs2, turn3 = r(6), r(4), r(3), r(5), r(4), r(3)
    deep = [("p", prompt), ("a", turn1), ("o", obs1), ("a", turn2), ("o", obs2)]
    episodes = [
        deep + [("a", r(4))],
        deep + [("a", r(2)), ("o", r(2)), ("a", r(3))],
        deep + [("a", turn3), ("o", r(3)), ("a", r(2))],
        deep + [("a", turn3), ("o", r(2))],                          # ends with an observation
        [("p", prompt), ("a", turn1), ("o", obs1), ("o", turn2), ("o", obs2), ("a", r(3))],  # turn 2 as an obs
        [("p", prompt), ("o", r(3)), ("a", r(5)), ("o", r(2)), ("a", r(2))],  # starts with an observation
        [("p", r(4)), ("a", r(2)), ("o", r(6)), ("a", r(3))],        # middle, its own trie root
    ]
    out = [_episode(e, gen, group_id=group_id, sample_id=i, assistant_version=assistant_version)
           for i, e in enumerate(episodes)]
    t = 5
    out.append(TrainSample(group_id=group_id, sample_id=len(out), prompt_ids=prompt, completion_ids=turn1 + r(1),
                           behaviour_logprobs=-1.5 - torch.rand(t, generator=gen),
                           policy_versions=torch.full((t,), assistant_version), reward=0.3,
                           advantage=float(torch.randn((), generator=gen))))
    return out


def _hf_logprobs(model, s):
    """One plain HF forward of the whole episode, full [T, V] log-softmax at its temperature: log-probs [T]."""
    ids = torch.cat([s.prompt_ids, s.completion_ids])[None]
    logits = model(input_ids=ids).logits[0, s.num_prompt_tokens - 1: -1] / s.temperature
    logp_TV = torch.log_softmax(logits, -1)
    entropy = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(-1, s.completion_ids[:, None]).squeeze(-1), entropy.detach()


def _mask(s):
    return torch.ones(s.num_completion_tokens, dtype=torch.bool) if s.loss_mask is None else s.loss_mask


def _reference(model, samples, prox, aggregation, ref=None):
    """(flat gradient, masked statistics): per sample, the per-token PPO-clip loss with the truncated
    behaviour->proximal weight (plus KL_COEF x k3 to `ref` when given), times the mask, normalised over masked
    tokens; the statistics (token, clipped and truncated counts, sums of entropy, weight and KL) over them."""
    model.zero_grad(set_to_none=True)
    num_masked = sum(int(_mask(s).sum()) for s in samples)
    stats = dict(tokens=num_masked, clipped=0, truncated=0, entropy=0.0, is_weight=0.0, kl_ref=0.0)
    for i, (s, prox_T) in enumerate(zip(samples, prox, strict=True)):
        logp, entropy = _hf_logprobs(model, s)
        m = _mask(s).to(F64)
        ratio = torch.exp(logp - prox_T)
        a = torch.full_like(logp, s.advantage)
        obj = torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        is_w = torch.exp(prox_T - s.behaviour_logprobs.to(F64)).clamp(max=IS_CAP)
        per_token = -is_w * obj
        if ref is not None:
            delta = ref[i] - logp
            per_token = per_token + KL_COEF * (torch.exp(delta) - delta - 1)
            stats["kl_ref"] += float(((torch.exp(delta) - delta - 1) * m).sum().detach())
        denom = num_masked if aggregation == "token_mean" else len(samples) * float(m.sum())
        ((per_token * m).sum() / denom).backward()
        with torch.no_grad():
            stats["clipped"] += int(((ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a < ratio * a) & _mask(s)).sum())
            stats["truncated"] += int(((prox_T - s.behaviour_logprobs.to(F64)).exp().gt(IS_CAP) & _mask(s)).sum())
            stats["entropy"] += float((entropy * m).sum())
            stats["is_weight"] += float((is_w * m).sum())
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    return grad, stats


def _prox(model, samples, seed=3):
    """A proximal policy per sample that differs from the current one (ratios move and clip); garbage at
    observation tokens, which no loss term may read."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = []
        for s in samples:
            lp = _hf_logprobs(model, s)[0] + 0.6 * torch.rand(s.num_completion_tokens, generator=gen, dtype=F64) - 0.3
            out.append(torch.where(_mask(s), lp, torch.full_like(lp, 40.0)))
    return out


STRATEGIES = {
    "naive": lambda: NaiveForwardBackward(100_000, 7),
    "naive_small_micro_batches": lambda: NaiveForwardBackward(24, 3),
    "replay": lambda: ReplayForwardBackward(5),
    "replay_recompute": lambda: ReplayForwardBackward(5, activation_budget_bytes=0, max_batch_tokens=4),
    "packed": lambda: PackedForwardBackward(64, 5),
    "packed_one_pack_per_root": lambda: PackedForwardBackward(1, 3),
}


def _grads(model, samples, strategy, loss_fn):
    model.zero_grad(set_to_none=True)
    stats = strategy(model, samples, loss_fn, LossNormaliser.from_samples(samples))
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


@pytest.mark.parametrize("arch,aggregation", [("llama", "token_mean"), ("qwen2", "sample_mean"),
                                              ("llama", "sample_mean"), ("qwen2", "token_mean")])
def test_masked_gradients_equal_the_per_sample_reference(arch, aggregation, cached_exact_model, exact_vocab, rel_err):
    model = cached_exact_model(arch)
    samples = multi_turn_samples(exact_vocab, seed=len(arch))
    prox, ref_logprobs = _prox(model, samples), _prox(model, samples, seed=5)  # a reference model's, for the KL
    expected, want = _reference(model, samples, prox, aggregation, ref=ref_logprobs)
    assert 0 < want["tokens"] < sum(s.num_completion_tokens for s in samples)
    cfg = LossConfig(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, is_cap=IS_CAP, kl_coef=KL_COEF,
                     aggregation=aggregation)
    errors = {}
    for name, make in STRATEGIES.items():
        got, stats = _grads(model, samples, make(), StepLoss(samples, cfg, prox_logprobs=prox, ref_logprobs=ref_logprobs))
        errors[name] = rel_err(got, expected)
        assert float(stats["entropy_tokens"]) == want["tokens"], name
        for key in ("tokens", "clipped", "truncated"):
            assert float(stats[key]) == want[key], (name, key)
        for key in ("entropy", "is_weight", "kl_ref"):
            assert float(stats[key]) == pytest.approx(want[key], rel=1e-12), (name, key)
    assert max(errors.values()) <= 1e-9, errors
    # The clip and the truncation act on masked-in tokens, so the comparison covers them.
    assert want["clipped"] > 0 and want["truncated"] > 0


def test_the_trie_shares_observation_tokens_and_gives_them_no_loss_rows(exact_vocab):
    samples = multi_turn_samples(exact_vocab)
    masked = build_trie(samples)
    plain = [copy.copy(s) for s in samples]
    for s in plain:
        s.loss_mask = None
    unmasked = build_trie(plain)
    # The mask changes which rows exist, never the trie: observation tokens are shared prefix like any other.
    assert torch.equal(masked.tokens_N, unmasked.tokens_N) and torch.equal(masked.seg_start_S, unmasked.seg_start_S)
    # Episodes 0-4 share prompt + turn 1 + obs 1 + turn 2 + obs 2 (episode 4 calls turn 2 an observation): their
    # common path reaches that depth, runs once, and they diverge below it.
    deep = 6 + 4 + 3 + 5 + 4
    paths = [masked.sample_path[i] for i in range(5)]
    common = [seg for seg, *others in zip(*paths, strict=False) if all(o == seg for o in others)]
    assert common == paths[0][:len(common)]
    last = common[-1]
    assert int(masked.seg_depth_S[last] + masked.seg_len_S[last]) >= deep
    assert len({tuple(p) for p in paths}) == 5
    rows = set(zip(masked.row_sample_R.tolist(), masked.row_pos_R.tolist(), strict=True))
    assert rows == {(i, p) for i, s in enumerate(samples) for p in s.loss_positions.tolist()}
    assert masked.row_sample_R.numel() == sum(s.num_loss_tokens for s in samples)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_an_all_true_mask_is_bit_identical_to_no_mask(name, cached_exact_model, group_samples):
    model = cached_exact_model("qwen2")
    plain = group_samples(4)
    masked = [copy.copy(s) for s in plain]
    for s in masked:
        s.loss_mask = torch.ones(s.num_completion_tokens, dtype=torch.bool)
    cfg = LossConfig(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, is_cap=IS_CAP, aggregation="sample_mean")
    prox = _prox(model, plain)
    g0, s0 = _grads(model, plain, STRATEGIES[name](), StepLoss(plain, cfg, prox_logprobs=prox))
    g1, s1 = _grads(model, masked, STRATEGIES[name](), StepLoss(masked, cfg, prox_logprobs=prox))
    assert torch.equal(g0, g1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_policy_logprobs_are_per_completion_position_with_zero_at_observations(cached_exact_model, exact_vocab):
    model = cached_exact_model("llama")
    samples = multi_turn_samples(exact_vocab)
    naive = sample_logprobs(model, samples, micro_batch_tokens=40, chunk_rows=3)
    trie = trie_sample_logprobs(model, samples, 3)
    for s, a, b in zip(samples, naive, trie, strict=True):
        expected = _hf_logprobs(model, s)[0].detach()
        m = _mask(s)
        assert a.shape == b.shape == (s.num_completion_tokens,)
        torch.testing.assert_close(a[m], expected[m], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b[m], expected[m], rtol=1e-12, atol=1e-12)
        assert not bool(a[~m].any()) and not bool(b[~m].any())


def _naive_ppo_step(model, groups, *, lr, epochs, minibatches, max_grad_norm, aggregation="token_mean"):
    """The algorithm sample by sample: GRPO advantages per group (population std), consecutive parts, the
    policy before the step as proximal, per epoch and part the masked token-mean loss, clip, AdamW."""
    for g in groups:
        r = torch.tensor(g.rewards, dtype=F64)
        for s, a in zip(g.samples, ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist(), strict=True):
            s.advantage = a
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    with torch.no_grad():
        prox = {id(s): _hf_logprobs(model, s)[0] for g in groups for s in g.samples}
    size = -(-len(groups) // minibatches)
    parts = [groups[i:i + size] for i in range(0, len(groups), size)]
    for _ in range(epochs):
        for part in parts:
            samples = [s for g in part for s in g.samples]
            opt.zero_grad(set_to_none=True)
            _reference(model, samples, [prox[id(s)] for s in samples], aggregation)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("replay", ["naive", "replay", "packed"])
def test_ppo_two_epochs_over_episodes_equals_the_reference(replay, exact_model, exact_vocab, rel_err):
    base = exact_model("qwen2")

    expected = _naive_ppo_step(copy.deepcopy(base), _episode_groups(exact_vocab), lr=3e-2, epochs=2, minibatches=2, max_grad_norm=1.0)
    model = copy.deepcopy(base)
    learner = Learner(model, TrainConfig(lr=3e-2, replay=replay, ppo_epochs=2, minibatches=2, max_grad_norm=1.0,
                                         weight_decay=0.01, betas=(0.9, 0.999), micro_batch_tokens=64,
                                         logprob_chunk_tokens=5, clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH,
                                         is_cap=IS_CAP), initial_policy_version=6)
    batch = _episode_groups(exact_vocab)
    metrics = learner.step(batch)
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    before = torch.cat([p.detach().flatten() for p in base.parameters()])
    err = rel_err(got - before, expected - before)
    assert err <= 1e-9, err
    assert metrics["trainer/ppo/epoch2/clip_frac"] > 0.0 and metrics["trainer/ppo/updates"] == 4.0
    # Counts and staleness over assistant tokens: observation tokens' stamped version (-7) is ignored.
    assert metrics["trainer/tokens/loss"] == sum(s.num_loss_tokens for g in batch for s in g.samples)
    assert metrics["trainer/staleness/max"] == 2.0 and metrics["trainer/staleness/mean"] == 1.5


def _episode_groups(vocab):
    return [Group(group_id=g, samples=multi_turn_samples(vocab, seed=g, group_id=g, assistant_version=4 + g))
            for g in range(2)]


@pytest.mark.parametrize("aggregation", ["token_mean", "sample_mean"])
def test_groups_accumulated_early_give_the_same_step(aggregation, exact_model, exact_vocab, rel_err):
    """accumulate() runs some groups before the step under normaliser 1 and scales them once the step's masked
    token count is known: the same update as the reference."""
    base = exact_model("llama")
    expected = _naive_ppo_step(copy.deepcopy(base), _episode_groups(exact_vocab), lr=3e-2, epochs=1, minibatches=1,
                               max_grad_norm=1.0, aggregation=aggregation)
    model = copy.deepcopy(base)
    learner = Learner(model, TrainConfig(lr=3e-2, replay="replay", max_grad_norm=1.0, weight_decay=0.01,
                                         betas=(0.9, 0.999), loss_agg=aggregation, clip_eps_low=CLIP_LOW,
                                         clip_eps_high=CLIP_HIGH, is_cap=IS_CAP), initial_policy_version=6)
    batch = _episode_groups(exact_vocab)
    assert learner.accumulate(batch[:1])
    metrics = learner.step(batch)
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    before = torch.cat([p.detach().flatten() for p in base.parameters()])
    assert rel_err(got - before, expected - before) <= 1e-9, rel_err(got - before, expected - before)
    assert metrics["trainer/accumulated_groups"] == 1.0


def test_loss_mask_is_validated():
    def sample(mask, t=3):
        return TrainSample(group_id=0, sample_id=0, prompt_ids=[1], completion_ids=[2] * t,
                           behaviour_logprobs=[-1.0] * t, policy_versions=[0] * t, reward=0.0, loss_mask=mask)

    assert sample([True, False, True]).loss_mask.dtype == torch.bool
    s = sample(torch.tensor([0, 1, 1], dtype=torch.int32))  # decoded wire frames may be 0/1 integers
    assert s.loss_mask.tolist() == [False, True, True] and s.num_loss_tokens == 2
    assert s.loss_positions.tolist() == [1, 2] and s.num_completion_tokens == 3
    assert sample(None).num_loss_tokens == 3
    for bad, match in [([True, False], "length 2"), ([False] * 3, "at least one"), ([0.0, 1.0, 1.0], "bool"),
                       ([0, 2, 1], "bool")]:
        with pytest.raises(ValueError, match=f"loss_mask: .*{match}"):
            sample(bad)
