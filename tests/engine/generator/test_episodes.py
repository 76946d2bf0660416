"""The generator's episode loop (engine/generator/episodes.py) on the torch backend and a tiny model, with
in-process environments: scripted, failing, slow. The loop is driven as the service drives it: apply() between
backend steps (run in a worker thread), on_finished() per Finished, waiting on notify() when only environments
are busy.
Run: pytest tests/engine/generator/test_episodes.py
"""

import asyncio
import time

import pytest
import torch

from tailrace.engine.config import EnvConfig
from tailrace.engine.core import models
from tailrace.engine.generator.environment import Environment, EnvironmentError, Observation
from tailrace.engine.generator.episodes import Episodes, EpisodeSettings
from tailrace.engine.generator.torch_backend.backend import TorchBackend
from tailrace.protocol.messages import SamplingParams, WorkItem

torch.set_num_threads(1)

# A template in the tiny tokenizer's alphabet: "<eos>" (a special token) ends every turn.
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
STOPS = list(range(10, 22))  # ids that end an assistant turn besides eos: turns of a few tokens


@pytest.fixture(scope="module")
def tokenizer():
    tok = models.load_tokenizer("tiny")
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("qwen2")


class Scripted:
    """Observations by turn; records every call. fail: {sample_id: (turn, exception)} raised at that step
    (turn 0 = reset); slow: {sample_id: seconds} slept at every step."""

    def __init__(self, first="go 1", steps=("ok 2", "ok 3 4", "ok 5"), done_at=None, rewards=True, fail=None,
                 slow=None, token_ids=None, slow_reset=0.0):
        self.first, self.steps, self.done_at, self.rewards = first, steps, done_at, rewards
        self.fail, self.slow, self.token_ids, self.slow_reset = fail or {}, slow or {}, token_ids, slow_reset
        self.resets, self.actions, self.closed = {}, {}, []

    async def reset(self, episode, task, prompt, metadata):
        self.resets[episode.sample_id] = (task, prompt, metadata)
        self.actions[episode.sample_id] = []
        await asyncio.sleep(self.slow_reset)
        self._maybe_fail(episode.sample_id, 0)
        return Observation(text=self.first, reward=0.5 if self.rewards else None)

    async def step(self, episode, action):
        turns = self.actions[episode.sample_id]
        turns.append(action)
        if episode.sample_id in self.slow:
            await asyncio.sleep(self.slow[episode.sample_id])
        self._maybe_fail(episode.sample_id, len(turns))
        done = self.done_at is not None and len(turns) >= self.done_at
        text = self.steps[(len(turns) - 1) % len(self.steps)]
        return Observation(text=text, done=done, reward=1.0 if self.rewards else None,
                           token_ids=self.token_ids)

    async def close(self, episode):
        self.closed.append(episode.sample_id)

    def _maybe_fail(self, sample_id, turn):
        at = self.fail.get(sample_id)
        if at is not None and at[0] == turn:
            raise at[1]


async def drive(backend, episodes, items, timeout_s=120.0):
    """The service's loop in small: returns {sample_id: Finished} of every episode, and their end times."""
    wake = asyncio.Event()
    episodes.notify = wake.set
    total = sum(item.num_samples for item in items)
    for item in items:
        episodes.admit(item)
    out, ended_s = {}, {}
    deadline = time.monotonic() + timeout_s

    def take(fin):
        out[fin.sample_id] = fin
        ended_s[fin.sample_id] = time.monotonic()

    while len(out) < total:
        assert time.monotonic() < deadline, f"episodes not done: {sorted(out)}"
        for fin in episodes.apply(backend):
            take(fin)
        if backend.num_running or backend.num_waiting:
            for fin in await asyncio.to_thread(backend.step):
                done = episodes.on_finished(fin)
                if done is not None:
                    take(done)
        elif len(out) < total:
            wake.clear()
            if not episodes.ops:
                await asyncio.wait_for(wake.wait(), timeout_s)
    await episodes.aclose()
    return out, ended_s


def _item(prompt_ids, num, sp, group=0):
    return WorkItem(group_id=group, prompt_token_ids=prompt_ids, num_samples=num, first_sample_id=0, sampling=sp,
                    task="count")


def _run(model, tokenizer, env, *, num=4, max_turns=3, max_episode_tokens=0, timeout_s=5.0, max_new_tokens=90,
         max_batch_size=3, temperature=1.0, stops=STOPS, wait_for_server_s=0.0, stop_strings=()):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "count"}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=5)
    backend = TorchBackend(model, max_batch_size=max_batch_size, max_model_len=128,
                           eos_token_ids=[tokenizer.eos_token_id])
    episodes = Episodes(env, tokenizer, EpisodeSettings(max_turns, max_episode_tokens, timeout_s, wait_for_server_s,
                                                        stop_strings=stop_strings))
    out, ended_s = asyncio.run(drive(backend, episodes, [_item(prompt_ids, num, sp)]))
    assert backend.num_parked == backend.num_running == backend.num_waiting == 0 and not episodes.live
    return out, ended_s, prompt_ids


def _turns(fin):
    """The completion split at its observation runs: [(assistant ids, observation ids), ...]."""
    ids, mask = fin.completion_ids.tolist(), fin.loss_mask.tolist()
    turns, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j]:
            j += 1
        k = j
        while k < len(ids) and not mask[k]:
            k += 1
        turns.append((ids[i:j], ids[j:k]))
        i = k
    return turns


def test_fed_tokens_equal_the_chat_template_of_the_whole_conversation(model, tokenizer):
    env = Scripted()
    # Fewer stop ids: some turns end on "<eos>", the template's own end of turn (not part of the content).
    out, _, prompt_ids = _run(model, tokenizer, env, num=6, stops=STOPS[:4])
    assert isinstance(env, Environment)
    eos_turns = [a for f in out.values() for a, o in _turns(f)[1:] if o and a[-1] == tokenizer.eos_token_id]
    assert eos_turns and len(eos_turns) < sum(len(_turns(f)) - 2 for f in out.values())
    for sample_id, fin in out.items():
        (nothing, first), *turns = _turns(fin)  # the first observation comes before any assistant token
        actions = env.actions[sample_id]
        assert nothing == [] and first == tokenizer.encode("<eos>u:go 1<eos>a:", add_special_tokens=False)
        assert fin.num_turns == len(turns) and fin.finish_reason == "length"  # max_turns, or the budget mid-turn
        assert len(actions) in (len(turns), len(turns) - 1)  # the budget: before or after the last step
        # The conversation: the prompt's turn, reset's observation after an empty assistant turn (the prompt
        # handed out ends with its generation prompt), then assistant / environment turns.
        conversation = [{"role": "user", "content": "count"}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": "go 1"}]
        for t, (assistant, _) in enumerate(turns[:-1]):
            content = assistant[:-1] if assistant[-1] == tokenizer.eos_token_id else assistant
            conversation += [{"role": "assistant", "content": tokenizer.decode(content)},
                             {"role": "user", "content": env.steps[t]}]
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        fed = fin.prompt_ids + fin.completion_ids.tolist()
        assert fed == tokenizer.encode(rendered, add_special_tokens=False) + turns[-1][0]
        assert fin.prompt_ids == prompt_ids  # the prompt handed out: the trainer checks it
        # The environment saw each turn's text; observations are exactly the unmasked tokens.
        assert actions == [tokenizer.decode(a, skip_special_tokens=True) for a, _ in turns][:len(actions)]
        assert env.resets[sample_id] == ("count", tokenizer.decode(prompt_ids, skip_special_tokens=True), {})
        assert fin.env_reward == 0.5 + len(actions) * 1.0
        # The kept cache: sampled tokens' log-probs equal a fresh forward over the whole conversation.
        with torch.no_grad():
            logits = model(torch.tensor([fed])).logits[0, len(fin.prompt_ids) - 1:-1].double()
        ref = logits.log_softmax(-1).gather(-1, fin.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(fin.behaviour_logprobs.double()[fin.loss_mask], ref[fin.loss_mask],
                                   atol=1e-5, rtol=1e-5)
        assert (fin.behaviour_logprobs[~fin.loss_mask] == 0).all()
    assert sorted(env.closed) == sorted(out)
    assert sum(len(env.actions[i]) == 3 for i in out) >= 3


def test_done_max_turns_and_token_budget(model, tokenizer):
    env = Scripted(done_at=2)
    out, _, _ = _run(model, tokenizer, env, max_turns=5)
    assert {f.finish_reason for f in out.values()} == {"stop"} and {f.num_turns for f in out.values()} == {2}
    env = Scripted(steps=("more",))
    out, _, _ = _run(model, tokenizer, env, max_turns=50, max_episode_tokens=40, max_new_tokens=256)
    for sample_id, fin in out.items():
        assert fin.finish_reason == "length" and len(fin.completion_ids) <= 40
        # Cut mid-turn (the environment saw one turn less) or after a turn whose observation would not fit.
        assert fin.num_turns - len(env.actions[sample_id]) in (0, 1)
    assert max(f.num_turns for f in out.values()) > 2
    assert sorted(env.closed) == sorted(out)


def test_observation_token_ids_are_fed_verbatim(model, tokenizer):
    env = Scripted(first="", token_ids=[30, 31, 32])
    out, _, prompt_ids = _run(model, tokenizer, env, num=2)
    for fin in out.values():
        assert fin.prompt_ids == prompt_ids
        for _, obs in _turns(fin)[:-1]:
            assert obs == [30, 31, 32]


def test_an_environment_error_ends_that_sample_while_others_decode(model, tokenizer):
    fail = {1: (2, EnvironmentError("env_dead", "connection lost")), 2: (1, RuntimeError("bug")),
            3: (0, EnvironmentError("env_dead", "gone at reset"))}
    env = Scripted(fail=fail)
    out, _, prompt_ids = _run(model, tokenizer, env, num=5)
    assert out[1].finish_reason == "env_dead" and out[1].num_turns == 2
    assert out[2].finish_reason == "env_error" and out[2].num_turns == 1
    assert out[3].finish_reason == "env_dead" and len(out[3].completion_ids) == 0 and out[3].num_turns == 0
    for sample_id in (0, 4):
        assert out[sample_id].finish_reason == "length" and out[sample_id].num_turns == 3
    assert sorted(env.closed) == [0, 1, 2, 3, 4]


def test_a_slow_environment_times_out_without_holding_up_the_others(model, tokenizer):
    env = Scripted(slow={0: 60.0})
    start_s = time.monotonic()
    out, ended_s, _ = _run(model, tokenizer, env, num=4, timeout_s=3.0)
    assert out[0].finish_reason == "env_timeout" and out[0].num_turns == 1
    assert time.monotonic() - start_s < 30.0
    for sample_id in (1, 2, 3):
        assert out[sample_id].num_turns == 3 and ended_s[sample_id] < ended_s[0]
    # A reset may also wait env.wait_for_server_s (for a server to attach); a step may not.
    env = Scripted(slow_reset=1.5, slow={1: 1.5})
    out, _, _ = _run(model, tokenizer, env, num=2, timeout_s=0.5, wait_for_server_s=3.0)
    assert out[0].num_turns == 3 and out[1].finish_reason == "env_timeout" and out[1].num_turns == 1


def test_cancel_while_the_environment_answers(model, tokenizer):
    env = Scripted(slow={0: 60.0, 1: 60.0})

    async def scenario():
        prompt_ids = tokenizer.encode("u:count<eos>a:", add_special_tokens=False)
        sp = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=STOPS, seed=5)
        backend = TorchBackend(model, max_batch_size=2, max_model_len=128)
        episodes = Episodes(env, tokenizer, EpisodeSettings(3, 0, 30.0))
        episodes.admit(_item(prompt_ids, 2, sp, group=7))
        for _ in range(200):
            episodes.apply(backend)
            for fin in backend.step():
                assert episodes.on_finished(fin) is None  # turns only: the environment is slow
            await asyncio.sleep(0)
            if backend.num_parked == 2:
                break
        assert backend.num_parked == 2 and episodes.num_waiting_env == 2
        episodes.cancel([7])
        cancelled = backend.cancel([7])
        assert {f.finish_reason for f in cancelled} == {"cancelled"} and len(cancelled) == 2
        await episodes.aclose()
        assert not episodes.live and backend.num_parked == 0 and sorted(env.closed) == [0, 1]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_service_runs_episodes_between_its_steps(model, tokenizer, tmp_path):
    # GeneratorService's own main loop, its connection replaced by one that records what it sends: turns stay
    # inside, each sample leaves once, an environment's discard reason goes out as it is (as "error" where the
    # protocol cannot carry it yet), and the loop idles (never busy-waits, never hangs) while only environments are busy.
    import types

    from tailrace.engine.config import load_config
    from tailrace.engine.generator.service import GeneratorService
    from tailrace.protocol import messages as m

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    cfg = load_config(None, ["--data.chat_template", str(template), "--env.max_turns", "3",
                             "--env.timeout_s", "5", "--generator.speculation", "false"])
    env = Scripted(slow={1: 0.3}, fail={2: (1, EnvironmentError("env_dead", "killed"))})
    service = GeneratorService(cfg, "tcp://127.0.0.1:1", environment=env, make_backend=lambda c: TorchBackend(
        model, max_batch_size=2, max_model_len=128, eos_token_ids=[tokenizer.eos_token_id]))
    sent = []

    class Client:
        async def send(self, msg):
            sent.append(msg)
            if sum(isinstance(x, m.Rollout) for x in sent) == 4:
                service.state.shutdown = "done"
                service.wakeup.set()

    prompt_ids = tokenizer.encode("u:count<eos>a:", add_special_tokens=False)
    sp = SamplingParams(temperature=1.0, max_new_tokens=90, stop_token_ids=STOPS, seed=5)
    fields = {f: getattr(_item(prompt_ids, 4, sp, group=3), f) for f in m.WorkItem.__struct_fields__}
    item = types.SimpleNamespace(**{**fields, "max_turns": 3})  # WorkItem.max_turns: the protocol's, #33

    async def scenario():
        service.client = Client()
        service.state.exhausted = True  # no WorkRequests: the one item below is the work
        service.state.pending_items.append(item)
        forever = asyncio.get_running_loop().create_future()
        await service.main_loop(forever, forever)
        await service.episodes.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 120))
    rollouts = {r.sample_id: r for r in sent if isinstance(r, m.Rollout)}
    assert sorted(rollouts) == [0, 1, 2, 3] and len(sent) == 4 + sum(isinstance(x, m.Stats) for x in sent)
    assert rollouts[2].finish_reason == ("env_dead" if "env_dead" in m.FINISH_REASONS else "error")
    for sample_id in (0, 1, 3):
        r = rollouts[sample_id]
        assert r.finish_reason == "length" and len(env.actions[sample_id]) >= 2
    assert not service.held and not service.episodes.live and sorted(env.closed) == [0, 1, 2, 3]


def test_a_bug_in_the_episode_task_ends_the_sample_not_the_run(model, tokenizer, monkeypatch):
    # An observation the tokenizer cannot encode past ValueError (a bug, not an environment's fault): the
    # sample ends with "error" instead of staying parked forever.
    from tailrace.engine.generator import episodes as episodes_module

    def broken(self, turn_ids, obs):
        raise KeyError("bug")

    monkeypatch.setattr(episodes_module.ChatRenderer, "observation_ids", broken)
    out, _, _ = _run(model, tokenizer, Scripted(), num=2)
    assert {f.finish_reason for f in out.values()} == {"error"} and {f.num_turns for f in out.values()} == {1}


def test_without_a_chat_template_observation_text_is_appended_as_it_is(model):
    # Plain-text prompts (the shipped tiny model has no chat template): "rev:abc=" -> turn -> "rev:de=" -> ...
    tok = models.load_tokenizer("tiny")
    assert not getattr(tok, "chat_template", None)
    env = Scripted(first="", steps=("rev:de=",))
    prompt_ids = tok.encode("rev:abc=", add_special_tokens=False)
    sp = SamplingParams(temperature=1.0, max_new_tokens=90, stop_token_ids=STOPS, seed=5)
    backend = TorchBackend(model, max_batch_size=2, max_model_len=128, eos_token_ids=[tok.eos_token_id])
    episodes = Episodes(env, tok, EpisodeSettings(3, 0, 5.0))
    out, _ = asyncio.run(drive(backend, episodes, [_item(prompt_ids, 2, sp)]))
    for fin in out.values():
        assert fin.prompt_ids == prompt_ids and fin.finish_reason == "length" and fin.num_turns == len(_turns(fin)) > 1
        for _, obs in _turns(fin)[:-1]:
            assert obs == tok.encode("rev:de=", add_special_tokens=False)


def test_with_an_episode_budget_max_new_tokens_caps_each_turn(model, tokenizer):
    # env.max_episode_tokens 60 for the episode, sampling.max_new_tokens 4 for each assistant turn.
    env = Scripted(steps=("no",))
    out, _, _ = _run(model, tokenizer, env, num=3, max_turns=4, max_episode_tokens=60, max_new_tokens=4, stops=[])
    for sample_id, fin in out.items():
        turns = _turns(fin)[1:]  # after the first observation
        assert len(turns) == fin.num_turns == 4 and len(env.actions[sample_id]) == 4
        assert all(len(a) <= 4 for a, _ in turns) and any(len(a) == 4 for a, _ in turns)


def test_env_stop_strings_end_assistant_turns(model, tokenizer):
    # env.stop_strings reach the backend through EpisodeSettings: without stop ids, a turn ends at the first
    # token whose text (as env.step receives it) completes one, at "<eos>" (the template's end of turn) or at the
    # per-turn cap; the completing token is kept, and the environment sees it in the turn's text.
    stops = EpisodeSettings.from_config(EnvConfig(max_turns=4, stop_strings=["e", "o", "ab"])).stop_strings
    assert stops == ("e", "o", "ab")
    env = Scripted(steps=("ok",))
    out, _, _ = _run(model, tokenizer, env, num=4, max_turns=4, max_episode_tokens=80, max_new_tokens=12, stops=[],
                     stop_strings=stops)
    num_by_string = 0
    for sample_id, fin in out.items():
        for t, (assistant, _) in enumerate(_turns(fin)[1:fin.num_turns]):  # the turns the environment answered
            text = tokenizer.decode(assistant, skip_special_tokens=True)
            assert env.actions[sample_id][t] == text
            first = next((n for n in range(1, len(assistant) + 1)
                          if any(s in tokenizer.decode(assistant[:n], skip_special_tokens=True) for s in stops)), 0)
            if first:  # a stop string: the turn ends at its completing token
                assert first == len(assistant)
                num_by_string += 1
            else:
                assert assistant[-1] == tokenizer.eos_token_id or len(assistant) == 12
    assert num_by_string >= 4
