"""Environment servers: the SDK that turns a Python class into an environment server for multi-turn episodes
(role "env"). Wire rules: protocol/SPEC.md, "Environment servers"; the trainer's side: protocol/env_broker.py.

Run one: tailrace env examples.multiturn.reverse_chain:ReverseChain --connect tcp://127.0.0.1:5555
     (or python -m tailrace.protocol.env_sdk with the same arguments)
Test: pytest tests/protocol/test_env_sdk.py tests/faults/test_env_faults.py

The class is instantiated once per episode (no arguments) and holds that episode's state:

    reset(prompt, metadata) -> observation     the first observation
    step(action)            -> observation     after each assistant turn (its text)
    close()                                    optional: the episode is over

sync (run in a thread pool) or async (awaited). An observation is a str (its text), or a dict / object with
any of text, token_ids, done, reward, info (as engine/generator/environment.py's Observation). The class's
`tasks` attribute, when it has one, names the tasks it serves (default: every task).

    serve()   recv loop: EnvReset -> a new instance; EnvStep -> its instance; one task per request
              (<= max_concurrency, beyond: EnvError 406), one request at a time per episode, each under the
              request's deadline (EnvError 504, the episode ends: its state may be half-changed);
              EnvClose -> close() and forget. A session the trainer declared dead (410) is followed by a
              new one, its episodes dropped (the trainer failed them with env_dead). Ends on Shutdown.
              Every STATS_INTERVAL_S it sends Stats (env/requests/..., latency, errors) and Spans.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import numbers
import os
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tailrace.protocol.messages import (
    EnvClose,
    EnvError,
    EnvObservation,
    EnvReset,
    EnvStep,
    ErrorCode,
    Shutdown,
    Welcome,
)
from tailrace.protocol.telemetry import EnvTelemetry, ServerTelemetry, publish_every
from tailrace.protocol.transport import Client, ConnectionLost, run

__all__ = ["load_class", "main", "serve", "to_observation"]

log = logging.getLogger("tailrace.env")

MAX_TEXT = 4096
STATS_INTERVAL_S = 1.0  # Stats and Spans, as a reward server sends them
MAX_OBSERVATION_CHARS = 1 << 22
MAX_OBSERVATION_TOKENS = 1 << 16
MAX_INFO = 256


def _bad(request_id: int, episode_id: int, text: str) -> EnvError:
    return EnvError(request_id=request_id, episode_id=episode_id, code=ErrorCode.BAD_FIELD, text=text[:MAX_TEXT],
                    reason="env_error")


def to_observation(request_id: int, episode_id: int, value: Any) -> EnvObservation | EnvError:
    """Check what reset/step returned: a str, or a dict / object with text, token_ids, done, reward, info.
    Anything else (a non-finite reward, too long a text, a token id that is not an int >= 0) is EnvError 401."""
    if isinstance(value, str):
        value = {"text": value}
    elif not isinstance(value, dict):
        if not hasattr(value, "text") and not hasattr(value, "done"):
            return _bad(request_id, episode_id, f"the environment returned {type(value).__name__}; expected a str "
                        "or a dict / object with text, token_ids, done, reward, info")
        value = {k: getattr(value, k) for k in ("text", "token_ids", "done", "reward", "info") if hasattr(value, k)}
    unknown = sorted(set(map(str, value)) - {"text", "token_ids", "done", "reward", "info"})
    if unknown:
        return _bad(request_id, episode_id, f"unknown observation keys {unknown[:8]}")
    text, token_ids, done = value.get("text", ""), value.get("token_ids"), value.get("done", False)
    reward, info = value.get("reward"), value.get("info") or {}
    if not isinstance(text, str) or len(text) > MAX_OBSERVATION_CHARS:
        return _bad(request_id, episode_id, f"text must be a str of at most {MAX_OBSERVATION_CHARS} characters")
    if token_ids is not None:
        token_ids = list(token_ids)
        if len(token_ids) > MAX_OBSERVATION_TOKENS or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t <= 1 << 24 for t in token_ids):
            return _bad(request_id, episode_id, f"token_ids must be at most {MAX_OBSERVATION_TOKENS} ints in [0, 2^24]")
        token_ids = [int(t) for t in token_ids]
    if not isinstance(done, bool):
        return _bad(request_id, episode_id, f"done must be a bool, got {type(done).__name__}")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            return _bad(request_id, episode_id, f"reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    if not isinstance(info, dict) or len(info) > MAX_INFO or not all(
            type(k) is str and len(k) <= 1024 and (v is None or type(v) in (bool, int, float, str)) for k, v in info.items()):
        return _bad(request_id, episode_id, f"info must be a dict of at most {MAX_INFO} str keys and "
                    "None/bool/int/float/str values")
    try:
        return EnvObservation(request_id=request_id, episode_id=episode_id, text=text, token_ids=token_ids,
                              done=done, reward=reward, info=info)
    except (ValueError, TypeError) as exc:
        return _bad(request_id, episode_id, f"bad observation: {exc}")


async def _call(method: Callable[..., Any], pool: concurrent.futures.Executor, *args: Any) -> Any:
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    result = await asyncio.get_running_loop().run_in_executor(pool, method, *args)
    return await result if inspect.isawaitable(result) else result


@dataclasses.dataclass(eq=False)
class _Episode:
    env: Any
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one request at a time


class _Episodes:
    """The episodes of one session: their instances, and running reset/step against them under deadlines."""

    def __init__(self, make_env: Callable[[], Any], pool: concurrent.futures.Executor, timeout_s: float,
                 max_episodes: int):
        self.make_env, self.pool, self.timeout_s, self.max_episodes = make_env, pool, timeout_s, max_episodes
        self.open: dict[int, _Episode] = {}

    async def answer(self, msg: EnvReset | EnvStep) -> EnvObservation | EnvError:
        limit_s = self.timeout_s if msg.timeout_s <= 0 else min(self.timeout_s, msg.timeout_s)
        rid, eid = msg.request_id, msg.episode_id
        if isinstance(msg, EnvReset):
            if eid in self.open:
                return EnvError(request_id=rid, episode_id=eid, code=ErrorCode.BAD_FIELD,
                                text=f"episode {eid} is already open")
            if len(self.open) >= self.max_episodes:
                return EnvError(request_id=rid, episode_id=eid, code=ErrorCode.NO_CREDIT,
                                text=f"{self.max_episodes} episodes already open")
            episode = self.open[eid] = _Episode(env=None)
        else:
            episode = self.open.get(eid)
            if episode is None or episode.env is None:
                return EnvError(request_id=rid, episode_id=eid, code=ErrorCode.UNSUPPORTED,
                                text=f"no open episode {eid}")
        async with episode.lock:
            reply = await self._run(episode, msg, limit_s)
        if isinstance(reply, EnvError) or reply.done:  # the episode is over for the trainer too
            await self.close(eid)
        return reply

    async def _run(self, episode: _Episode, msg: EnvReset | EnvStep, limit_s: float) -> EnvObservation | EnvError:
        rid, eid = msg.request_id, msg.episode_id
        what = "reset" if isinstance(msg, EnvReset) else "step"
        try:
            if isinstance(msg, EnvReset):
                pending = self._start(episode, msg)
            else:
                pending = _call(episode.env.step, self.pool, msg.action)
            value = await asyncio.wait_for(pending, limit_s)
        except TimeoutError:
            return EnvError(request_id=rid, episode_id=eid, code=ErrorCode.TIMEOUT, reason="env_timeout",
                            text=f"{what} timed out after {limit_s:g} s")
        except Exception as exc:  # the user's environment failed: an EnvError, not our crash
            log.warning("environment %s failed on episode %d: %r", what, eid, exc)
            return EnvError(request_id=rid, episode_id=eid, code=ErrorCode.INTERNAL,
                            text=f"{what}: {type(exc).__name__}: {exc}"[:MAX_TEXT])
        return to_observation(rid, eid, value)

    async def _start(self, episode: _Episode, msg: EnvReset) -> Any:
        episode.env = await _call(self.make_env, self.pool)
        return await _call(episode.env.reset, self.pool, msg.prompt, dict(msg.metadata))

    async def close(self, episode_id: int) -> None:
        episode = self.open.pop(episode_id, None)
        close = getattr(episode.env, "close", None) if episode is not None else None
        if close is None:
            return
        try:
            await asyncio.wait_for(_call(close, self.pool), self.timeout_s)
        except Exception as exc:  # a failing close() loses nothing the trainer needs
            log.warning("environment close() failed on episode %d: %r", episode_id, exc)


async def serve(make_env: Callable[[], Any], address: str, *, tasks: Iterable[str] | None = None,
                name: str | None = None, max_concurrency: int = 16, max_episodes: int = 1024,
                timeout_s: float = 60.0, curve_server_key: bytes | None = None, curve_secret_key: bytes | None = None,
                context: Any = None, connect_timeout_s: float = 60.0,
                on_welcome: Callable[[Welcome], None] | None = None, waiting_every_s: float = 10.0) -> str:
    """Connect to the trainer at `address` as an environment server for `tasks` (default: make_env's `tasks`
    attribute, else "*") and serve episodes until the trainer says Shutdown (returns its reason). Retries,
    rejoins (Error 410) and exits (Error 409, a lost trainer: transport.ConnectionLost) as reward_sdk.serve."""
    if max_concurrency < 1 or max_episodes < 1 or timeout_s <= 0:
        raise ValueError(f"need max_concurrency >= 1, max_episodes >= 1, timeout_s > 0; got {max_concurrency}, "
                         f"{max_episodes}, {timeout_s}")
    tasks = tuple(tasks) if tasks else tuple(getattr(make_env, "tasks", ())) or ("*",)
    name = name or f"env-{socket.gethostname()}-{os.getpid()}"
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="env")
    telemetry = EnvTelemetry(name, max_concurrency)
    try:
        while True:
            client = Client(address, role="env", name=name, tasks=tasks, max_inflight=max_concurrency,
                            curve_server_key=curve_server_key, curve_secret_key=curve_secret_key, context=context)
            episodes = _Episodes(make_env, pool, timeout_s, max_episodes)
            try:
                return await _session(client, episodes, telemetry, tasks, connect_timeout_s, waiting_every_s,
                                      on_welcome)
            except ConnectionLost as exc:
                if not exc.declared_dead:
                    raise
                log.warning("environment server %s: %s; joining again as a new session (its %d episodes dropped)",
                            name, exc, len(episodes.open))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


async def _session(client: Client, episodes: _Episodes, telemetry: ServerTelemetry, tasks: tuple[str, ...],
                   connect_timeout_s: float, waiting_every_s: float,
                   on_welcome: Callable[[Welcome], None] | None) -> str:
    """One session of serve(): Hello, then requests until Shutdown (its reason) or ConnectionLost."""
    max_concurrency = client.hello.max_inflight
    active: set[asyncio.Task] = set()
    failed: asyncio.Future = asyncio.get_running_loop().create_future()

    def done(task: asyncio.Task) -> None:
        active.discard(task)
        if not task.cancelled() and task.exception() is not None and not failed.done():
            failed.set_exception(task.exception())

    async def send(msg: Any) -> None:
        try:
            await client.send(msg)
        except ConnectionLost:
            if client.shutdown_reason is None:  # a reply racing the trainer's Shutdown is not an error
                raise

    async def answer(msg: EnvReset | EnvStep) -> None:
        ticket = telemetry.start()
        reply = await episodes.answer(msg)
        telemetry.finish(ticket, failed=isinstance(reply, EnvError))
        await send(reply)

    stats = None
    try:
        welcome = await client.connect(min(10.0, connect_timeout_s), retry_for_s=connect_timeout_s,
                                       waiting_every_s=waiting_every_s)
        log.info("environment server %s serving %s for run %s", client.hello.name, list(tasks), welcome.run_id)
        if on_welcome is not None:
            on_welcome(welcome)
        stats = asyncio.create_task(publish_every(telemetry, send, STATS_INTERVAL_S), name="env-stats")
        stats.add_done_callback(done)  # a failure surfaces like a request task's
        while True:
            msg = await _next_message(client, failed)
            if isinstance(msg, EnvReset | EnvStep):
                refusal = _refusal(msg, tasks, len(active), max_concurrency)
                if refusal is not None:
                    await client.send(refusal)
                    continue
                task = asyncio.create_task(answer(msg), name=f"env-{msg.request_id}")
                active.add(task)
                task.add_done_callback(done)
            elif isinstance(msg, EnvClose):
                task = asyncio.create_task(episodes.close(msg.episode_id), name=f"env-close-{msg.episode_id}")
                active.add(task)
                task.add_done_callback(done)
            elif isinstance(msg, Shutdown):
                log.info("trainer shut down: %s", msg.reason)
                return msg.reason
            else:
                log.info("ignored %s from the trainer: %s", type(msg).__name__, msg)
    finally:
        for task in (*active, *([stats] if stats else [])):
            task.cancel()
        await asyncio.gather(*active, *([stats] if stats else []), return_exceptions=True)
        await client.close()


def _refusal(msg: EnvReset | EnvStep, tasks: tuple[str, ...], num_active: int, max_concurrency: int) -> EnvError | None:
    if isinstance(msg, EnvReset) and "*" not in tasks and msg.task not in tasks:
        return EnvError(request_id=msg.request_id, episode_id=msg.episode_id, code=ErrorCode.UNSUPPORTED,
                        text=f"task {msg.task!r} is not one of {list(tasks)}"[:MAX_TEXT])
    if num_active >= max_concurrency:
        return EnvError(request_id=msg.request_id, episode_id=msg.episode_id, code=ErrorCode.NO_CREDIT,
                        text=f"{max_concurrency} requests already in flight")
    return None


async def _next_message(client: Client, failed: asyncio.Future) -> Any:
    """client.recv(), unless a request task failed first (then its error is raised)."""
    recv = asyncio.ensure_future(client.recv())
    try:
        await asyncio.wait((recv, failed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not recv.done():
            recv.cancel()
    if failed.done():
        failed.result()
    return recv.result()


def load_class(spec: str, setting: str = "--env") -> Callable[[], Any]:
    """The class (or factory) `module:Class`, imported with the working directory on sys.path."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{setting} {spec!r}: expected module:Class, e.g. examples.multiturn.reverse_chain:ReverseChain")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # user modules next to where they run the command
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{setting} {spec!r}: cannot import {module_name}: {exc}") from None
    cls = getattr(module, attr, None)
    if not callable(cls):
        raise ValueError(f"{setting} {spec!r}: {module_name} has no class {attr!r}")
    return cls


def main(argv: list[str] | None = None) -> int:
    """Command line of an environment server: module:Class --connect ADDR [--tasks a,b] [--name N]
    [--max-concurrency N] [--max-episodes N] [--timeout-s S] [--connect-timeout-s S] [--curve-server-key FILE]
    [--curve-key FILE] (`tailrace env` takes the same). Returns the exit status."""
    parser = argparse.ArgumentParser(description="Serve a Python environment class to a tailrace trainer.")
    parser.add_argument("env", help="module:Class, instantiated once per episode")
    parser.add_argument("--connect", required=True, help="trainer address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--tasks", default="", help="comma-separated task names it serves (default: the class's "
                        "`tasks` attribute, else all)")
    parser.add_argument("--name", default="", help="unique name in the run (default: env-<host>-<pid>)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="resets and steps served at once")
    parser.add_argument("--max-episodes", type=int, default=1024, help="episodes open at once")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-request time limit in seconds")
    parser.add_argument("--connect-timeout-s", type=float, default=0.0,
                        help="how long to wait for a trainer, in seconds (0: until one answers)")
    parser.add_argument("--curve-server-key", default="", help="file holding the trainer's CURVE public key")
    parser.add_argument("--curve-key", default="", help="file holding this server's CURVE secret key")
    return run_args(parser.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Serve `args.env` as main()'s flags say (also `tailrace env`'s); the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s env %(levelname)s %(message)s")
    from tailrace.protocol.transport import TransportError, read_key

    try:
        make_env = load_class(args.env)
        reason = run(serve(make_env, args.connect, tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                           name=args.name or None, max_concurrency=args.max_concurrency,
                           max_episodes=args.max_episodes, timeout_s=args.timeout_s,
                           connect_timeout_s=args.connect_timeout_s or math.inf,
                           curve_server_key=read_key(args.curve_server_key, "--curve-server-key"),
                           curve_secret_key=read_key(args.curve_key, "--curve-key")))
    except (TransportError, ValueError) as exc:
        print(f"environment server: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    log.info("stopped: %s", reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
