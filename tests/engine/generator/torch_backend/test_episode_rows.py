"""Multi-turn episode rows in the torch backend: a turn parks the row with its cache, resume() prefills the
observation against it, and the completion equals a fresh full-sequence forward over prompt, assistant and
observation tokens; versions stay per token across an in-flight update; cancel and capacity see parked rows;
speculative decoding stays token-for-token exact under greedy across turns.
Run: pytest tests/engine/generator/torch_backend/test_episode_rows.py
"""

import random

import pytest
import torch

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.requests import Request
from tailrace.engine.generator.speculation.drafter_training import KeyRecorder
from tailrace.engine.generator.speculation.speculative import FixedDepth
from tailrace.engine.generator.stop_strings import StopScan, StopStrings
from tailrace.engine.generator.torch_backend.backend import TorchBackend
from tailrace.protocol.messages import SamplingParams

torch.set_num_threads(1)

STOPS = list(range(10, 22))  # 12 of 64 ids end a turn: turns of a few tokens on a random tiny model
OBS = [[5, 6, 7], [8], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("qwen2")


def _episodes(backend, requests, *, max_turns=3, on_turn=None, max_steps=400):
    """Step until every request is done; each "turn" is resumed with the next of OBS until max_turns, then
    finished "stop" (or "length" where the observation would not fit). Returns ({key: Finished}, {key: [turn Finished...]})."""
    for r in requests:
        backend.add(r)
    done, turns = {}, {}
    for _ in range(max_steps):
        for fin in backend.step():
            key = fin.group_id, fin.sample_id
            if fin.finish_reason != "turn":
                done[key] = fin
                continue
            turns.setdefault(key, []).append(fin)
            if on_turn is not None:
                on_turn(backend, key, len(turns[key]))
            if len(turns[key]) >= max_turns:
                done[key] = backend.finish(key, "stop")
            elif len(fin.completion_ids) + len(OBS[len(turns[key]) - 1]) >= 60:  # the budgets below
                done[key] = backend.finish(key, "length")
            else:
                backend.resume(key, OBS[len(turns[key]) - 1])
        if len(done) == len(requests):
            return done, turns
    raise AssertionError(f"not done after {max_steps} steps")


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _check_against_full_forward(model, fin):
    """Sampled tokens' behaviour log-probs equal a fresh forward of the whole sequence; observation tokens
    are where resume() put them, unmasked, log-prob 0."""
    ids = fin.prompt_ids + fin.completion_ids.tolist()
    ref = _reference_logprobs(model, ids)[len(fin.prompt_ids) - 1:]
    mask = fin.loss_mask
    assert mask is not None and mask.dtype == torch.bool and mask.shape == fin.completion_ids.shape
    torch.testing.assert_close(fin.behaviour_logprobs.double()[mask], ref[mask], atol=1e-5, rtol=1e-5)
    assert (fin.behaviour_logprobs[~mask] == 0).all()
    return mask


@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_turns_keep_the_cache_and_equal_a_full_forward(model, prompts, max_batch_size):
    # Episode rows and a single-turn row share the batch; with one batch row the parked rows hand it over.
    sp = [SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=s) for s in range(4)]
    reqs = [Request(i, 0, p, sp[i], episode=i < 3) for i, p in enumerate(prompts(4, seed=5))]
    backend = TorchBackend(model, max_batch_size=max_batch_size, max_model_len=100)
    done, turns = _episodes(backend, reqs)
    for i in range(3):
        fin = done[i, 0]
        mask = _check_against_full_forward(model, fin)
        num_turns = len(turns[i, 0])
        assert fin.num_turns == num_turns and fin.finish_reason in ("stop", "length")
        # Exactly the observations are unmasked, each right after a turn's end.
        expected = torch.ones_like(mask)
        for t, turn in enumerate(turns[i, 0][:-1]):
            n = len(turn.completion_ids)
            expected[n:n + len(OBS[t])] = False
            assert fin.completion_ids[n:n + len(OBS[t])].tolist() == OBS[t]
        assert mask.tolist() == expected.tolist()
    assert done[3, 0].loss_mask is None and done[3, 0].num_turns == 1
    assert backend.num_parked == 0 and backend.num_running == 0


def test_in_flight_update_between_turns_keeps_per_token_versions(model, make_model, prompts):
    new_weights = make_model("qwen2", seed=1).state_dict()

    def on_turn(backend, key, num_turns):
        if num_turns == 1:
            backend.update_weights(new_weights, 7)

    sp = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=3)
    backend = TorchBackend(make_model("qwen2"), max_batch_size=2, max_model_len=100)
    done, turns = _episodes(backend, [Request(0, 0, prompts(1, seed=6)[0], sp, episode=True)], max_turns=2,
                            on_turn=on_turn)
    fin, first = done[0, 0], len(turns[0, 0][0].completion_ids)
    assert len(turns[0, 0]) == 2
    assert (fin.policy_versions[:first] == 0).all() and (fin.policy_versions[first:] == 7).all()
    # The first turn came from the old weights: its log-probs are the old model's over the same tokens.
    ids = fin.prompt_ids + fin.completion_ids.tolist()
    ref = _reference_logprobs(model, ids)[len(fin.prompt_ids) - 1:]
    torch.testing.assert_close(fin.behaviour_logprobs.double()[:first], ref[:first], atol=1e-5, rtol=1e-5)


def test_cancel_parked_and_resuming_rows_and_capacity(model, prompts):
    sp = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=4)
    backend = TorchBackend(model, max_batch_size=4, max_model_len=100)
    for g, p in enumerate(prompts(2, seed=7)):
        backend.add(Request(g, 0, p, sp, episode=True))
    parked = {}
    for _ in range(200):
        for fin in backend.step():
            assert fin.finish_reason == "turn"
            parked[fin.group_id] = fin
        if len(parked) == 2:
            break
    assert backend.num_parked == 2 and backend.num_running == 0 and backend.capacity() == 2
    backend.resume((1, 0), [5, 6])
    assert backend.num_parked == 1 and backend.num_waiting == 1 and backend.capacity() == 2
    with pytest.raises(ValueError, match="not parked"):
        backend.resume((1, 0), [5])
    out = {f.group_id: f for f in backend.cancel([0, 1])}
    assert {f.finish_reason for f in out.values()} == {"cancelled"}
    for g in (0, 1):
        assert out[g].completion_ids.tolist() == parked[g].completion_ids.tolist()
    assert backend.num_parked == backend.num_waiting == backend.num_running == 0 and backend.capacity() == 4


def test_resume_refuses_an_observation_past_the_budget(model, prompts):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=STOPS, seed=4)
    backend = TorchBackend(model, max_batch_size=1, max_model_len=100)
    done, _ = _episodes(backend, [Request(0, 0, prompts(1, seed=8)[0], sp, episode=True)], max_turns=1)
    backend.add(Request(1, 0, prompts(1, seed=8)[0], sp, episode=True))
    for _ in range(50):
        if [f for f in backend.step() if f.finish_reason == "turn"]:
            break
    with pytest.raises(ValueError, match="budget"):
        backend.resume((1, 0), list(range(30, 38)))


@pytest.mark.parametrize("kind", ["eagle", "suffix"])
def test_speculation_across_turns_is_token_for_token_greedy(model, prompts, spec_backend, kind):
    # Greedy: speculative decoding must give exactly the plain backend's tokens, turns and observations alike.
    sp = SamplingParams(temperature=0.0, max_new_tokens=60, stop_token_ids=STOPS)
    reqs = [Request(i, 0, p, sp, episode=True) for i, p in enumerate(prompts(3, seed=11))]
    plain, _ = _episodes(TorchBackend(model, max_batch_size=2, max_model_len=100), reqs)
    for k in (1, 4):
        backend = spec_backend(model, Drafter.for_policy(model, seed=2), k, kind=kind, max_batch_size=2,
                               max_model_len=100)
        spec, _ = _episodes(backend, reqs)
        for key, fin in plain.items():
            assert spec[key].completion_ids.tolist() == fin.completion_ids.tolist(), (k, key)
            assert spec[key].loss_mask.tolist() == fin.loss_mask.tolist()
        for fin in spec.values():  # each sampled token is the argmax of a fresh forward over all before it
            ids = fin.prompt_ids + fin.completion_ids.tolist()
            with torch.no_grad():
                argmax = model(torch.tensor([ids])).logits[0, len(fin.prompt_ids) - 1:-1].argmax(-1)
            assert (argmax == fin.completion_ids)[fin.loss_mask].all()
            assert (fin.behaviour_logprobs == 0).all()


def test_resumed_rows_drafter_cache_holds_keys_of_true_features(model, prompts):
    # After a resume and eagle steps, every drafter key/value left of the stale window (the observation's
    # columns and the moved cache included) equals the drafter run over the row's tokens with the policy's
    # true hidden states: speculation drafts from a consistent state across turns, not only losslessly.
    drafter = Drafter.for_policy(model, seed=4)
    backend = TorchBackend(model, max_batch_size=2, max_model_len=100)
    backend.enable_speculation(drafter, FixedDepth(2))
    sp = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=9)
    for g, p in enumerate(prompts(2, seed=12)):
        backend.add(Request(g, 0, p, sp, episode=True))
    resumed = 0
    for _ in range(100):
        for fin in backend.step():
            if fin.finish_reason == "turn" and resumed < 2:
                backend.resume((fin.group_id, fin.sample_id), OBS[2])
                resumed += 1
            elif fin.finish_reason == "turn":
                backend.finish((fin.group_id, fin.sample_id), "stop")
        resumed_rows = [r for r, s in enumerate(backend.rows.seqs) if s.num_turns > 1]
        if resumed_rows and backend._spec.stale_back < 3:
            break
    assert resumed_rows, "no resumed row decoded"
    kv, spec = backend.rows.kv, backend._spec
    for row in resumed_rows:
        seq = backend.rows.seqs[row]
        num_gen = int(backend.rows.num_gen_R[row])
        fed = seq.request.prompt_ids + backend.rows.completion(row, num_gen)[0].tolist()
        valid = kv.valid_RC[row, kv.lo:kv.end].nonzero().flatten() + kv.lo
        assert spec.ids_RC[row, valid].tolist() == fed[:-1]
        cols = kv.valid_RC[row, kv.lo:kv.end - spec.stale_back].nonzero().flatten() + kv.lo
        tokens = spec.ids_RC[row, cols]
        with torch.no_grad():
            hidden = model.model(tokens[None]).last_hidden_state
            features = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)
            causal = torch.ones(len(cols), len(cols), dtype=torch.bool).tril()[None, None]
            cache = KeyRecorder()
            drafter(tokens[None], features, torch.arange(len(cols))[None], causal, cache=cache)
        assert spec.pos_RC[row, cols].tolist() == list(range(len(cols)))
        torch.testing.assert_close(kv.keys[spec.layer][row][:, cols], cache.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.values[spec.layer][row][:, cols], cache.values[0], atol=1e-4, rtol=1e-4)


def test_a_first_observation_is_fed_after_the_prompt_without_loss(model, prompts):
    # Samples of one group share the prompt handed out but not their first observations: each row prefills
    # its own (no prefill shared by prompt alone), and the observation opens the completion, masked.
    prompt = prompts(1, seed=14)[0]
    firsts = [(30, 31, 32), (40,), ()]
    sp = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=2)
    reqs = [Request(5, i, prompt, sp, episode=True, observation_ids=f) for i, f in enumerate(firsts)]
    done, _ = _episodes(TorchBackend(model, max_batch_size=3, max_model_len=100), reqs, max_turns=2)
    for i, first in enumerate(firsts):
        fin = done[5, i]
        assert fin.prompt_ids == prompt and fin.completion_ids[:len(first)].tolist() == list(first)
        mask = _check_against_full_forward(model, fin)
        assert not mask[:len(first)].any() and mask[len(first)]
    with pytest.raises(ValueError, match="no room"):
        TorchBackend(model, max_batch_size=1, max_model_len=100).add(
            Request(0, 0, prompt, SamplingParams(max_new_tokens=3), episode=True, observation_ids=(1, 2, 3)))


@pytest.mark.parametrize("k", [0, 4])
def test_a_turn_cap_ends_the_turn_as_a_stop_would(model, prompts, spec_backend, k):
    # max_turn_tokens 3 without stop tokens: every turn is exactly 3 sampled tokens (speculative steps cut their
    # emission there too), parked as a turn; the episode's budget still ends it with "length".
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=6)
    reqs = [Request(i, 0, p, sp, episode=True, max_turn_tokens=3) for i, p in enumerate(prompts(2, seed=15))]
    backend = (TorchBackend(model, max_batch_size=2, max_model_len=100) if k == 0 else
               spec_backend(model, Drafter.for_policy(model, seed=2), k, kind="eagle", max_batch_size=2,
                            max_model_len=100))
    done, turns = _episodes(backend, reqs, max_turns=3)
    for key, fin in done.items():
        assert [len(t.completion_ids) for t in turns[key]] == [3, 3 + 3 + 3, 3 + 3 + 3 + 1 + 3]
        assert fin.finish_reason == "stop" and len(fin.completion_ids) == 13
        _check_against_full_forward(model, fin)
    sp = SamplingParams(temperature=1.0, max_new_tokens=60, seed=6)
    reqs = [Request(9, 0, prompts(1, seed=16)[0], sp, episode=True, max_turn_tokens=25)]
    done, turns = _episodes(TorchBackend(model, max_batch_size=1, max_model_len=100), reqs, max_turns=5)
    assert [len(t.completion_ids) for t in turns[9, 0]] == [25, 25 + 3 + 25] and done[9, 0].finish_reason == "length"
    assert len(done[9, 0].completion_ids) == 60  # the third turn cut by the budget: 25 + 3 + 25 + 1 + 6


def _pieces() -> list[str]:
    """A decoder's text per id: nothing for the 4 special ids, 1 to 3 letters for the others (a stop string
    can end inside a token)."""
    rng = random.Random(0)
    return [""] * 4 + ["".join(rng.choice("abcdefg") for _ in range(rng.randrange(1, 4))) for _ in range(60)]


PIECES = _pieces()
NUM = 6  # episodes in the stop-string tests


def _decode(ids) -> str:
    return "".join(PIECES[i] for i in ids)


def _first_stop(tokens: list[int], stop: str) -> int:
    """The brute force: the number of tokens up to the first whose text completes `stop`, else 0."""
    return next((n for n in range(1, len(tokens) + 1) if stop in _decode(tokens[:n])), 0)


class _RecordingStops(StopStrings):
    """Stop strings whose scans record each feed: (tokens offered, tokens up to the stop or 0)."""

    feeds: list

    def scan(self) -> StopScan:
        return _RecordingScan(self)


class _RecordingScan(StopScan):
    def feed(self, tokens):
        num = super().feed(tokens)
        self.stops.feeds.append((len(tokens), num))
        return num


def _turn_stops(model, prompts) -> tuple[list[list[int]], list[str], list[int]]:
    """Greedy first turns of 20 tokens (no stop), and per prompt a stop string made of the last letter of one
    token and the first of the next that first occurs there, as late as possible: its expected turn length."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=60)
    reqs = [Request(i, 0, p, sp, episode=True, max_turn_tokens=20) for i, p in enumerate(prompts(NUM, seed=17))]
    _, turns = _episodes(TorchBackend(model, max_batch_size=NUM, max_model_len=100), reqs, max_turns=1)
    firsts, stops, lengths = [], [], []
    for i in range(NUM):
        first = turns[i, 0][0].completion_ids.tolist()
        assert len(first) == 20
        candidates = [(j + 1, PIECES[first[j - 1]][-1] + PIECES[first[j]][0]) for j in range(1, 20)
                      if PIECES[first[j - 1]] and PIECES[first[j]]]
        num, stop = max((n, s) for n, s in candidates if _first_stop(first, s) == n < 20)
        firsts.append(first)
        stops.append(stop)
        lengths.append(num)
    return firsts, stops, lengths


def _stop_string_requests(prompts, stops, feeds, *, episode=True):
    sp = SamplingParams(temperature=0.0, max_new_tokens=60)
    out = []
    for i, (prompt, stop) in enumerate(zip(prompts(NUM, seed=17), stops, strict=True)):
        strings = _RecordingStops([stop], _decode)
        strings.feeds = feeds
        out.append(Request(i, 0, prompt, sp, episode=episode, max_turn_tokens=20 if episode else 0,
                           stop_strings=strings))
    return out


def test_a_stop_string_across_tokens_ends_the_turn_at_its_completing_token(model, prompts, spec_backend):
    firsts, stops, lengths = _turn_stops(model, prompts)
    feeds = []
    plain, turns = _episodes(TorchBackend(model, max_batch_size=NUM, max_model_len=100),
                             _stop_string_requests(prompts, stops, feeds))
    for i in range(NUM):
        assert turns[i, 0][0].completion_ids.tolist() == firsts[i][:lengths[i]]
        assert turns[i, 0][0].finish_reason == "turn"
        fin, start = plain[i, 0], 0
        with torch.no_grad():  # greedy over the kept cache: each sampled token is a fresh forward's argmax
            argmax = model(torch.tensor([fin.prompt_ids + fin.completion_ids.tolist()])).logits[0].argmax(-1)
        assert (argmax[len(fin.prompt_ids) - 1:-1] == fin.completion_ids)[fin.loss_mask].all()
        # Every turn ends at the first token whose text completes the string, or at the turn cap without it.
        ids, mask = fin.completion_ids.tolist(), fin.loss_mask.tolist()
        for turn in turns[i, 0]:
            sampled = [t for t, m in zip(ids[start:len(turn.completion_ids)], mask[start:], strict=False) if m]
            assert _first_stop(sampled, stops[i]) in (len(sampled), 0 if len(sampled) == 20 else -1)
            start = len(turn.completion_ids)
    assert all(num in (0, offered) for offered, num in feeds)  # a plain step offers one token
    # A single-turn sample ends there too ("stop"), its stop string's tokens kept.
    single, _ = _episodes(TorchBackend(model, max_batch_size=NUM, max_model_len=100),
                          _stop_string_requests(prompts, stops, [], episode=False))
    for i in range(NUM):
        assert single[i, 0].finish_reason == "stop" and single[i, 0].completion_ids.tolist() == firsts[i][:lengths[i]]
    # Speculative steps emit exactly the plain steps' tokens: drafts accepted past the stop string are cut.
    feeds.clear()
    for kind in ("suffix", "eagle"):
        backend = spec_backend(model, Drafter.for_policy(model, seed=2), 4, kind=kind, max_batch_size=NUM,
                               max_model_len=100)
        spec, _ = _episodes(backend, _stop_string_requests(prompts, stops, feeds))
        for key, fin in plain.items():
            assert spec[key].completion_ids.tolist() == fin.completion_ids.tolist(), (kind, key)
            assert spec[key].loss_mask.tolist() == fin.loss_mask.tolist()
    assert any(0 < num < offered for offered, num in feeds), "no speculative step was cut at a stop string"


@pytest.mark.parametrize("k", [0, 4])
def test_stop_strings_that_never_occur_change_nothing(model, prompts, spec_backend, k):
    # Sampled (seeded), with stop ids and a turn cap: a stop string no token can produce leaves every token.
    def run(stop_strings):
        sp = [SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=s) for s in range(3)]
        reqs = [Request(i, 0, p, sp[i], episode=True, max_turn_tokens=12, stop_strings=stop_strings)
                for i, p in enumerate(prompts(3, seed=18))]
        backend = (TorchBackend(model, max_batch_size=3, max_model_len=100) if k == 0 else
                   spec_backend(model, None, k, kind="suffix_only", max_batch_size=3, max_model_len=100))
        return _episodes(backend, reqs)[0]

    without, with_stops = run(None), run(StopStrings(["h", "€"], _decode))
    for key, fin in without.items():
        assert with_stops[key].completion_ids.tolist() == fin.completion_ids.tolist()
        assert with_stops[key].loss_mask.tolist() == fin.loss_mask.tolist()
        assert with_stops[key].finish_reason == fin.finish_reason
