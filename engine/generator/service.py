"""The generator process: pulls work from the trainer, samples on its backend (interface.py), streams each
finished sample at once, and takes new weights between decode steps.

    recv loop   consumes Work / Cancel / WeightsNotice / WeightsChunk / Shutdown / Error from the trainer
                into GenState (bounded: work only arrives as answers to our own WorkRequests); EnvObservation /
                EnvError go to the environment client (env_client.py), which episodes wait on
    session     one Hello and these loops; a session the trainer declared dead while we were alive (a
                frozen process) ends with its work dropped, and a new session starts (drop_session)
    main loop   decide(GenState) -> one Action, then act: shutdown > swap weights > admit work >
                request work > decode one step (in a worker thread) > wait for the recv loop
    stats loop  sends Stats and the spans recorded since (engine/generator/spans.py) every trainer stats interval
    receive     per broadcast WeightsNotice, one at a time in the trainer's order: joins the weight group and
                receives the version in a worker thread (engine/core/broadcast.py Receiver), acknowledges
                (WeightsAck), sets it ready for the main loop; on any failure fetches it by chunks instead;
                an error it raises beyond that ends the session, as one of the loops' does (receive_done)
Drafter sharing (with speculation): every DRAFTER_PUBLISH_STEPS spot-training steps the drafter is
exported into a small local WeightsStore and announced to the trainer (WeightsNotice "drafter"), which
fetches it from here (WeightsFetch -> WeightsChunk) and republishes it to every generator; a newer
drafter announced by the trainer is fetched like policy weights and adopted between steps.

Multi-turn episodes (environment given, WorkItem.max_turns > 1): episodes.Episodes runs each sample's
environment calls as tasks; refresh() applies what they queued (add / resume / finish) between steps, a
"turn" Finished goes to the episode loop instead of the trainer, and notify() wakes an idle main loop.

`decide` is pure and tested on CPU with fakes (tests/engine/generator/test_generator_decide.py).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tailrace.engine.config import RunConfig
from tailrace.engine.core import gc_freeze
from tailrace.engine.core.weights import WeightsAssembler, WeightsStore
from tailrace.engine.generator.spans import idle_state, record_step, step_marks
from tailrace.protocol import messages as m
from tailrace.protocol.telemetry import SpanBuffer

log = logging.getLogger("tailrace.generator")

EXHAUSTED_RETRY_S = 2.0  # after "no more work", how long until asking again
CONNECT_TIMEOUT_S = 10.0  # one handshake attempt (a loaded trainer answers within a heartbeat or two)
CONNECT_RETRY_S = 120.0  # refused or unanswered handshakes are retried, with backoff, for this long
WAITING_EVERY_S = 10.0  # while no trainer answers, "waiting for a trainer at ADDR" this often
DRAFTER_STEPS_PER_TURN = 64  # drafter training steps per idle turn (each yields to arriving work)
DRAFTER_PUBLISH_STEPS = 200  # spot-training steps between announcing our drafter to the trainer


def background_priority() -> None:
    """Lower the calling thread to nice 19. Drafter training is opportunistic work: on a host whose CPUs
    it shares with the trainer or other generators it should only take CPU time nobody else wants."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread
    except (AttributeError, OSError):  # elsewhere, or not permitted: train at normal priority
        pass


class Action(enum.Enum):
    SHUTDOWN = "shutdown"
    SWAP_WEIGHTS = "swap_weights"
    ADMIT = "admit"
    REQUEST_WORK = "request_work"
    DECODE = "decode"
    TRAIN_DRAFTER = "train_drafter"
    WAIT = "wait"


@dataclass
class GenState:
    """What the main loop decides on. Mutated only by the event loop thread."""

    policy_version: int = 0
    shutdown: str | None = None
    ready_weights: tuple[int, dict] | None = None  # (version, state dict) fully fetched
    pending_items: collections.deque = field(default_factory=collections.deque)  # WorkItems not admitted
    request_outstanding: bool = False
    exhausted: bool = False
    num_running: int = 0
    num_waiting: int = 0
    capacity: int = 0
    in_flight_update: bool = True
    cancel_groups: set = field(default_factory=set)  # applied by the main loop between decode steps
    drafter_has_data: bool = False  # the spot trainer holds traces to train the drafter on


def decide(s: GenState) -> Action:
    if s.shutdown is not None:
        return Action.SHUTDOWN
    if s.ready_weights is not None and (s.in_flight_update or s.num_running == 0):
        return Action.SWAP_WEIGHTS
    if s.pending_items and s.pending_items[0].min_policy_version <= s.policy_version and \
            s.capacity >= 1 and (s.in_flight_update or s.ready_weights is None):
        return Action.ADMIT
    pending_samples = sum(item.num_samples for item in s.pending_items)
    if not s.request_outstanding and not s.exhausted and s.capacity - pending_samples > 0:
        return Action.REQUEST_WORK
    if s.num_running or s.num_waiting:
        return Action.DECODE
    if s.drafter_has_data:  # nothing to decode: spend the idle time on the drafter, preemptibly
        return Action.TRAIN_DRAFTER
    return Action.WAIT


def broadcast_receiver(cfg: RunConfig, backend: Any, address: str) -> Any:
    """The weights-broadcast receiver for a backend that can take weights received in this process: torch
    (into its model's layout and device) and vLLM (its engine core runs here: received on the CPU in the
    Hugging Face layout, vllm_backend.hf_layout, then loaded like fetched weights); else None."""
    if cfg.generator.weights_transport != "auto":
        return None
    from tailrace.engine.core.broadcast import Receiver

    layout = getattr(backend, "broadcast_layout", None)
    if layout is not None:
        return Receiver(layout, address, "cpu")
    model = getattr(backend, "model", None)
    if not hasattr(model, "state_dict"):
        return None
    return Receiver(model.state_dict(), address, getattr(backend, "device", "cpu"))


class GeneratorService:
    def __init__(self, cfg: RunConfig, address: str, *, name: str = "", curve_server_key: bytes | None = None,
                 make_backend: Any = None,  # interface.BackendFactory; None: generator.backend
                 curve_secret_key: bytes | None = None, connect_for_s: float = CONNECT_RETRY_S,
                 environment: Any = None):  # environment.Environment: runs WorkItems with max_turns > 1
        import torch

        from tailrace.engine.generator.interface import load_backend, speculation_drafters, spot_training

        self.cfg = cfg
        self.address = address
        self.connect_for_s = connect_for_s  # math.inf: wait for the trainer however long it takes
        self.name = name or f"gen-{os.getpid()}"
        self.curve_server_key, self.curve_secret_key = curve_server_key, curve_secret_key
        self.backend = (make_backend or load_backend)(cfg)
        self.spot = self.bandit = None
        self.spot_thread: ThreadPoolExecutor | None = None
        drafters = speculation_drafters(cfg, self.backend)
        if drafters:
            from tailrace.engine.core.drafter import load_or_create
            from tailrace.engine.generator.speculation.bandit import SpecBandit, arms_for
            from tailrace.engine.generator.speculation.drafter_training import SpotTrainer

            # Model-free drafts alone (auto on a CPU without a drafter_path) need no drafter model.
            drafter = (load_or_create(cfg.generator.drafter_path or None, self.backend.model)
                       if "eagle" in drafters else None)
            self.bandit = SpecBandit(arms_for(drafters))
            train = spot_training(cfg, self.backend)  # the suffix drafter needs no training
            self.backend.enable_speculation(drafter, self.bandit, max_traces=None if train else 0)
            if train:
                self.spot = SpotTrainer(drafter)
                self.spot_thread = ThreadPoolExecutor(1, thread_name_prefix="drafter-training",
                                                      initializer=background_priority)
        self.torch = torch
        self.state = GenState(in_flight_update=cfg.generator.in_flight_update)
        self.assembler: WeightsAssembler | None = None
        self.receiver = broadcast_receiver(cfg, self.backend, address)  # None: new weights by chunks only
        self.receiving = asyncio.Lock()  # broadcasts are received in the order the trainer sent them
        self.receive_tasks: set[asyncio.Task] = set()
        self.receive_failed: asyncio.Task | None = None  # a receive task that raised: the main loop surfaces it
        self.weights_by = collections.Counter()  # "broadcast" / "chunks" / "broadcast_failed": versions taken
        # Drafter sharing, only with speculation: what we serve to the trainer, what we fetch from it.
        self.drafter_store = WeightsStore(cfg.trainer.weights_chunk_bytes) if self.spot is not None else None
        self.drafter_assembler: WeightsAssembler | None = None
        self.ready_drafter: tuple[int, dict] | None = None  # (version, state dict) fully fetched
        self.drafter_published_steps = 0  # spot.num_steps when we last announced our drafter
        self.drafters_rejected = 0
        self.wakeup = asyncio.Event()
        self.client: Any = None
        self.status = "starting"
        self.samples_sent = 0
        self.tokens_sent = 0
        self.items_rejected = 0
        self.eval_samples: dict[int, int] = {}  # eval group id -> its samples not yet sent (Rollout.eval)
        self.eval_sent = 0
        self.held: collections.Counter[int] = collections.Counter()  # group id -> its samples in the backend
        self.rejoins = 0  # sessions the trainer declared dead while we were alive, each followed by a new one
        self.samples_dropped = 0  # samples of such sessions, dropped (the trainer handed them out again)
        self.started_s = time.monotonic()
        self.spans = SpanBuffer("generator", self.name, enabled=cfg.metrics.spans)
        from tailrace.engine.generator.env_client import ProtocolEnvironment

        # Multi-turn episodes (env.max_turns > 1): environment servers, reached through the trainer.
        self.env = ProtocolEnvironment(self.send_env, timeout_s=cfg.env.timeout_s,
                                       wait_for_server_s=cfg.env.wait_for_server_s,
                                       vocab_size=self.backend.vocab_size)
        # The episode loop runs WorkItems with max_turns > 1 on it (or on `environment`, an in-process one).
        multi_turn = environment is not None or cfg.env.max_turns > 1
        self.episodes = self._episodes(environment or self.env) if multi_turn else None
        self.ended: list = []  # episode samples that ended between steps (refresh), to send

    def _episodes(self, environment: Any) -> Any:
        from tailrace.engine.core import models
        from tailrace.engine.data.chat import adopt_template
        from tailrace.engine.generator.episodes import Episodes, EpisodeSettings

        tokenizer = models.load_tokenizer(self.cfg.model.path or "tiny")
        adopt_template(self.cfg.data.chat_template, tokenizer)
        return Episodes(environment, tokenizer, EpisodeSettings.from_config(self.cfg.env), notify=self.wakeup.set)

    async def run(self) -> str:
        """Serve the run until the trainer's Shutdown (returns its reason). A session the trainer declared
        dead while this process was alive (frozen, starved) is followed by a new one (rejoin)."""
        from tailrace.protocol.transport import ConnectionLost

        async with gc_freeze.frozen():  # as the trainer: no full GC pass walks the start-up heap
            try:
                while True:
                    try:
                        return await self.session()
                    except ConnectionLost as exc:
                        if not exc.declared_dead:  # the trainer is gone, or a successor took our name
                            raise
                        self.drop_session(exc)
            finally:
                if self.receiver is not None:
                    self.receiver.close()
                if self.spot_thread is not None:
                    self.spot_thread.shutdown(wait=False, cancel_futures=True)
                if self.episodes is not None:
                    await self.episodes.aclose()
                self.backend.close()

    async def session(self) -> str:
        """One session with the trainer: Hello, then the loops until Shutdown (its reason) or ConnectionLost."""
        from tailrace.protocol.transport import Client, ConnectionLost

        caps = {"backend": self.backend.name, "vocab_size": self.backend.vocab_size,
                "max_model_len": self.backend.max_model_len}
        if self.receiver is not None:  # we can join the trainer's weights broadcast group
            caps |= {"weights_broadcast": self.receiver.backends(), "weights_layout": self.receiver.fingerprint}
        self.client = Client(self.address, role="generator", name=self.name,
                             max_inflight=self.cfg.generator.max_batch_size, capabilities=caps,
                             curve_server_key=self.curve_server_key, curve_secret_key=self.curve_secret_key)
        async with self.client:
            welcome = await self.client.connect(timeout_s=CONNECT_TIMEOUT_S, retry_for_s=self.connect_for_s,
                                                waiting_every_s=WAITING_EVERY_S)
            log.info("%s connected to run %s (policy version %d)", self.name, welcome.run_id, welcome.policy_version)
            self.receive_failed = None  # one of an earlier session ended that session
            recv = asyncio.create_task(self.recv_loop(), name="recv")
            stats = asyncio.create_task(self.stats_loop(), name="stats")
            for task in (recv, stats):
                task.add_done_callback(lambda _: self.wakeup.set())  # an idle main loop must see it end
            try:
                await self.main_loop(recv, stats)
            except ConnectionLost:
                # A send can race the trainer's Shutdown (the connection ends as it arrives): that is
                # the normal end of a run, anything else is a real loss.
                if self.client.shutdown_reason is None:
                    raise
                self.state.shutdown = self.client.shutdown_reason or "trainer shut down"
            finally:
                self.env.fail_all("env_dead", "the session with the trainer ended")  # no episode waits on it
                for task in (recv, stats, *self.receive_tasks):
                    task.cancel()
                await asyncio.gather(recv, stats, *self.receive_tasks, return_exceptions=True)
        return self.state.shutdown or ""

    async def send_env(self, msg: m.EnvReset | m.EnvStep | m.EnvClose) -> None:
        """The environment client's way to the trainer: this session's connection."""
        from tailrace.engine.generator.environment import EnvironmentError
        from tailrace.protocol.transport import ConnectionLost

        if self.client is None:
            raise EnvironmentError("env_dead", "no session with the trainer")
        try:
            await self.client.send(msg)
        except ConnectionLost as exc:
            raise EnvironmentError("env_dead", f"the session with the trainer ended: {exc}") from None

    def drop_session(self, lost: Exception) -> None:
        """The trainer declared our session dead and handed its samples out again (generator_dead): what
        that session held is dropped here, never sent (a new session's results must answer its own work);
        weights already fetched are kept."""
        if self.episodes is not None:
            self.episodes.cancel(list(self.held))
            self.ended.clear()
        held = self.backend.cancel(list(self.held))
        dropped = len(held) + sum(item.num_samples for item in self.state.pending_items)
        self.samples_dropped += dropped
        self.rejoins += 1
        log.warning("%s: %s; dropping the %d samples of that session (the trainer handed them out again) and "
                    "joining as a new session (rejoin %d)", self.name, lost, dropped, self.rejoins)
        self.held.clear()
        self.eval_samples.clear()
        self.assembler = self.drafter_assembler = None
        self.state = GenState(in_flight_update=self.cfg.generator.in_flight_update,
                              ready_weights=self.state.ready_weights)

    def refresh(self) -> None:
        s, b = self.state, self.backend
        if s.cancel_groups:
            if self.episodes is not None:
                self.episodes.cancel(s.cancel_groups)
            b.cancel(s.cancel_groups)
            for group_id in s.cancel_groups:
                self.held.pop(group_id, None)
            s.cancel_groups = set()
        starting = 0
        if self.episodes is not None:  # what environment calls queued: add / resume / finish rows
            self.ended += self.episodes.apply(b)
            starting = self.episodes.num_starting  # resetting: rows the backend does not hold yet
        s.num_running, s.num_waiting = b.num_running, b.num_waiting
        s.capacity = max(0, b.capacity() - starting)
        s.policy_version = b.policy_version
        s.drafter_has_data = self.spot is not None and self.spot.has_data()

    def receive_done(self, task: asyncio.Task) -> None:
        """A receive task ended. An error it raised (it handles a failed broadcast itself: chunks instead)
        is kept for the main loop to raise, so it ends the session with its message instead of vanishing."""
        self.receive_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.receive_failed is None:
            self.receive_failed = task
            self.wakeup.set()  # an idle main loop must see it

    async def main_loop(self, recv: asyncio.Task, stats: asyncio.Task) -> None:
        while True:
            for task in (recv, stats, self.receive_failed):
                if task is not None and task.done():
                    task.result()  # surface a dead connection or a bug in the recv, stats or a receive task
            self.refresh()
            while self.ended:
                done = self.ended.pop(0)
                self._left_backend(done.group_id)
                await self.send_rollout(done)
            if self.ready_drafter is not None:  # between steps: small, and never blocks rollouts
                self.adopt_drafter()
            action = decide(self.state)
            if action is Action.SHUTDOWN:
                self.status = "stopping"
                return
            if action is Action.SWAP_WEIGHTS:
                self.status = "syncing_weights"
                version, tensors = self.state.ready_weights
                self.state.ready_weights = None
                with self.spans.span("weights_swap"):
                    self.backend.update_weights(tensors, version)
                await self.client.send(self.stats())  # tools see the new version at once
            elif action is Action.ADMIT:
                for error in self.admit(self.state.pending_items.popleft()):
                    await self.client.send(error)
            elif action is Action.REQUEST_WORK:
                pending = sum(item.num_samples for item in self.state.pending_items)
                self.state.request_outstanding = True
                await self.client.send(m.WorkRequest(capacity=self.state.capacity - pending,
                                                     policy_version=self.backend.policy_version))
            elif action is Action.DECODE:
                self.status = "generating"
                marks = step_marks(self.backend)
                finished = await asyncio.to_thread(self.backend.step)
                record_step(self.spans, self.backend, marks, len(finished))
                if self.spot is not None:
                    self.spot.add_traces(self.backend.take_traces())
                for done in finished:
                    if self.episodes is not None and (done := self.episodes.on_finished(done)) is None:
                        continue  # an assistant turn ended: the episode loop asks the environment
                    self._left_backend(done.group_id)
                    await self.send_rollout(done)
            elif action is Action.TRAIN_DRAFTER:
                self.status = "drafter_training"
                self.wakeup.clear()  # any message from the trainer stops training within one step
                with self.spans.span("drafter_training"):
                    await asyncio.get_running_loop().run_in_executor(
                        self.spot_thread, self.spot.run, self.wakeup.is_set, DRAFTER_STEPS_PER_TURN)
                self.backend.drafter_changed()
                await self.maybe_publish_drafter()
                if not self.wakeup.is_set():
                    await self.idle()
            else:
                self.wakeup.clear()
                await self.idle()

    async def idle(self) -> None:
        self.status = "idle"
        with self.spans.span(idle_state(self.state.request_outstanding, self.state.exhausted)):
            await self.wakeup.wait()

    def admit(self, item: m.WorkItem) -> list[m.Rollout]:
        """Queue the item's samples; if the backend refuses them (e.g. a prompt too long for this
        model), answer each with an "error" rollout so the trainer counts them instead of waiting."""
        from tailrace.engine.generator.requests import requests_for

        try:
            if getattr(item, "max_turns", 1) > 1:  # WorkItem.max_turns: the protocol's, once it has one
                if self.episodes is None:
                    raise ValueError(f"the item asks for episodes of {item.max_turns} turns, but this generator "
                                     "has no environment")
                self.episodes.admit(item)  # its resets run as tasks; refresh() adds the rows
            else:
                for request in requests_for(item):  # all share the prompt: the first add fails or none does
                    self.backend.add(request)
            self.held[item.group_id] += item.num_samples
            return []
        except ValueError as exc:
            self.items_rejected += 1
            log.error("work item for group %d rejected: %s", item.group_id, exc)
        torch = self.torch
        empty_i, empty_f = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.float32)
        prompt = torch.tensor(item.prompt_token_ids, dtype=torch.int32)
        version = self.backend.policy_version
        self._sent_eval(item.group_id, item.num_samples)
        return [m.Rollout(group_id=item.group_id, sample_id=item.first_sample_id + i, prompt_token_ids=prompt,
                          completion_token_ids=empty_i, behaviour_logprobs=empty_f, policy_versions=empty_i,
                          min_policy_version=version, max_policy_version=version, finish_reason="error",
                          finished_wall_s=time.time(), eval=item.eval)
                for i in range(item.num_samples)]

    def _left_backend(self, group_id: int) -> None:
        self.held[group_id] -= 1
        if self.held[group_id] <= 0:
            del self.held[group_id]

    def _sent_eval(self, group_id: int, num: int) -> bool:
        """Whether the group is eval work; counts `num` of its samples as sent."""
        left = self.eval_samples.get(group_id)
        if left is None:
            return False
        if left > num:
            self.eval_samples[group_id] = left - num
        else:
            del self.eval_samples[group_id]
        self.eval_sent += num
        return True

    async def send_rollout(self, done: Any) -> None:
        if done.finish_reason == "cancelled":
            return
        torch = self.torch
        versions = done.policy_versions.to(torch.int32)
        reason = done.finish_reason
        if reason not in m.FINISH_REASONS:  # never from this generator's loop; a guard for the wire
            log.warning("group %d sample %d ended: %s (sent as \"error\")", done.group_id, done.sample_id, reason)
            reason = "error"
        # An episode can end before its first token (its reset failed): the loaded version then.
        low, high = (int(versions.min()), int(versions.max())) if len(versions) else (self.backend.policy_version,) * 2
        msg = m.Rollout(group_id=done.group_id, sample_id=done.sample_id,
                        prompt_token_ids=torch.tensor(done.prompt_ids, dtype=torch.int32),
                        completion_token_ids=done.completion_ids.to(torch.int32),
                        behaviour_logprobs=done.behaviour_logprobs, policy_versions=versions,
                        min_policy_version=low, max_policy_version=high, finish_reason=reason,
                        queue_s=done.queue_s, decode_s=done.decode_s, finished_wall_s=time.time(),
                        eval=self._sent_eval(done.group_id, 1), **self.episode_fields(done))
        await self.client.send(msg)
        self.samples_sent += 1
        self.tokens_sent += len(done.completion_ids)

    def episode_fields(self, done: Any) -> dict[str, Any]:
        """Rollout.loss_mask / env_reward / num_turns of a multi-turn episode, from the Finished attributes
        of the same names where the episode loop sets them (single-turn: none, the defaults)."""
        fields: dict[str, Any] = {}
        if getattr(done, "loss_mask", None) is not None:
            fields["loss_mask"] = self.torch.as_tensor(done.loss_mask).to(self.torch.uint8)
        if getattr(done, "env_reward", None) is not None:
            fields["env_reward"] = float(done.env_reward)
        if getattr(done, "num_turns", None) is not None:
            fields["num_turns"] = int(done.num_turns)
        return fields

    # ------------------------------------------------------------------------------------ receive

    async def recv_loop(self) -> None:
        while True:
            msg = await self.client.recv()
            if isinstance(msg, m.Work):
                self.state.request_outstanding = False
                self.state.exhausted = msg.exhausted
                self.state.pending_items.extend(msg.items)
                for item in msg.items:
                    if item.eval:  # its Rollouts say eval too
                        self.eval_samples[item.group_id] = self.eval_samples.get(item.group_id, 0) + item.num_samples
                if msg.exhausted:  # ask again later: a dead peer's work may be re-dispatched
                    asyncio.get_running_loop().call_later(EXHAUSTED_RETRY_S, self.retry_work)
            elif isinstance(msg, m.Cancel):
                groups = set(msg.group_ids)
                self.state.pending_items = collections.deque(
                    i for i in self.state.pending_items if i.group_id not in groups)
                self.state.cancel_groups |= groups  # the backend may be mid-step in its thread
                for group_id in groups:
                    self.eval_samples.pop(group_id, None)
            elif isinstance(msg, m.WeightsNotice) and msg.transport == "broadcast":
                task = asyncio.create_task(self.on_broadcast_notice(msg), name=f"broadcast-v{msg.version}")
                self.receive_tasks.add(task)
                task.add_done_callback(self.receive_done)
            elif isinstance(msg, m.WeightsNotice):
                await (self.on_drafter_notice(msg) if msg.model == "drafter" else self.on_notice(msg))
            elif isinstance(msg, m.WeightsChunk):
                await (self.on_drafter_chunk(msg) if msg.model == "drafter" else self.on_chunk(msg))
            elif isinstance(msg, m.WeightsFetch):
                await self.client.send(self.serve_drafter(msg))
            elif isinstance(msg, m.EnvObservation | m.EnvError):
                self.env.on_message(msg)  # an episode's answer: its reset/step call wakes up
            elif isinstance(msg, m.Shutdown):
                self.state.shutdown = msg.reason or "trainer shut down"
                self.wakeup.set()
                return  # the connection is over; the next recv() would raise ConnectionLost
            elif isinstance(msg, m.Error):
                log.warning("trainer reported error %d: %s", msg.code, msg.text)
                if msg.ref_kind == m.WeightsFetch.KIND:  # that version is gone; a newer notice follows
                    # The trainer's fetch errors name the model first ("drafter version 3 chunk 0 ...").
                    if msg.text.startswith("drafter"):
                        self.drafter_assembler = None
                    else:
                        self.assembler = None
            self.wakeup.set()

    def retry_work(self) -> None:
        self.state.exhausted = False
        self.wakeup.set()

    def newest_version(self) -> int:
        """The newest policy version loaded or fully received."""
        ready = self.state.ready_weights
        return max(self.backend.policy_version, ready[0] if ready is not None else -1)

    async def on_broadcast_notice(self, notice: m.WeightsNotice) -> None:
        """Receive a version by broadcast (in a worker thread, bounded by the notice's timeout); acknowledge;
        on any failure leave the group and fetch the same version by chunks."""
        async with self.receiving:
            try:
                if self.receiver is None or notice.model != "policy":
                    raise ValueError("this generator did not offer to join a weights broadcast")
                with self.spans.span("weights_broadcast", track="weights"):
                    tensors = await asyncio.to_thread(self.receiver.receive, notice)
            except Exception as exc:  # bounded failure of the group (or a bad notice): chunks instead
                self.weights_by["broadcast_failed"] += 1
                log.warning("weights v%d by broadcast failed (%s: %s): fetching chunks", notice.version,
                            type(exc).__name__, exc)
                if self.receiver is not None:
                    await asyncio.to_thread(self.receiver.close)
                await self.client.send(m.WeightsAck(model=notice.model, version=notice.version, ok=False,
                                                    text=f"{type(exc).__name__}: {exc}"[:4096]))
                await self.on_notice(notice)
                return
        if notice.version > self.newest_version():  # an older one kept the group in step: nothing to load
            self.state.ready_weights = (notice.version, tensors)
            self.weights_by["broadcast"] += 1
            if self.assembler is not None and self.assembler.notice.version <= notice.version:
                self.assembler = None
        await self.client.send(m.WeightsAck(model=notice.model, version=notice.version, ok=True))
        self.wakeup.set()

    async def on_notice(self, notice: m.WeightsNotice) -> None:
        if notice.model != "policy" or notice.version <= self.newest_version():
            return
        if self.assembler is not None and self.assembler.notice.version >= notice.version:
            return
        self.assembler = WeightsAssembler(notice)
        if notice.num_chunks == 0:
            return
        await self.client.send(m.WeightsFetch(model="policy", version=notice.version, chunk_index=0))

    async def on_chunk(self, chunk: m.WeightsChunk) -> None:
        if self.assembler is None or chunk.version != self.assembler.notice.version:
            return  # a chunk of a version we gave up on
        tensors = self.assembler.add(chunk)
        if tensors is None:
            await self.client.send(m.WeightsFetch(model="policy", version=chunk.version,
                                                  chunk_index=self.assembler.next_index()))
            return
        if chunk.version > self.newest_version():
            self.state.ready_weights = (chunk.version, tensors)
            self.weights_by["chunks"] += 1
        self.assembler = None

    # ------------------------------------------------------------------------------------ drafter sharing

    async def maybe_publish_drafter(self) -> None:
        if self.spot.num_steps - self.drafter_published_steps < DRAFTER_PUBLISH_STEPS:
            return
        self.drafter_published_steps = self.spot.num_steps
        version, state = self.spot.export()
        await self.client.send(self.drafter_store.publish("drafter", version, state))

    def serve_drafter(self, fetch: m.WeightsFetch) -> m.WeightsChunk | m.Error:
        """The trainer fetches a drafter we announced; Error when that version is no longer kept."""
        chunk = None
        if fetch.model == "drafter" and self.drafter_store is not None:
            chunk = self.drafter_store.chunk("drafter", fetch.version, fetch.chunk_index)
        if chunk is None:
            return m.Error(code=m.ErrorCode.UNSUPPORTED, ref_kind=m.WeightsFetch.KIND,
                           text=f"{fetch.model} version {fetch.version} chunk {fetch.chunk_index} is not served here")
        return chunk

    async def on_drafter_notice(self, notice: m.WeightsNotice) -> None:
        if self.spot is None or notice.version <= self.spot.drafter.version or notice.num_chunks == 0:
            return  # without speculation there is no drafter to update
        if self.drafter_assembler is not None and self.drafter_assembler.notice.version >= notice.version:
            return
        self.drafter_assembler = WeightsAssembler(notice)
        await self.client.send(m.WeightsFetch(model="drafter", version=notice.version, chunk_index=0))

    async def on_drafter_chunk(self, chunk: m.WeightsChunk) -> None:
        if self.drafter_assembler is None or chunk.version != self.drafter_assembler.notice.version:
            return  # a chunk of a version we gave up on
        try:
            tensors = self.drafter_assembler.add(chunk)
        except ValueError as exc:
            self.reject_drafter(chunk.version, exc)
            return
        if tensors is None:
            await self.client.send(m.WeightsFetch(model="drafter", version=chunk.version,
                                                  chunk_index=self.drafter_assembler.next_index()))
            return
        self.ready_drafter = (chunk.version, tensors)
        self.drafter_assembler = None

    def adopt_drafter(self) -> None:
        version, tensors = self.ready_drafter
        self.ready_drafter = None
        try:
            adopted = self.spot.load_shared(tensors, version)  # validates every name and shape first
        except ValueError as exc:
            self.reject_drafter(version, exc)
            return
        if adopted:
            self.backend.drafter_changed()  # the spot trainer's drafter is the backend's, changed in place
            log.info("%s adopted shared drafter v%d", self.name, version)

    def reject_drafter(self, version: int, exc: ValueError) -> None:
        self.drafter_assembler = None
        self.drafters_rejected += 1
        log.error("shared drafter v%d rejected: %s", version, exc)

    # ------------------------------------------------------------------------------------ telemetry

    def stats(self) -> m.Stats:
        b = self.backend.stats
        elapsed = time.monotonic() - self.started_s
        counters = {
            "generator/queue/running": self.backend.num_running,
            "generator/queue/waiting": self.backend.num_waiting,
            "generator/queue/pending_items": len(self.state.pending_items),
            "generator/samples/sent": self.samples_sent,
            "generator/tokens/generated": b.num_generated_tokens,
            "generator/throughput/tokens_per_s": b.tokens_per_s,
            "generator/throughput/wall_tokens_per_s": b.num_generated_tokens / max(elapsed, 1e-9),
            "generator/time/busy_s": b.prefill_s + b.decode_s,
            "generator/time/wall_s": elapsed,
            "generator/work/items_rejected": self.items_rejected,
            "generator/session/rejoins": self.rejoins,
            "generator/session/samples_dropped": self.samples_dropped,
            "generator/eval/samples_sent": self.eval_sent,
            "generator/telemetry/cost_s": self.spans.cost_s,  # recording and sending spans
            "generator/weights/by_broadcast": self.weights_by["broadcast"],
            "generator/weights/by_chunks": self.weights_by["chunks"],
            "generator/weights/broadcast_failed": self.weights_by["broadcast_failed"],
        }
        if self.episodes is not None:  # multi-turn: environment calls (they overlap decoding other rows)
            counters["generator/env/calls"] = self.episodes.num_env_calls
            counters["generator/env/wait_s"] = self.episodes.env_wait_s
            counters["generator/env/waiting"] = self.episodes.num_waiting_env
        if self.bandit is not None:
            from tailrace.engine.generator.speculation.speculative import telemetry

            counters.update(telemetry(self.backend, self.bandit, *[self.spot] * (self.spot is not None)))
            counters["generator/drafter/shared_rejected"] = self.drafters_rejected
        return m.Stats(role="generator", name=self.name, state=self.status,
                       policy_version=self.backend.policy_version, counters=counters, wall_s=time.time())

    async def stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.trainer.stats_interval_s)
            await self.client.send(self.stats())
            if (spans := self.spans.drain()) is not None:  # drain() counts its own cost
                started = time.perf_counter()
                await self.client.send(spans)
                self.spans.cost_s += time.perf_counter() - started
