"""The trainer process: owns the run, speaks the protocol, and learns.

    net loop    consumes Hello/WorkRequest/Rollout/WeightsFetch/Stats/Event from the ROUTER socket;
                parks work requests the staleness gate refuses; scores rollouts as tasks
    train loop  runs the open step's complete groups' forward/backward early (early.py), waits for
                controller.pop_batch(), runs learner.step in a worker thread, then publishes version V+1
                (publish.py: WeightsNotice to generators and on the notice socket; parked requests
                served), on one rank beside the next step's early forward/backward; then a few of the
                step's completions go to samples.jsonl (sample_log.py), and steps without signal are said
                (reward_signal.py)
    stats loop  publishes the trainer's Stats every trainer.stats_interval_s
    loop probe  measures the event loop's lag into Stats counter trainer/loop/max_stall_ms (loop_probe.py)
    watchdog    every second: reclaims samples whose lease ran out (re-dispatched), and once the train
                loop has waited controller.stall_warn_s for a batch, says what blocks it (log, Event
                "stall" on the notice socket, which `tailrace run` prints under its progress bar)
Every loop and task above is started by spawn(): an error in one stops the run with its message (fail).
Checkpoints, summary.json and failed writes (a full disk): engine/trainer/saving.py.
Drafter sharing (net loop): generators' drafter uploads go to engine/trainer/drafters.py, which checks,
fetches and republishes them. Evaluation (eval.every_steps): engine/trainer/in_run_eval.py.

Priority in the train loop: stop, then publish new weights, then admit work. Rank 0 alone speaks the
protocol; the other ranks follow it (engine/trainer/ranks.py). Test: pytest tests/engine/test_end_to_end.py
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailrace.engine.config import RunConfig
from tailrace.engine.core import gc_freeze, lifeline, models, preflight
from tailrace.engine.core.metrics import make_sink
from tailrace.engine.core.samples import PromptRecord, TrainSample
from tailrace.engine.core.weights import WeightsStore
from tailrace.engine.data.chat import adopt_template
from tailrace.engine.data.prompt_sources import PromptSource, check_rows
from tailrace.engine.trainer import (
    checkpoint,
    early,
    loop_probe,
    publish,
    sample_log,
    saving,
    scoring,
    trained_log,
    watchdog,
    writes,
)
from tailrace.engine.trainer.broadcaster import Broadcaster, make_broadcaster, weights_summary
from tailrace.engine.trainer.controller import Controller, GroupState
from tailrace.engine.trainer.drafters import DrafterRelay
from tailrace.engine.trainer.in_run_eval import Evaluator
from tailrace.engine.trainer.intake import max_completion_tokens, rollout_problem, to_group
from tailrace.engine.trainer.learner import Learner
from tailrace.engine.trainer.reward_signal import NoSignalWatch
from tailrace.engine.trainer.runs import keep_metrics_up_to, make_run_dir
from tailrace.engine.trainer.scoring import RewardDispatcher, ScoringFailed
from tailrace.engine.trainer.step_metrics import batch_metrics
from tailrace.engine.trainer.trace import TraceLog
from tailrace.protocol import messages as m
from tailrace.protocol.telemetry import SpanBuffer

log = logging.getLogger("tailrace.trainer")

LEASE_FLOOR_S = 30.0  # a derived lease is never shorter (model load, first prefill, a busy machine)
LEASE_CEILING_S = 600.0  # nor longer, whatever a generator's measured speed
LEASE_MARGIN = 4.0  # a derived lease allows this many times the expected time of a max-length sample
MAX_BODY_BYTES = 256 << 10  # bodies sent to the trainer are small (tensors travel as frames); a larger one
# could hold ~10^5 small objects, which msgspec decodes in one call holding the GIL: refused, so that no
# message stalls the event loop for more than a few ms (tests/faults/test_loop_stall.py)


LearnerFactory = Callable[..., Learner]
"""Called as Learner is, (model, cfg.train, lora_config=cfg.model.lora, ref_model=...): the service takes one, so that a benchmark
can put modelled compute there (tools/benches/modelled.py)."""


class TrainerService:
    def __init__(self, cfg: RunConfig, *, resume: bool = False, run_dir: Path | None = None,
                 make_learner: LearnerFactory | None = None):
        self.cfg = cfg
        self.run_dir = run_dir or make_run_dir(cfg, resume)
        self.run_id = self.run_dir.name
        model_path = cfg.model.path or "tiny"
        self.tokenizer = models.load_tokenizer(model_path)
        adopt_template(cfg.data.chat_template, self.tokenizer)  # the checkpoints' tokenizer files carry it
        check_rows(cfg.data, self.tokenizer)  # rows no chat template can encode: refused before the model loads
        self.warnings = [w for w in (preflight.round_trip_warning(self.tokenizer, cfg.model.path),) if w]
        for warning in self.warnings:  # also in endpoint.json, which `tailrace run` prints from
            log.warning("%s", warning)
        model = models.load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
        model.train()
        ref = models.load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device) \
            if cfg.train.kl_coef > 0 else None
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_model_len = model.config.max_position_embeddings
        self.learner = (make_learner or Learner)(model, cfg.train, lora_config=cfg.model.lora, ref_model=ref)
        state: dict[str, Any] = {}
        resume_from = checkpoint.latest(self.run_dir / "checkpoint") if resume else None
        if resume and resume_from is None:
            raise ValueError(f"--resume: {self.run_dir}/checkpoint holds no complete checkpoint")
        if resume_from is not None:
            state = checkpoint.load(resume_from, self.learner)
        position = state.get("data_position", {})
        counters = state.get("counters", {})
        max_prompt = cfg.data.max_prompt_tokens or self.max_model_len - cfg.sampling.max_new_tokens
        if max_prompt < 1:
            raise ValueError(f"sampling.max_new_tokens {cfg.sampling.max_new_tokens} leaves no room for a "
                             f"prompt in the model's context of {self.max_model_len} tokens")
        self.counters: collections.Counter[str] = collections.Counter()
        self.evaluator = Evaluator(cfg, self.tokenizer, max_prompt, self.counters)  # its prompts: never trained
        self.source = PromptSource(cfg.data, self.tokenizer, max_prompt_tokens=max_prompt,
                                   position=position.get("prompts_consumed", 0), held_out=self.evaluator.held_out)
        self.controller = Controller(self.source, group_size=cfg.sampling.group_size,
                                     groups_per_step=cfg.train.groups_per_step,
                                     max_staleness=cfg.controller.max_staleness,
                                     max_groups_in_flight=cfg.controller.max_groups_in_flight,
                                     policy_version=self.learner.policy_version,
                                     groups_admitted=position.get("groups_admitted", 0),
                                     total_steps=cfg.train.steps, next_group_id=position.get("next_group_id"),
                                     unfinished=[PromptRecord(**p) for p in position.get("unfinished", [])])
        self.controller.samples_handed_out = counters.get("samples_handed_out", 0)
        self.controller.samples_trained = counters.get("samples_trained", 0)
        self.controller.discarded.update(counters.get("discarded", {}))
        self.controller.max_staleness_seen = counters.get("max_staleness_seen", 0)
        self.step_rewards: list[float] = counters.get("step_rewards", [])
        self.wall_s_before = counters.get("wall_s", 0.0)
        self.no_signal = NoSignalWatch(cfg, str(self.run_dir), steps_without_signal=counters.get("steps_without_signal", 0))
        self.store = WeightsStore(cfg.trainer.weights_chunk_bytes)
        self.drafters = DrafterRelay(self.store, self.counters, model if cfg.trainer.accept_drafters else None)
        if resume_from is not None:
            self.drafters.restore(resume_from)
            for name in ("metrics.jsonl", trained_log.FILE_NAME, sample_log.FILE_NAME):  # those steps train again
                keep_metrics_up_to(self.run_dir / name, self.learner.step_count)
        self.sink = make_sink(self.run_dir, cfg)
        self.spans = SpanBuffer("trainer", "trainer", enabled=cfg.metrics.spans)
        self.trace = TraceLog(self.run_dir / "trace.jsonl", on_failure=lambda exc: saving.trace_failed(self, exc))
        self.state = "starting"
        self.parked: dict[bytes, int] = {}  # generator peer id -> capacity of its parked WorkRequest
        self.peer_stats: dict[str, m.Stats] = {}
        self.generator_versions: dict[str, int] = {}  # last policy version each generator reported
        self.last_generator_stats: dict[str, m.Stats] = {}  # kept after the generator leaves
        self.changed = asyncio.Event()
        self.publishing: asyncio.Task | None = None  # publish.begin of the newest version, in the background
        self.broadcaster: Broadcaster | None = None  # weights by broadcast, when trainer.weights_transport allows
        self.stop_requested = False
        self.stop_reason = ""
        self.failure: Exception | None = None  # what stopped the run from inside (a loop's error), raised at the end
        self.checkpoints_failed = 0  # periodic checkpoints in a row that could not be written (writes.py)
        self.server: Any = None
        self.rewards: RewardDispatcher | None = None
        self.envs: Any = None  # protocol.env_broker.EnvBroker, once serving
        self.scoring: set[asyncio.Task] = set()
        self.started_s = time.monotonic()
        self.waiting_since_s: float | None = None  # when the train loop began waiting for a batch
        self.progress_s = time.monotonic()  # last sign of life: a peer joined, a rollout, a score, a step
        self.stall_said: tuple[str, float] = ("", 0.0)  # (what, when) the watchdog last said
        self.s_per_token: dict[str, float] = {}  # generator -> measured seconds per completion token (EMA)
        self.train_busy_s = 0.0
        self.token_totals = collections.Counter(counters.get("tokens", {}))  # branch-replay bookkeeping
        self.last_loss = float("nan")

    # ------------------------------------------------------------------------------------ lifecycle

    def request_stop(self, reason: str) -> None:
        if not self.stop_requested:
            log.info("stopping: %s", reason)
            self.stop_requested, self.stop_reason = True, reason
            self.changed.set()

    def fail(self, where: str, exc: Exception) -> None:
        """An error inside a loop stops the run with its message (the log, the peers' Shutdown reason,
        summary.json); run() raises it. ValueError, WriteFailed: one line; anything else: a bug, traced."""
        if self.failure is not None:
            return
        self.failure = exc
        if isinstance(exc, writes.WriteFailed):
            exc.outcome = saving.stopped_outcome(self)
        one_line = isinstance(exc, ValueError | writes.WriteFailed)
        text = str(exc) if one_line else f"{where} failed: {exc!r}"
        if not one_line:
            log.error("%s", text, exc_info=exc)
        self.stop_reason = ""  # the failure is the reason, whatever stop was asked before
        self.stop_requested = False
        self.request_stop(text)

    def spawn(self, coro: Any, name: str) -> asyncio.Task:
        """A background task whose error stops the run (fail), instead of vanishing with the task."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self.task_done)
        return task

    def task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(f"the trainer's {task.get_name()} task", task.exception())

    def spawn_scoring(self, coro: Any) -> None:
        task = self.spawn(coro, "scoring")
        self.scoring.add(task)
        task.add_done_callback(self.scoring.discard)

    async def run(self) -> dict[str, Any]:
        from tailrace.protocol import codec
        from tailrace.protocol.transport import Server, load_client_roles, read_key

        cfg = self.cfg.trainer
        self.server = Server(cfg.bind, run_id=self.run_id, credits=cfg.credits,
                             heartbeat_interval_s=cfg.heartbeat_interval_s,
                             missed_heartbeats=cfg.missed_heartbeats, accept=self.accept,
                             limits=dataclasses.replace(codec.DEFAULT_LIMITS, max_body_bytes=MAX_BODY_BYTES),
                             policy_version=lambda: self.learner.policy_version,
                             drafter_version=self.drafter_version,
                             curve_secret_key=read_key(cfg.curve_secret_key_file, "trainer.curve_secret_key_file"),
                             client_roles=load_client_roles(cfg.curve_clients_file) if cfg.curve_clients_file else None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stop_reason names it (and a dead launcher)
            loop.add_signal_handler(sig, lambda s=sig: self.request_stop(lifeline.stop_reason(s)))
        self.drafters.server = self.server
        async with gc_freeze.frozen(), self.server:  # no full GC pass walks the start-up heap while serving
            router = None
            if self.cfg.reward.mode != "builtin":
                from tailrace.protocol.reward_sdk import RewardRouter

                router = RewardRouter(self.server)
            self.rewards = RewardDispatcher(self.cfg.reward, router)
            from tailrace.protocol.env_broker import EnvBroker

            self.envs = EnvBroker(self.server, timeout_s=self.cfg.env.timeout_s,  # episodes: generators <-> env servers
                                  wait_for_server_s=self.cfg.env.wait_for_server_s, prompt_of=self.prompt_of)
            weights = await asyncio.to_thread(self.learner.state_dict_for_broadcast)  # off the event loop
            notice = self.store.publish("policy", self.learner.policy_version, weights)
            self.broadcaster = make_broadcaster(self.cfg, self.server, self.counters)
            if self.broadcaster is not None:
                self.broadcaster.offer(self.learner.policy_version, weights, notice)
            endpoint = self.run_dir / "endpoint.json"  # renamed into place: `tailrace run` reads it at once
            endpoint.with_suffix(".tmp").write_text(json.dumps(
                {"address": self.server.address, "notice_address": self.server.notice_address,
                 "pid": os.getpid(), "warnings": self.warnings}))
            os.replace(endpoint.with_suffix(".tmp"), endpoint)
            log.info("trainer listening on %s (run %s); %s", self.server.address, self.run_id,
                     scoring.reward_line(self.cfg, self.server.address, curve=bool(cfg.curve_secret_key_file)))
            self.state = "idle"
            loops = [self.spawn(self.net_loop(), "net"), self.spawn(self.stats_loop(), "stats"),
                     self.spawn(self.watchdog_loop(), "watchdog"), self.spawn(loop_probe.watch(self.counters), "loop-probe")]
            if self.broadcaster is not None:
                loops.append(self.spawn(self.broadcaster.run(), "broadcast"))
            try:
                await self.train_loop()
            except Exception as exc:  # its peers are told why, not "run finished"
                self.fail("the train loop", exc)
                raise
            finally:
                if self.envs is not None:
                    self.envs.close()  # open episodes fail now, their servers are told
                await self.shutdown_peers()
                for task in (*loops, *self.scoring):
                    task.cancel()
                await asyncio.gather(*loops, *self.scoring, return_exceptions=True)
                summary = self.finish()
        if self.failure is not None:
            raise self.failure
        return summary

    def prompt_of(self, group_id: int) -> tuple[str, str, dict[str, Any]] | None:
        """(task, text, metadata) of the prompt handed out under group_id (training or evaluation), for the
        environment broker: an episode starts from the trainer's prompt, never a generator's word for it."""
        group = self.controller.groups.get(group_id) or self.evaluator.group_state(group_id)
        if group is None:
            return None
        p = group.prompt
        scalars = {k: v for k, v in p.metadata.items()
                   if type(k) is str and (v is None or type(v) in (bool, int, float, str))}
        return p.task, p.text, scalars

    def accept(self, hello: m.Hello) -> m.Reject | None:
        if hello.role == "generator":
            vocab = hello.capabilities.get("vocab_size")
            if vocab is not None and vocab != self.vocab_size:
                return m.Reject(code=m.ErrorCode.UNAUTHORIZED, text=(
                    f"generator {hello.name!r} announced vocab_size {vocab}, but the trained model has "
                    f"{self.vocab_size}: it must load the same model (model.path)"))
        return None

    # ------------------------------------------------------------------------------------ train loop

    async def train_loop(self) -> None:
        total = self.cfg.train.steps
        while self.learner.step_count < total and not self.stop_requested:
            await early.accumulate_committed(self)  # the step's complete groups, while the rest generate
            batch = self.controller.pop_batch()
            if batch is None and self.controller.exhausted and not self.controller.groups \
                    and not self.controller.queue:
                batch = self.controller.pop_final() or None
                if batch is None:
                    self.request_stop(self.source.exhausted_text() if self.controller.source_exhausted
                                      else "no more work: every group was discarded")
                    break
            if batch is None:
                self.changed.clear()
                if self.waiting_since_s is None:
                    self.waiting_since_s = time.monotonic()
                with self.spans.span("wait_data"):
                    await self.changed.wait()
                await self.serve_parked()  # whatever changed (a discard, a reclaim) may open the gate
                continue
            self.waiting_since_s = None
            await self.train_step(batch)
            self.progress_s = time.monotonic()
        await publish.published(self)
        if self.learner.step_count >= total:
            self.stop_reason = self.stop_reason or f"reached train.steps = {total}"

    async def train_step(self, batch: list[GroupState]) -> None:
        version = self.learner.policy_version
        groups = [to_group(g) for g in batch]
        await publish.published(self)  # the optimizer step changes the weights the last version's copy reads
        self.state = "training"
        started = time.monotonic()
        with self.spans.span("train_step", value=len(groups)):  # forward-backward and optimizer
            metrics = await asyncio.to_thread(self.learner.step, groups)
        self.train_busy_s += time.monotonic() - started
        for key in ("logical_tokens", "unique_tokens"):
            self.token_totals[key] += metrics.get(f"trainer/strategy/{key}", 0.0)
        self.controller.on_trained(batch, version)
        trained_log.append(self.run_dir, self.learner.step_count, batch)
        metrics |= batch_metrics(groups, version) | {
            "trainer/step/seconds": time.monotonic() - started,
            "trainer/time/elapsed_s": self.wall_s_before + time.monotonic() - self.started_s,  # across resumes
            "trainer/policy_version": self.learner.policy_version,
            "trainer/data/epochs_done": self.source.epochs_done,
        } | self.controller.stats()
        self.step_rewards.append(metrics["trainer/reward/mean"])
        self.last_loss = metrics.get("trainer/loss/total", self.last_loss)
        self.state = "syncing_weights"
        await publish.begin(self)  # version V+1 out to the generators (publish.py)
        if self.evaluator.due(self.learner.step_count):  # engine/trainer/in_run_eval.py: waits for it
            await publish.published(self)
            metrics |= await self.evaluator.run(self, self.learner.step_count)
        with writes.writing(self.run_dir / "metrics.jsonl"):
            self.sink.log(self.learner.step_count, metrics)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)  # as score() does
        sample_log.append(self.run_dir, sample_log.records(self.learner.step_count, batch,
                                                           self.cfg.metrics.samples_per_step, decode))
        if (text := self.no_signal.update(groups)) is not None:  # every group taught nothing, K steps running
            log.warning("%s", text)
            await self.server.publish(self.event("no_signal", text, steps=self.no_signal.streak))
        every = self.cfg.checkpoint.every_steps
        if every and self.learner.step_count % every == 0:
            await publish.published(self)
            await saving.periodic_checkpoint(self)  # skipped once when it cannot be written; twice stops the run
        self.state = "idle"

    # ------------------------------------------------------------------------------------ net loop

    async def net_loop(self) -> None:
        while True:
            peer, msg = await self.server.recv()
            if msg is None:  # a lifecycle event: peer joined, left or dead
                await self.on_peer_event(peer)
                continue
            handler = self.handlers.get(type(msg))
            if handler is None:
                self.counters[f"unexpected/{type(msg).__name__}"] += 1
                await self.server.send(peer.id, m.Error(code=m.ErrorCode.UNSUPPORTED, ref_kind=msg.KIND,
                                                        text=f"the trainer does not serve {type(msg).__name__}"))
                continue
            await handler(self, peer, msg)

    async def on_peer_event(self, peer: Any) -> None:
        event = peer.event
        self.progress_s = time.monotonic()
        if event == "joined":
            await self.server.publish(self.event("peer_joined", f"{peer.role} {peer.name} joined",
                                                 peer=peer.name, role=peer.role))
            for model in ("policy", "drafter"):
                latest = self.store.latest(model)
                by_broadcast = model == "policy" and self.broadcaster is not None and \
                    self.broadcaster.can_join(peer.peer)
                if peer.role == "generator" and latest is not None and latest.version > 0 and not by_broadcast:
                    await self.server.send(peer.id, latest)
            if self.broadcaster is not None and peer.role == "generator":
                self.broadcaster.membership_changed(peer)  # a newcomer gets the latest version by broadcast
            return
        if self.broadcaster is not None and peer.role == "generator":
            await self.broadcaster.member_gone(peer)  # mid-broadcast: the other members get chunks meanwhile
        self.parked.pop(peer.id, None)
        self.drafters.forget_fetch_from(peer.id)  # its drafter left with it; the next announcement starts over
        self.peer_stats.pop(peer.name, None)
        if peer.role == "generator":
            requeued = self.controller.on_generator_dead(peer.name)
            self.evaluator.on_generator_dead(peer.name)
            lost = sum(r.num_samples for r in requeued)
            if lost:
                log.warning("generator %s %s with %d samples in flight: re-dispatching them", peer.name, event, lost)
            await self.serve_parked()
        await self.server.publish(self.event(f"peer_{event}", f"{peer.role} {peer.name} {event}",
                                             peer=peer.name, role=peer.role))
        self.changed.set()

    async def on_work_request(self, peer: Any, msg: m.WorkRequest) -> None:
        if peer.role != "generator":
            return await self.reply_error(peer, msg, m.ErrorCode.UNAUTHORIZED, "only generators request work")
        self.parked.pop(peer.id, None)
        await self.answer_work(peer, msg.capacity)

    def lease_s(self, peer_name: str) -> float:
        """How long `peer_name` may hold a sample: controller.lease_s, or derived from its measured speed."""
        if self.cfg.controller.lease_s > 0:
            return self.cfg.controller.lease_s
        expected_s = self.s_per_token.get(peer_name, 0.0) * self.cfg.sampling.max_new_tokens
        return min(LEASE_CEILING_S, max(LEASE_FLOOR_S, LEASE_MARGIN * expected_s))

    async def answer_work(self, peer: Any, capacity: int) -> None:
        evals = self.evaluator.take(peer.name, capacity)  # first: the train loop waits for its evaluation
        room = capacity - sum(item.num_samples for item in evals)
        decision = self.controller.request_work(peer.name, room, now=time.monotonic(),
                                                lease_s=self.lease_s(peer.name)) if room or not evals else None
        if decision is None and not evals:
            self.parked[peer.id] = capacity
            return
        s = self.cfg.sampling
        sampling = m.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens,
                                    stop_token_ids=[self.tokenizer.eos_token_id]
                                    if self.tokenizer.eos_token_id is not None else [])
        items = [m.WorkItem(group_id=r.group_id, prompt_token_ids=prompt.token_ids, num_samples=r.num_samples,
                            first_sample_id=r.first_sample_id, sampling=sampling, task=prompt.task,
                            min_policy_version=version, max_turns=self.cfg.env.max_turns)
                 for prompt, r, version in (decision.items if decision else [])]
        exhausted = decision is not None and decision.exhausted
        if exhausted:  # a step holding fewer groups than a batch may close now that no more can come
            self.changed.set()
        await self.server.send(peer.id, m.Work(items=evals + items, exhausted=exhausted))

    async def serve_parked(self) -> None:
        for peer_id, capacity in list(self.parked.items()):
            peer = self.server.peers.get(peer_id)
            if peer is None:
                self.parked.pop(peer_id, None)
                continue
            if self.controller.request_work_possible() or self.evaluator.has_work():
                del self.parked[peer_id]
                await self.answer_work(peer, capacity)

    async def on_rollout(self, peer: Any, msg: m.Rollout) -> None:
        if msg.eval:
            return self.evaluator.on_rollout(self, peer, msg)
        reason = self.controller.check_rollout(peer.name, msg.group_id, msg.sample_id)
        if reason is not None:
            self.counters[f"rollouts_dropped/{reason}"] += 1
            return
        group = self.controller.groups[msg.group_id]
        problem = rollout_problem(group, msg, self.vocab_size, max_completion_tokens(self.cfg))
        handed_out_s = self.controller.on_received(msg.group_id, msg.sample_id)
        self.progress_s = time.monotonic()
        if handed_out_s is not None and problem is None:  # measured here: a peer cannot talk its lease up
            per_token = (time.monotonic() - handed_out_s) / msg.completion_token_ids.shape[0]
            last = self.s_per_token.get(peer.name)
            self.s_per_token[peer.name] = per_token if last is None else 0.8 * last + 0.2 * per_token
        if problem is not None:
            reason, text = problem
            log.warning("rollout %d/%d from %s discarded: %s", msg.group_id, msg.sample_id, peer.name, text)
            self.controller.on_discard(msg.group_id, msg.sample_id, reason)
            self.changed.set()
            return
        self.spawn_scoring(self.score(group.prompt, msg))

    async def score(self, prompt: PromptRecord, msg: m.Rollout) -> None:
        try:
            if msg.env_reward is not None:  # the environment's rewards (checked finite in intake): no server asked
                reward, details = msg.env_reward, {}
            else:
                completion = self.tokenizer.decode(msg.completion_token_ids.tolist(), skip_special_tokens=True)
                reward, details = await self.rewards.score_with_details(prompt.task, prompt.text, completion,
                                                                        prompt.metadata)
            temperature = self.cfg.sampling.temperature or 1.0
            sample = TrainSample(group_id=msg.group_id, sample_id=msg.sample_id, prompt_ids=prompt.token_ids,
                                 completion_ids=msg.completion_token_ids.clone(),
                                 behaviour_logprobs=msg.behaviour_logprobs.clone(),
                                 policy_versions=msg.policy_versions.clone(), reward=reward,
                                 temperature=temperature, finish_reason=msg.finish_reason, reward_details=details,
                                 loss_mask=msg.loss_mask.bool() if msg.loss_mask is not None else None)
        except ScoringFailed as exc:
            self.controller.on_discard(msg.group_id, msg.sample_id, exc.reason)
            self.counters[f"discarded/{exc.reason}"] += 1
        else:
            self.controller.on_scored(msg.group_id, msg.sample_id, sample)
        self.progress_s = time.monotonic()
        self.changed.set()

    async def on_weights_fetch(self, peer: Any, msg: m.WeightsFetch) -> None:
        chunk = self.store.chunk(msg.model, msg.version, msg.chunk_index)
        if chunk is None:
            latest = self.store.latest(msg.model)
            return await self.reply_error(peer, msg, m.ErrorCode.UNSUPPORTED,
                                          f"{msg.model} version {msg.version} chunk {msg.chunk_index} is not "
                                          f"served; latest is {latest.version if latest else 'none'}")
        with self.spans.span("serve_weights", track="net"):
            await self.server.send(peer.id, chunk)

    # ------------------------------------------------------------------------------------ drafter relay

    def drafter_version(self) -> int:
        return self.drafters.version()

    async def on_weights_notice(self, peer: Any, msg: m.WeightsNotice) -> None:
        if peer.role != "generator" or msg.model != "drafter":
            return await self.reply_error(peer, msg, m.ErrorCode.UNAUTHORIZED, "only generators announce drafters")
        await self.drafters.on_notice(peer, msg)

    async def on_weights_chunk(self, peer: Any, msg: m.WeightsChunk) -> None:
        await self.drafters.on_chunk(peer, msg)

    async def on_weights_ack(self, peer: Any, msg: m.WeightsAck) -> None:
        if peer.role != "generator" or self.broadcaster is None:
            return await self.reply_error(peer, msg, m.ErrorCode.UNSUPPORTED, "no weights broadcast to acknowledge")
        self.broadcaster.on_ack(peer, msg)

    async def on_peer_error(self, peer: Any, msg: m.Error) -> None:
        """Counted and logged (the 1st, 2nd, 4th, ... of each code); the session goes on. An Error names no
        request, so a ScoreRequest it refers to is settled by its timeout (protocol/SPEC.md)."""
        key = f"trainer/peer_errors/{msg.code}"
        self.counters[key] += 1
        if self.counters[key] & (self.counters[key] - 1) == 0:
            log.warning("%s %s answered Error %d to a message of kind %d: %s (%d so far)", peer.role, peer.name,
                        msg.code, msg.ref_kind, msg.text, self.counters[key])
        if msg.ref_kind == m.WeightsFetch.KIND:
            self.drafters.forget_fetch_from(peer.id)  # the generator no longer serves that version

    async def on_stats(self, peer: Any, msg: m.Stats) -> None:
        self.trace.write(msg)
        self.peer_stats[peer.name] = msg
        if msg.role == "generator":
            self.generator_versions[peer.name] = msg.policy_version
            self.last_generator_stats[peer.name] = msg
        await self.server.publish(msg)

    async def on_event(self, peer: Any, msg: m.Event) -> None:
        self.trace.write(msg)
        await self.server.publish(msg)

    async def on_spans(self, peer: Any, msg: m.Spans) -> None:
        self.trace.write(msg)
        await self.server.publish(msg)

    async def reply_error(self, peer: Any, msg: Any, code: int, text: str) -> None:
        await self.server.send(peer.id, m.Error(code=code, text=text, ref_kind=msg.KIND))

    handlers = {
        m.WorkRequest: on_work_request,
        m.Rollout: on_rollout,
        m.WeightsFetch: on_weights_fetch,
        m.WeightsNotice: on_weights_notice,
        m.WeightsChunk: on_weights_chunk,
        m.WeightsAck: on_weights_ack,
        m.Stats: on_stats,
        m.Event: on_event,
        m.Spans: on_spans,
        m.Error: on_peer_error,  # a peer's complaint; counted by the transport
    }

    # ------------------------------------------------------------------------------------ telemetry

    def event(self, name: str, text: str, **fields: Any) -> m.Event:
        event = m.Event(role="trainer", name="trainer", event=name, text=text, fields=fields, wall_s=time.time())
        self.trace.write(event)
        return event

    def stats(self) -> m.Stats:
        counters = dict(self.controller.stats())
        counters |= {k: float(v) for k, v in self.counters.items()}
        counters["trainer/step"] = self.learner.step_count
        counters["trainer/steps_total"] = self.cfg.train.steps
        counters["trainer/queue/parked_requests"] = len(self.parked)
        counters["trainer/queue/scoring"] = len(self.scoring)
        if self.envs is not None:
            counters |= self.envs.stats()
        if self.step_rewards:
            counters["trainer/reward/last"] = self.step_rewards[-1]
            counters["trainer/loss/last"] = self.last_loss
        if self.token_totals["unique_tokens"]:
            counters["trainer/replay/saving"] = self.token_totals["logical_tokens"] / self.token_totals["unique_tokens"]
        return m.Stats(role="trainer", name="trainer", state=self.state, policy_version=self.learner.policy_version,
                       counters=counters, wall_s=time.time())

    async def watchdog_loop(self) -> None:
        await watchdog.watch(self)

    async def stats_loop(self) -> None:
        while True:
            stats, spans = self.stats(), self.spans.drain()
            self.trace.write(stats)
            for msg in (stats, spans) if spans is not None else (stats,):
                await self.server.publish(msg)
            if spans is not None:
                self.trace.write(spans)
            await asyncio.sleep(self.cfg.trainer.stats_interval_s)

    # ------------------------------------------------------------------------------------ the end

    async def shutdown_peers(self) -> None:
        self.state = "stopping"
        if isinstance(self.failure, writes.WriteFailed):
            await saving.warn(self, self.failure)
        cancelled = self.controller.on_stop()
        for peer in list(self.server.peers.values()):
            if peer.role == "generator" and cancelled:
                await self.server.send(peer.id, m.Cancel(group_ids=cancelled, reason=self.stop_reason))
            await self.server.send(peer.id, m.Shutdown(reason=self.stop_reason or "run finished"))
        await self.server.publish(m.Shutdown(reason=self.stop_reason or "run finished"))

    def save_checkpoint(self) -> Path:
        return saving.save_checkpoint(self)

    async def save_checkpoint_off_loop(self) -> Path:
        return await saving.save_checkpoint_off_loop(self)

    def summary(self) -> dict[str, Any]:
        c = self.controller
        n = max(1, len(self.step_rewards) // 10)
        return {
            "steps": self.learner.step_count,
            "policy_version": self.learner.policy_version,
            "samples_handed_out": c.samples_handed_out,
            "samples_trained": c.samples_trained,
            "discarded": dict(c.discarded),
            "max_staleness_seen": c.max_staleness_seen,
            "reward_first": statistics.fmean(self.step_rewards[:n]) if self.step_rewards else None,
            "reward_last": statistics.fmean(self.step_rewards[-n:]) if self.step_rewards else None,
            "step_rewards": self.step_rewards,
            "prompts_skipped_too_long": self.source.skipped_too_long,
            "scored_by": dict(self.rewards.num_scored) if self.rewards else {},
            "generator_policy_versions": dict(self.generator_versions),
            "trainer_busy_s": self.train_busy_s,
            "tokens": dict(self.token_totals),  # logical: sum over samples; unique: what ran forward
            "replay_saving": (self.token_totals["logical_tokens"] / self.token_totals["unique_tokens"]
                              if self.token_totals["unique_tokens"] else None),
            "generator_time_s": {name: {"busy_s": st.counters.get("generator/time/busy_s", 0.0),
                                        "wall_s": st.counters.get("generator/time/wall_s", 0.0),
                                        "telemetry_s": st.counters.get("generator/telemetry/cost_s", 0.0),
                                        "env_wait_s": st.counters.get("generator/env/wait_s", 0.0),
                                        "env_calls": st.counters.get("generator/env/calls", 0.0)}
                                 for name, st in self.last_generator_stats.items()},
            **weights_summary(self.counters, self.last_generator_stats),
            "wall_s": self.wall_s_before + time.monotonic() - self.started_s,
            "steps_without_signal": self.no_signal.steps_without_signal,  # every group: one reward for all
            "stop_reason": self.stop_reason,
            "eval": self.evaluator.summary(),
        }

    def finish(self) -> dict[str, Any]:
        return saving.finish(self)
