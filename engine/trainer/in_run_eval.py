"""The trainer's evaluation during a run (docs/algorithms.md, "Evaluation"): every eval.every_steps steps, after the new
weights are published, the held-out prompts go to the generators as work flagged eval, are scored by the
reward path training uses (attached reward servers, built-in functions), and their figures join the
step's line in metrics.jsonl as eval/... keys.

    train loop (step S, version V published) --run()--> eval WorkItems (eval=True, min_policy_version V)
    generators --WorkRequest--> take(): eval work before training work, so the train loop waits little
    generators --Rollout(eval=True)--> on_rollout(): checked as training rollouts are, scored, recorded
    all samples rewarded or failed --> run() returns eval/... metrics, says one line (log, Event "eval")

The train loop waits for its evaluation (at most eval.timeout_s), so no newer policy exists meanwhile:
every eval sample is sampled by version V exactly. Eval samples never reach the controller: they have
their own group ids (from EVAL_GROUP_ID_BASE) and their own counts (eval/samples_*), so the training
accounting, handed out == trained + discarded, is untouched. Test: pytest tests/engine/eval/test_eval.py
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.eval.suite import EvalResults, PromptOutcome, eval_prompts, eval_requests
from tailrace.engine.trainer.controller import GroupState
from tailrace.engine.trainer.intake import max_completion_tokens, rollout_problem
from tailrace.engine.trainer.scoring import ScoringFailed
from tailrace.protocol import messages as m

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tailrace.engine.trainer.learner import Learner
    from tailrace.engine.trainer.scoring import RewardDispatcher
    from tailrace.protocol.transport import Server

log = logging.getLogger("tailrace.trainer")

EVAL_GROUP_ID_BASE = 1 << 48  # eval group ids start here: never a training group's (the controller counts from 0)


class EvalService(Protocol):
    """What the evaluation uses of the trainer service (TrainerService satisfies it:
    tests/engine/trainer/test_collaborators.py)."""

    learner: Learner
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    server: Server
    rewards: RewardDispatcher | None  # None until the service serves
    stop_requested: bool

    async def serve_parked(self) -> None: ...

    def spawn_scoring(self, coro: Any) -> None: ...  # a scoring task whose error stops the run

    def event(self, name: str, text: str, **fields: Any) -> m.Event: ...


@dataclass
class EvalGroup:
    state: GroupState  # for the checks training rollouts pass (prompt, vocabulary, versions)
    kind: str  # evals.GREEDY or evals.SAMPLED
    sampling: m.SamplingParams
    assigned: dict[int, str] = field(default_factory=dict)  # sample id -> generator holding it
    returned: set[int] = field(default_factory=set)  # sample ids whose result came back
    recorded: int = 0  # of those, rewarded or failed


class Evaluator:
    def __init__(self, cfg: Any, tokenizer: Any, max_prompt_tokens: int, counters: collections.Counter):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.counters = counters  # the trainer's: eval/... counts travel in its Stats
        self.prompts: list[PromptRecord] = eval_prompts(cfg, tokenizer, max_prompt_tokens) \
            if cfg.eval.every_steps else []
        self.held_out = frozenset(p.text for p in self.prompts)  # the trainer's data source skips these
        self.queue: collections.deque[m.WorkItem] = collections.deque()
        self.groups: dict[int, EvalGroup] = {}
        self.next_group_id = EVAL_GROUP_ID_BASE
        self.results: EvalResults | None = None
        self.outstanding = 0  # samples of the running evaluation without a reward or a failure yet
        self.changed = asyncio.Event()
        self.last: dict[str, float] = {}

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return bool(every) and step % every == 0

    def has_work(self) -> bool:
        return bool(self.queue)

    # ------------------------------------------------------------------------------------ the evaluation

    async def run(self, svc: EvalService, step: int) -> dict[str, float]:
        """Hand the evaluation out at the published policy version, wait for it, return its figures
        ({} when it was given up, or the run stopped)."""
        version = svc.learner.policy_version
        stop = [svc.tokenizer.eos_token_id] if svc.tokenizer.eos_token_id is not None else []
        self.results = EvalResults(self.cfg, [PromptOutcome() for _ in self.prompts], policy_version=version)
        for prompt, kind, num, sampling in eval_requests(self.cfg, self.prompts, stop):
            state = GroupState(self.next_group_id, prompt, version, num)
            self.groups[state.group_id] = EvalGroup(state, kind, sampling)
            self.queue.append(self._item(self.groups[state.group_id], 0, num))
            self.next_group_id += 1
            self.outstanding += num
        started = time.monotonic()
        await svc.serve_parked()
        while self.outstanding and not svc.stop_requested and time.monotonic() - started < self.cfg.eval.timeout_s:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            except TimeoutError:
                pass
        self.results.seconds = time.monotonic() - started
        if self.outstanding:
            return await self._give_up(svc, step)
        self.last = self.results.metrics()
        self.counters["eval/evaluations"] += 1
        line = self.results.line(step)
        log.info("%s", line)
        await svc.server.publish(svc.event("eval", line, step=step))
        self.groups.clear()
        return self.last

    async def _give_up(self, svc: EvalService, step: int) -> dict[str, float]:
        missing = self.outstanding
        in_flight = sum(len(g.assigned) - g.recorded for g in self.groups.values())  # handed out, not settled
        text = (f"eval at step {step} given up after {self.results.seconds:.0f} s: {missing} samples not back"
                if not svc.stop_requested else f"eval at step {step} stopped with the run ({missing} samples not back)")
        log.warning("%s", text)
        self.counters["eval/given_up"] += 1
        self.counters["eval/samples_given_up"] += in_flight
        held = sorted({g.state.group_id for g in self.groups.values() if g.assigned})
        for peer in list(svc.server.peers.values()):
            if peer.role == "generator" and held and not svc.stop_requested:
                await svc.server.send(peer.id, m.Cancel(group_ids=held, reason="eval given up"))
        await svc.server.publish(svc.event("eval", text, step=step))
        self.groups.clear()
        self.queue.clear()
        self.outstanding = 0
        return {}

    def _item(self, group: EvalGroup, first: int, num: int) -> m.WorkItem:
        p = group.state.prompt
        return m.WorkItem(group_id=group.state.group_id, prompt_token_ids=p.token_ids, num_samples=num,
                          first_sample_id=first, sampling=group.sampling, task=p.task,
                          min_policy_version=group.state.admitted_version, eval=True,
                          max_turns=self.cfg.env.max_turns)

    def group_state(self, group_id: int) -> GroupState | None:
        """The GroupState of an evaluation group handed out, or None."""
        group = self.groups.get(group_id)
        return group.state if group is not None else None

    # ------------------------------------------------------------------------------------ work and rollouts

    def take(self, peer: str, capacity: int) -> list[m.WorkItem]:
        """Eval work for a generator with room for `capacity` samples (split where it has less)."""
        items = []
        while capacity > 0 and self.queue:
            item = self.queue.popleft()
            if item.num_samples > capacity:
                self.queue.appendleft(self._item(self.groups[item.group_id], item.first_sample_id + capacity,
                                                 item.num_samples - capacity))
                item = self._item(self.groups[item.group_id], item.first_sample_id, capacity)
            for sid in range(item.first_sample_id, item.first_sample_id + item.num_samples):
                self.groups[item.group_id].assigned[sid] = peer
            self.counters["eval/samples_handed_out"] += item.num_samples
            capacity -= item.num_samples
            items.append(item)
        return items

    def on_rollout(self, svc: EvalService, peer: Any, msg: m.Rollout) -> None:
        group = self.groups.get(msg.group_id)
        if group is None or group.assigned.get(msg.sample_id) != peer.name or msg.sample_id in group.returned:
            self.counters["rollouts_dropped/eval_not_assigned"] += 1
            return
        group.returned.add(msg.sample_id)
        problem = rollout_problem(group.state, msg, svc.vocab_size, max_completion_tokens(self.cfg))
        if problem is not None and problem[0] != "empty_completion":  # an empty answer is an answer: scored
            log.warning("eval rollout %d/%d from %s failed: %s", msg.group_id, msg.sample_id, peer.name, problem[1])
            return self._record(group, None)
        svc.spawn_scoring(self._score(svc, group, msg))

    async def _score(self, svc: EvalService, group: EvalGroup, msg: m.Rollout) -> None:
        prompt = group.state.prompt
        completion = self.tokenizer.decode(msg.completion_token_ids.tolist(), skip_special_tokens=True)
        assert svc.rewards is not None  # set before the service serves, so before any rollout
        try:
            if msg.env_reward is not None:  # an episode's environment rewards, as in training
                reward = msg.env_reward
            else:
                reward, _ = await svc.rewards.score_with_details(prompt.task, prompt.text, completion, prompt.metadata)
        except ScoringFailed as exc:
            log.warning("eval sample of prompt %d not scored: %s", prompt.prompt_id, exc)
            reward = None
        if self.groups.get(group.state.group_id) is group:  # not given up meanwhile
            self._record(group, reward)

    def _record(self, group: EvalGroup, reward: float | None) -> None:
        self.results.add(group.state.prompt.prompt_id, group.kind, reward)
        group.recorded += 1
        self.counters["eval/samples_scored" if reward is not None else "eval/samples_failed"] += 1
        self.outstanding -= 1
        self.changed.set()

    def on_generator_dead(self, peer: str) -> None:
        """The eval samples a dead generator held and did not return go out again (same seeds, same samples)."""
        for group in self.groups.values():
            lost = sorted(s for s, p in group.assigned.items() if p == peer and s not in group.returned)
            for sid in lost:
                del group.assigned[sid]
                self.queue.appendleft(self._item(group, sid, 1))
                self.counters["eval/samples_redispatched"] += 1

    def summary(self) -> dict[str, Any]:
        counts = {k.removeprefix("eval/"): v for k, v in self.counters.items() if k.startswith("eval/")}
        # samples_handed_out == samples_scored + samples_failed + samples_redispatched + samples_given_up
        return {"last": self.last, **counts} if self.cfg.eval.every_steps else {}
