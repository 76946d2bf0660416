"""The watchdog's diagnosis: the most specific thing that blocks training, named in one line.
The loop itself (leases reclaimed, Event "stall" published) is tested through the trainer service in
tests/engine/trainer/test_trainer_service.py. Run: pytest tests/engine/trainer/test_watchdog.py
"""

import dataclasses

from tailrace.engine.trainer.watchdog import Situation, diagnose

BASE = Situation(waiting_s=12.0, reward_waiting={}, wait_for_server_s=60.0, generators=["gen-0", "gen-1"],
                 expected_generators=0, parked=0, held={}, next_lease=None, groups_in_flight=3, groups_complete=1,
                 groups_per_step=8, scoring=0)


def say(**changes):
    return diagnose(dataclasses.replace(BASE, **changes))


def test_a_missing_reward_server_is_named_with_its_task_and_what_happens_next():
    text = say(reward_waiting={"math": 5, "copy": 0}, held={"gen-0": 3})
    assert text.startswith("no progress for 12 s: no reward server attached for task 'math' (5 completions)")
    assert "no_reward_server after reward.wait_for_server_s = 60 s" in text and "copy" not in text


def test_no_generator_then_held_samples_with_their_lease():
    assert "no generator connected" in say(generators=[])
    text = say(held={"gen-1": 2, "gen-0": 4}, next_lease=(7.4, "gen-0"))
    assert "gen-0 holds 4, gen-1 holds 2" in text and "the first lease (gen-0) ends in 7 s" in text
    assert "ends in 0 s" in say(held={"gen-0": 1}, next_lease=(-3.0, "gen-0"))  # never a negative time


def test_generators_being_started_are_waited_for_not_asked_for():
    """`tailrace run` tells the trainer how many generators it starts: while they load, the trainer says
    it waits for them instead of asking the user to start one."""
    text = say(generators=[], expected_generators=2)
    assert text == ("no progress for 12 s: waiting for 2 generators to connect (none yet; each loads the model "
                    "first, and its log says how far it got)")
    assert "start one" not in text and "waiting for 1 generator to" in say(generators=[], expected_generators=1)
    assert "gen-0 holds 1" in say(held={"gen-0": 1}, expected_generators=2)  # once one is there: the usual


def test_scoring_parked_and_the_plain_count():
    assert "4 completions being scored" in say(scoring=4)
    assert "every generator is parked (3 groups in flight, 1/8 complete" in say(parked=2)
    assert say().endswith("3 groups in flight, 1/8 complete for the step")


def test_multi_turn_episodes_without_an_environment_server_are_named():
    """env.max_turns > 1 and no environment server attached: said before the samples the generators
    hold (they wait on it), with what happens to them and how to attach one; single-turn runs never."""
    text = say(episodes=True, env_wait_for_server_s=60.0, held={"gen-0": 8})
    assert text == ("no progress for 12 s: no environment server attached; multi-turn episodes (env.max_turns > 1) "
                    "end as no_env_server after env.wait_for_server_s = 60 s (attach one: tailrace env "
                    "module:Class --connect ADDR)")
    assert "gen-0 holds 8" in say(episodes=True, env_servers=1, held={"gen-0": 8})
    assert "environment" not in say(held={"gen-0": 8})
    assert "no generator connected" in say(episodes=True, generators=[])
