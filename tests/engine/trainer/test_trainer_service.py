"""The trainer service in-process against a fake generator speaking the protocol over tcp loopback:
bad rollouts are counted as discards with their reason and the run continues; a generator with the
wrong vocabulary is rejected with a clear reason; accounting holds at the end; steps whose groups all got
one reward are said (log, Event "no_signal") and their completions written to samples.jsonl."""

import asyncio

import pytest
import torch

from tailrace.engine.config import load_config
from tailrace.engine.trainer.service import TrainerService
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Client, Rejected


def make_service(tmp_path, *overrides):
    cfg = load_config(None, ["--train.steps", "1", "--train.groups_per_step", "1", "--sampling.group_size", "4",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "svc",
                             "--trainer.heartbeat_interval_s", "0.2", *overrides])
    return TrainerService(cfg)


def rollout(item, sample_id, completion, *, version=0, logprob=-0.5):
    ids = torch.tensor(completion, dtype=torch.int32)
    return m.Rollout(group_id=item.group_id, sample_id=sample_id,
                     prompt_token_ids=torch.tensor(item.prompt_token_ids, dtype=torch.int32),
                     completion_token_ids=ids, behaviour_logprobs=torch.full((len(completion),), logprob),
                     policy_versions=torch.full((len(completion),), version, dtype=torch.int32),
                     min_policy_version=version, max_policy_version=version, finish_reason="stop")


async def wait_bound(service):
    while service.server is None or not service.server.address.rpartition(":")[2].isdigit():
        await asyncio.sleep(0.02)
    return service.server.address


@pytest.mark.timeout(120)
async def test_bad_rollouts_are_discarded_and_run_continues(tmp_path):
    service = make_service(tmp_path)
    vocab, eos = service.vocab_size, service.tokenizer.eos_token_id
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    async with Client(address, role="generator", name="fake", max_inflight=8,
                      capabilities={"vocab_size": vocab}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        await gen.send(m.WorkRequest(capacity=4, policy_version=0))
        work = await asyncio.wait_for(gen.recv(), 10)
        assert isinstance(work, m.Work) and len(work.items) == 1
        item = work.items[0]
        assert item.num_samples == 4 and item.sampling.stop_token_ids == [eos]
        good = [service.tokenizer.convert_tokens_to_ids(c) for c in "abc"] + [eos]
        await gen.send(rollout(item, 0, good))
        await gen.send(rollout(item, 1, []))                 # empty completion
        await gen.send(rollout(item, 2, [vocab + 5, eos]))    # token outside the vocabulary
        await gen.send(rollout(item, 2, good))                # duplicate of a discarded sample: dropped
        await gen.send(rollout(item, 3, good[:2] + [eos]))
        summary = await asyncio.wait_for(run, 60)
    assert summary["steps"] == 1 and summary["samples_trained"] == 2
    assert summary["discarded"]["empty_completion"] == 1 and summary["discarded"]["bad_rollout"] == 1
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert service.counters["rollouts_dropped/duplicate"] == 1


@pytest.mark.timeout(120)
async def test_generator_with_wrong_vocabulary_is_rejected(tmp_path):
    service = make_service(tmp_path)
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    try:
        client = Client(address, role="generator", name="wrong", capabilities={"vocab_size": service.vocab_size + 1})
        with pytest.raises(Rejected, match="vocab_size"):
            await asyncio.wait_for(client.connect(), 10)
        await client.close()
    finally:
        service.request_stop("test over")
        await asyncio.wait_for(run, 60)


async def take_work(gen, capacity, version=0):
    await gen.send(m.WorkRequest(capacity=capacity, policy_version=version))
    while True:
        msg = await asyncio.wait_for(gen.recv(), 20)
        if isinstance(msg, m.Work):
            return msg


@pytest.mark.timeout(120)
async def test_a_silent_generator_loses_its_samples_when_the_lease_runs_out(tmp_path):
    """A peer says Hello as a generator, takes 4 samples, keeps heartbeating and never returns them: after
    controller.lease_s they go to another generator, the watchdog says what the trainer waits for, the
    run finishes, and the silent one's late result is dropped as lease_expired."""
    service = make_service(tmp_path, "--controller.lease_s", "1.5", "--controller.stall_warn_s", "0.5")
    vocab, eos = service.vocab_size, service.tokenizer.eos_token_id
    good = [service.tokenizer.convert_tokens_to_ids(c) for c in "ab"] + [eos]
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    caps = {"vocab_size": vocab}
    async with Client(address, role="generator", name="silent", capabilities=caps) as silent, \
            Client(address, role="tool", name="watcher") as watcher:
        await asyncio.wait_for(silent.connect(), 10)
        await asyncio.wait_for(watcher.connect(), 10)
        await watcher.subscribe()
        held = (await take_work(silent, 4)).items[0]
        stall = None
        while stall is None:  # said within a few seconds, naming the holder and its lease
            msg = await asyncio.wait_for(watcher.recv_notice(), 10)
            if isinstance(msg, m.Event) and msg.event == "stall":
                stall = msg.text
        assert "silent holds 4" in stall and "lease" in stall, stall
        async with Client(address, role="generator", name="honest", capabilities=caps) as honest:
            await asyncio.wait_for(honest.connect(), 10)
            work = await asyncio.wait_for(take_work(honest, 4), 10)  # parked until the lease ran out
            item = work.items[0]
            assert (item.group_id, item.first_sample_id, item.num_samples) == (held.group_id, 0, 4)
            await silent.send(rollout(held, 0, good))  # too late: dropped
            for sid in range(4):
                await honest.send(rollout(item, sid, good))
            summary = await asyncio.wait_for(run, 60)
    assert summary["steps"] == 1 and summary["samples_trained"] == 4
    assert {k: n for k, n in summary["discarded"].items() if n} == {"lease_expired": 4}
    assert summary["samples_handed_out"] == 8
    assert service.counters["rollouts_dropped/lease_expired"] == 1


@pytest.mark.timeout(120)
async def test_a_rollout_sampled_with_a_too_old_policy_is_discarded(tmp_path):
    service = make_service(tmp_path, "--train.steps", "2", "--controller.max_staleness", "0")
    vocab, eos = service.vocab_size, service.tokenizer.eos_token_id
    good = [service.tokenizer.convert_tokens_to_ids(c) for c in "ab"] + [eos]
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    async with Client(address, role="generator", name="gen", capabilities={"vocab_size": vocab}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        item = (await take_work(gen, 4)).items[0]
        for sid in range(4):
            await gen.send(rollout(item, sid, good))
        item = (await take_work(gen, 4, version=1)).items[0]  # admitted once version 1 exists
        assert item.min_policy_version == 1
        await gen.send(rollout(item, 0, good, version=0))  # claims the old policy sampled it
        for sid in range(1, 4):
            await gen.send(rollout(item, sid, good, version=1))
        summary = await asyncio.wait_for(run, 60)
    assert summary["steps"] == 2 and summary["samples_trained"] == 7
    assert {k: n for k, n in summary["discarded"].items() if n} == {"bad_rollout": 1}
    assert summary["max_staleness_seen"] == 0


@pytest.mark.timeout(60)
async def test_an_error_from_a_reward_server_is_counted_and_logged_and_its_session_goes_on(tmp_path, caplog):
    service = make_service(tmp_path, "--train.steps", "1000")
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    try:
        async with Client(address, role="reward", name="grader", tasks=["math"]) as grader:
            await asyncio.wait_for(grader.connect(), 10)
            for _ in range(3):
                await grader.send(m.Error(code=m.ErrorCode.BAD_FIELD, text="ScoreRequest.task: too long",
                                          ref_kind=m.ScoreRequest.KIND))
            while service.counters["trainer/peer_errors/401"] < 3:
                await asyncio.sleep(0.02)
            assert [p.name for p in service.server.peers.values()] == ["grader"]
            # the 1st and 2nd are said, the 3rd only counted
            assert caplog.text.count("reward grader answered Error 401 to a message of kind 30") == 2
    finally:
        service.request_stop("test over")
        await asyncio.wait_for(run, 60)


@pytest.mark.timeout(120)
async def test_the_next_steps_early_backward_overlaps_the_weights_copy_and_each_version_is_what_its_step_made(
        tmp_path):
    """On one rank the publication of version V (the weights' copy, then the notices) overlaps the next
    step's early forward/backward, but the next optimizer step waits for it: every published version holds
    the weights its own step made. The overlap is a rendezvous, not a timing window: version 1's copy and
    group 2's early call each wait (bounded) for the other to have started, so a publication serialised
    behind the early call, or awaited before it, waits out the deadline and fails; a loaded machine only
    delays both. A slow copy (sleeping before it reads) makes a missing wait before the next step show."""
    import threading
    import time

    service = make_service(tmp_path, "--train.steps", "2", "--train.groups_per_step", "2",
                           "--sampling.group_size", "2")
    learner, eos = service.learner, service.tokenizer.eos_token_id
    after_step, published, calls = {}, {}, []
    copy_started, call_started = threading.Event(), threading.Event()
    met = {}  # who saw the other one started, within the deadline
    real_gather, real_step, real_accumulate = learner.state_dict_for_broadcast, learner.step, learner.accumulate

    def slow_gather():
        if learner.policy_version == 1:  # version 1's copy: the one beside group 2's early call
            copy_started.set()
            met["copy saw the call"] = call_started.wait(20)
        time.sleep(0.5)
        return real_gather()

    def step(batch):
        out = real_step(batch)
        after_step[learner.policy_version] = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        return out

    def accumulate(groups):
        call_started.set()
        met["call saw the copy"] = copy_started.wait(20)
        calls.append(len(groups))
        return real_accumulate(groups)

    def publish(model, version, state, _publish=service.store.publish):
        published[version] = state
        return _publish(model, version, state)

    learner.state_dict_for_broadcast, learner.step, learner.accumulate = slow_gather, step, accumulate
    service.store.publish = publish
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    texts = ["abc", "x"]  # two rewards per group: the advantages, so the steps, are not zero
    async with Client(address, role="generator", name="gen", capabilities={"vocab_size": service.vocab_size}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        items = []
        while sum(i.num_samples for i in items) < 8:
            items += (await take_work(gen, 8 - sum(i.num_samples for i in items))).items
        items.sort(key=lambda i: i.group_id)
        assert [i.group_id for i in items] == [0, 1, 2, 3]
        for item in items[:3]:  # the last group stays out: step 2 waits for it, and runs group 2 early
            for sid in range(2):
                await gen.send(rollout(item, sid, [service.tokenizer.convert_tokens_to_ids(c) for c in texts[sid]] + [eos]))
        while not calls:
            await asyncio.sleep(0.02)
        for sid in range(2):
            await gen.send(rollout(items[3], sid, [service.tokenizer.convert_tokens_to_ids(c) for c in texts[sid]] + [eos]))
        summary = await asyncio.wait_for(run, 60)
    assert summary["steps"] == 2 and summary["samples_trained"] == 8
    assert sorted(published) == [0, 1, 2]
    assert calls == [1]  # group 2's, while step 2 waited for group 3
    assert met == {"copy saw the call": True, "call saw the copy": True}, met
    for version in (1, 2):
        assert set(published[version]) == set(after_step[version])
        for name, value in after_step[version].items():
            torch.testing.assert_close(published[version][name], value, rtol=0, atol=0, msg=f"v{version} {name}")
    assert any(not torch.equal(after_step[1][k], after_step[2][k]) for k in after_step[1])  # the steps changed them


@pytest.mark.timeout(120)
async def test_steps_whose_groups_all_got_one_reward_are_said_and_their_completions_written(tmp_path, caplog):
    """Every sample of each group writes the same text, so each group has one reward and GRPO no signal: after
    metrics.no_signal_warn_steps such steps the trainer says so on its log and as Event "no_signal" on the
    notice socket (what `tailrace run` prints under its progress); samples.jsonl holds the completions."""
    import json

    service = make_service(tmp_path, "--train.steps", "2", "--train.groups_per_step", "2", "--sampling.group_size",
                           "2", "--metrics.no_signal_warn_steps", "2", "--trainer.stats_interval_s", "0.2")
    eos = service.tokenizer.eos_token_id
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    notices = []

    async def listen(tool):
        while True:
            notices.append(await tool.recv_notice())

    async with Client(address, role="tool", name="watch") as tool, \
            Client(address, role="generator", name="gen", capabilities={"vocab_size": service.vocab_size}) as gen:
        await asyncio.wait_for(tool.connect(), 10)
        await tool.subscribe()
        listening = asyncio.create_task(listen(tool))
        await asyncio.wait_for(gen.connect(), 10)
        items = []
        while sum(i.num_samples for i in items) < 8:
            items += (await take_work(gen, 8 - sum(i.num_samples for i in items))).items
        for item in items:
            for sid in range(2):
                await gen.send(rollout(item, sid, [service.tokenizer.convert_tokens_to_ids("z"), eos]))
        summary = await asyncio.wait_for(run, 60)
        await asyncio.sleep(0.3)
        listening.cancel()
    said = [n for n in notices if isinstance(n, m.Event) and n.event == "no_signal"]
    assert len(said) == 1 and said[0].text.startswith("no learning signal: in each of the last 2 steps")
    assert said[0].fields["steps"] == 2 and said[0].text in caplog.text
    assert summary["steps_without_signal"] == 2
    lines = [json.loads(line) for line in (service.run_dir / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert all(line["completion"] == "z" and len(set(line["group_rewards"])) == 1 for line in lines)


@pytest.mark.timeout(60)
async def test_an_error_inside_a_loop_stops_the_run_with_its_message_and_the_peers_hear_it(tmp_path):
    """Issue 31: a row that fails when admitted (in the net loop, answering a WorkRequest) killed that loop
    silently and the run waited forever; it stops the run, run() raises it, generators get it as the reason."""
    import json

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "no prompt field here"}) + "\n")
    service = make_service(tmp_path, "--data.source", str(data), "--train.steps", "5")
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    async with Client(address, role="generator", name="gen", capabilities={"vocab_size": service.vocab_size}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        await gen.send(m.WorkRequest(capacity=4, policy_version=0))
        with pytest.raises(ValueError, match="data: row 0 has no string field 'prompt'"):
            await asyncio.wait_for(run, 20)
        shutdown = await asyncio.wait_for(gen.recv(), 10)
    assert isinstance(shutdown, m.Shutdown) and "row 0" in shutdown.reason
    summary = json.loads((service.run_dir / "summary.json").read_text())
    assert "row 0" in summary["stop_reason"] and summary["samples_handed_out"] == 0
