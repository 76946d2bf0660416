"""`tailrace run`: a trainer, launch.num_generators generators and a reward server as separate OS
processes on this machine over loopback, supervised, with progress bars. The reward server serves the
built-in tasks' functions (only those tasks), or the weighted sum of reward.functions when they are set;
with reward.mode = "servers" and no reward.functions it is not started. Where nothing started scores
data.task (reward.mode = "servers", or a task without a built-in function, and no reward function given),
the launcher prints the line that attaches the user's own. With env.server set (multi-turn episodes,
docs/environments.md) it also starts that environment class as an environment server (`tailrace env`, named
env-0), imported from the working directory as reward.functions are. The trainer is told how many generators
come (trainer.expected_generators), so that it says it waits for them while they load.

    supervisor loop  polls the children every 0.2 s: the trainer exiting ends the run; a crashed
                     generator, reward or environment server stops the run (SIGINT to the trainer, which
                     checkpoints and shuts its peers down) or is restarted, by launch.on_child_crash
    progress loop    a read-only tool connection on the trainer's notice socket renders Stats as bars
    stop signals     SIGINT (Ctrl-C), SIGTERM (kill, timeout, Slurm, systemd) and SIGHUP are forwarded,
                     as they are, to the trainer only (children run in their own sessions), which finishes
                     its step, checkpoints, writes summary.json (stop_reason names the signal) and sends
                     Shutdown; stragglers are terminated, then killed. During start-up the signal also
                     unwinds it (StopSignal). A launcher killed outright (kill -9) is noticed by each
                     child itself (engine/core/lifeline.py): SIGTERM from the kernel, the same clean stop
    run folder       owned by one run (engine/core/run_lock.py): the lock is taken before anything starts and
                     handed to every child, so a second run (or --resume) on the folder is refused while
                     any process of this one lives
    --resume         the run's own config.toml with the command line's settings on top (_prepare)

With CURVE (trainer.curve_secret_key_file), the launcher gives every child the trainer's public key and
a key pair of its own in runs/<name>/keys/, and the trainer an allow-list of those keys with their roles
(plus the entries of trainer.curve_clients_file, if set), so only the launcher's children can join.
A child counts as restarted only when its process exited; a restarted child takes over its session.

Every child's output goes to runs/<name>/logs/<child>.log. Test: pytest tests/engine/test_end_to_end.py
tests/engine/test_restarts.py tests/engine/test_launch_faults.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailrace.engine import config
from tailrace.engine.config import RunConfig, TrainerConfig, from_dict, to_toml
from tailrace.engine.core import lifeline, preflight, report, reward_fns, run_lock
from tailrace.engine.data import checks
from tailrace.engine.data.tasks import REWARD_FNS  # pure Python

STARTUP_TIMEOUT_S = 180.0
STOP_GRACE_S = 30.0
BUILTIN_REWARD = "tailrace.engine.data.tasks:score"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CLIENT_TAG = "# tailrace run: "  # ends the allow-list lines of the launcher's own children


@dataclass
class UserReward:
    """A reward function handed to tailrace.run(): a child process `tailrace reward --fn spec` when it can
    be imported by name (spec "module:qualname"), else served inside this process (a lambda, a closure,
    a function of __main__), on the launcher's event loop with the calls in the SDK's thread pool."""

    fn: Any
    tasks: tuple[str, ...] = ()
    spec: str = ""

    def task_args(self) -> list[str]:
        return ["--tasks", ",".join(self.tasks)] if self.tasks else []

    async def serve(self, address: str, keys: CurveKeys | None) -> str:
        from tailrace.protocol.reward_sdk import serve

        return await serve(self.fn, address, tasks=self.tasks or tuple(getattr(self.fn, "tasks", ())) or ("*",),
                           name="reward-0", curve_server_key=keys.server_public if keys else None,
                           curve_secret_key=keys.secrets["reward-0"] if keys else None, waiting_every_s=0)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, pass_fds=pass_fds)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _child_env(cfg: RunConfig, lock: run_lock.RunLock | None) -> dict[str, str]:
    """Every child's environment: its thread counts, this launcher's pid (engine/core/lifeline.py) and the run
    folder's lock file, whose descriptor it inherits."""
    env = lifeline.child_env(dict(os.environ))
    threads = str(cfg.launch.torch_threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    if lock is not None:
        env[run_lock.ENV] = str(lock.path)
    return env


class StopSignal(KeyboardInterrupt):
    """A stop signal before the trainer serves: unwinds the start-up as Ctrl-C does (exit 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP for the launcher's whole life (installed by `with`, the previous handlers
    restored after; only in the main thread, where Python runs handlers). Each goes on to the trainer as
    it came; the first one before the trainer serves also raises StopSignal."""

    def __init__(self):
        self.signum: int | None = None  # the first stop signal received
        self.trainer: Child | None = None
        self.serving = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self.on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def on_signal(self, signum: int, frame: Any = None) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self.trainer is not None and self.trainer.alive():
            self.trainer.proc.send_signal(signum)
        if first and not self.serving:
            raise StopSignal(signum)


class CurveKeys:
    """The key files of a `tailrace run` with CURVE: the trainer's public key and one key pair per child."""

    def __init__(self, cfg: TrainerConfig, folder: Path, clients: dict[str, str]):
        import zmq

        from tailrace.protocol.transport import read_key

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.server_public = zmq.curve_public(read_key(cfg.curve_secret_key_file, "trainer.curve_secret_key_file"))
        self._write("server.pub", self.server_public)
        lines = []
        if cfg.curve_clients_file:  # the user's entries; a resumed run's own (tagged below) are made anew
            lines = [line if line.endswith("\n") else line + "\n"
                     for line in Path(cfg.curve_clients_file).read_text().splitlines(keepends=True)
                     if CLIENT_TAG not in line]
        self.secrets: dict[str, bytes] = {}
        for name, role in clients.items():  # child name -> the role it takes
            public, self.secrets[name] = zmq.curve_keypair()
            self._write(f"{name}.secret", self.secrets[name])
            lines.append(f"{public.decode()} {role}  {CLIENT_TAG}{name}\n")
        self.allow_list = self._write("clients.allow", "".join(lines).encode())

    def _write(self, name: str, data: bytes) -> Path:
        path = self.folder / name
        path.touch(mode=0o600)
        path.write_bytes(data)
        return path

    def args(self, name: str) -> list[str]:
        return ["--curve-server-key", str(self.folder / "server.pub"), "--curve-key", str(self.folder / f"{name}.secret")]


class Launcher:
    def __init__(self, cfg: RunConfig, config_path: Path, run_dir: Path, *, resume: bool, progress: bool,
                 keys: CurveKeys | None = None, reward: UserReward | None = None,
                 lock: run_lock.RunLock | None = None, signals: StopSignals | None = None):
        self.cfg = cfg
        self.reward = reward
        self.keys = keys
        self.run_dir = run_dir
        self.config_path = config_path
        self.resume = resume
        self.progress = progress
        self.env = _child_env(cfg, lock)
        self.lock = lock
        self.pass_fds = (lock.fd,) if lock is not None else ()  # the run folder stays owned while a child lives
        self.signals = signals or StopSignals()
        self.children: list[Child] = []
        self.stop_reason = ""
        self.failed = False

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tailrace.engine.cli", *args]

    def start_trainer(self) -> tuple[Child, dict[str, Any]]:
        endpoint = self.run_dir / "endpoint.json"
        endpoint.unlink(missing_ok=True)
        argv = self.cli("trainer", "--config", str(self.config_path), *(["--resume"] if self.resume else []),
                        *(["--nproc", str(self.cfg.launch.trainer_ranks)] if self.cfg.launch.trainer_ranks > 1 else []))
        trainer = Child("trainer", argv, self.run_dir / "logs" / "trainer.log")
        self.children.append(trainer)
        self.signals.trainer = trainer
        trainer.start(self.env, self.pass_fds)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while not endpoint.is_file():
                if not trainer.alive():
                    raise RuntimeError(f"the trainer exited during start-up (code {trainer.proc.returncode}); "
                                       f"the end of {trainer.log_path}:\n{trainer.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer did not bind within {STARTUP_TIMEOUT_S:.0f} s; "
                                       f"the end of {trainer.log_path}:\n{trainer.tail()}")
                time.sleep(0.1)
            self.signals.serving = True  # from here a stop signal is the trainer's to act on
            return trainer, json.loads(endpoint.read_text())
        except BaseException:  # also Ctrl-C during start-up: nothing of ours keeps running
            self.stop_all()
            raise

    def start_peers(self, address: str) -> None:
        logs = self.run_dir / "logs"
        for i in range(self.cfg.launch.num_generators):
            argv = self.cli("generator", "--connect", address, "--name", f"gen-{i}", "--config", str(self.config_path),
                            *self.key_args(f"gen-{i}"))
            self.children.append(Child(f"gen-{i}", argv, logs / f"gen-{i}.log"))
        if self.starts_reward_server() and (self.reward is None or self.reward.spec):
            if self.reward is not None:
                serves = ["--fn", self.reward.spec, *self.reward.task_args()]
            elif self.cfg.reward.functions:
                serves = ["--config", str(self.config_path)]
            else:
                serves = ["--fn", BUILTIN_REWARD]
            argv = self.cli("reward", "--connect", address, *serves, "--name", "reward-0", *self.key_args("reward-0"))
            self.children.append(Child("reward-0", argv, logs / "reward-0.log"))
        if self.cfg.env.server:  # multi-turn episodes: the run serves its own environment
            argv = self.cli("env", self.cfg.env.server, "--connect", address, "--name", "env-0",
                            "--timeout-s", str(self.cfg.env.timeout_s), *self.key_args("env-0"))
            self.children.append(Child("env-0", argv, logs / "env-0.log"))
        for child in self.children[1:]:
            child.start(self.env, self.pass_fds)

    def key_args(self, name: str) -> list[str]:
        return self.keys.args(name) if self.keys is not None else []

    def starts_reward_server(self) -> bool:
        """reward.mode = "servers" means the user's servers score everything: the built-in one stays out,
        unless it serves the user's reward.functions. A reward function given to tailrace.run() is the
        user's server: it always starts, in place of the built-in one."""
        if self.reward is not None:
            return True
        return self.cfg.launch.reward_server and (self.cfg.reward.mode != "servers" or bool(self.cfg.reward.functions))

    def needs_reward_server(self) -> bool:
        """Whether the user must attach a reward server for data.task: neither a server this run starts
        nor the trainer's built-in functions score it."""
        cfg, task = self.cfg.reward, self.cfg.data.task
        builtin = task in REWARD_FNS
        if cfg.mode == "builtin" or self.reward is not None:
            return False
        if self.cfg.env.server and self.cfg.env.max_turns > 1:  # its environment rewards the episodes (one
            return False  # that gives no reward needs a reward server too: docs/environments.md)
        if self.starts_reward_server() and (cfg.functions or builtin):
            return False
        return cfg.mode == "servers" or bool(cfg.functions) or not builtin

    def attach_hint(self, address: str) -> str:
        """Why the run needs a reward server and how to attach one for data.task, with this run's keys when
        CURVE is on (only when needs_reward_server())."""
        reward, task = self.cfg.reward, self.cfg.data.task
        serves = ["--fn", "module:function", "--tasks", task]
        if reward.functions:  # launch.reward_server = false, else the launcher serves them
            why, serves = "launch.reward_server = false: nothing serves reward.functions", ["--config", str(self.config_path)]
        elif reward.mode == "servers":
            why = "reward.mode = servers: no reward server is started"
        else:
            why = f"task {task!r} has no built-in reward function"
        argv = ["tailrace", "reward", "--connect", address, *serves,
                *(["--name", "reward-0", *self.key_args("reward-0")] if self.keys is not None else [])]
        return (f"tailrace run: {why} (rows with another task need a server for it too); attach a reward server "
                f"with:\n  {' '.join(argv)}")

    def supervise_once(self, trainer: Child) -> bool:
        """One supervision pass; False when the run is over."""
        if not trainer.alive():
            if trainer.proc.returncode != 0:
                self.failed = True
                print(f"\ntailrace run: the trainer exited with code {trainer.proc.returncode}:\n{trainer.tail()}",
                      file=sys.stderr)
            return False
        for child in self.children[1:]:
            if child.alive() or child.proc.returncode == 0:
                continue
            code = child.proc.returncode
            if self.cfg.launch.on_child_crash == "restart" and child.restarts < self.cfg.launch.max_restarts \
                    and self.signals.signum is None:  # a run asked to stop starts nothing new
                child.restarts += 1
                print(f"\ntailrace run: {child.name} crashed (code {code}); restart {child.restarts}/"
                      f"{self.cfg.launch.max_restarts}. Log tail:\n{child.tail(8)}", file=sys.stderr)
                child.start(self.env, self.pass_fds)
            elif not self.stop_reason:
                self.failed = True
                self.stop_reason = f"{child.name} crashed with code {code}"
                print(f"\ntailrace run: {child.name} crashed (code {code}); stopping the run. Log tail:\n"
                      f"{child.tail()}", file=sys.stderr)
                trainer.proc.send_signal(signal.SIGINT)
        return True

    def stop_all(self) -> None:
        """Everything we started ends: polite first (the trainer's Shutdown reaches its peers), then
        SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + STOP_GRACE_S
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for child in self.children:
                if child.alive() and sig is not None:
                    child.proc.send_signal(sig)
            while any(c.alive() for c in self.children) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not any(c.alive() for c in self.children):
                return
            deadline = time.monotonic() + 5.0
        for child in self.children:
            if child.proc is not None:
                child.proc.wait()


async def _progress(address: str, total_steps: int, done: asyncio.Event, bars: bool,
                    keys: CurveKeys | None = None) -> None:
    """Progress from the trainer's Stats: a bar (steps, reward, staleness, generated tokens/s) on a
    terminal, one line per step otherwise. Ends quietly when the trainer shuts down."""
    from tailrace.protocol import messages as m
    from tailrace.protocol.transport import Client, ConnectionLost

    steps = None
    if bars:
        from tqdm import tqdm

        steps = tqdm(total=total_steps, desc="steps", unit="step", dynamic_ncols=True)
    throughput: dict[str, float] = {}
    last_step = 0
    try:
        async with Client(address, role="tool", name="run-progress",
                          curve_server_key=keys.server_public if keys else None,
                          curve_secret_key=keys.secrets["run-progress"] if keys else None) as client:
            await client.connect(timeout_s=30.0)
            await client.subscribe()
            while not done.is_set():
                try:
                    msg = await asyncio.wait_for(client.recv_notice(), timeout=0.5)
                except TimeoutError:
                    continue
                if isinstance(msg, m.Event) and msg.event == "write_failed":  # the trainer's log may be on that disk
                    print(f"\n{msg.text}", file=sys.stderr, flush=True)
                    continue
                if isinstance(msg, m.Event) and msg.event in ("stall", "lease_expired", "stall_over", "eval",
                                                              "no_signal"):
                    if steps is not None:
                        steps.write(f"trainer: {msg.text}")
                    else:
                        print(f"trainer: {msg.text}", flush=True)
                    continue
                if isinstance(msg, m.Stats) and msg.role == "generator":
                    throughput[msg.name] = msg.counters.get("generator/throughput/wall_tokens_per_s", 0.0)
                if not (isinstance(msg, m.Stats) and msg.role == "trainer"):
                    continue
                c = msg.counters
                step = int(c.get("trainer/step", 0))
                figures = dict(reward=f"{c.get('trainer/reward/last', float('nan')):.3f}",
                               staleness=int(c.get("trainer/controller/max_staleness_seen", 0)),
                               tok_s=f"{sum(throughput.values()):.0f}", version=msg.policy_version)
                if steps is not None:
                    steps.update(step - steps.n)
                    steps.set_postfix(**figures)
                elif step > last_step:
                    print(f"step {step}/{total_steps} " + " ".join(f"{k}={v}" for k, v in figures.items()),
                          flush=True)
                last_step = step
    except ConnectionLost:
        pass  # the trainer finished or stopped; the supervisor reports how
    finally:
        if steps is not None:
            steps.close()


async def _run_async(launcher: Launcher, trainer: Child, address: str) -> None:
    done = asyncio.Event()
    progress = None
    if launcher.progress:
        progress = asyncio.create_task(_progress(address, launcher.cfg.train.steps, done, bars=sys.stderr.isatty(),
                                                 keys=launcher.keys))
    reward = None
    if launcher.reward is not None and not launcher.reward.spec:
        reward = asyncio.create_task(launcher.reward.serve(address, launcher.keys), name="reward-0")
    try:
        while launcher.supervise_once(trainer):
            if progress is not None and progress.done() and progress.exception() is not None:
                print(f"tailrace run: progress display failed: {progress.exception()}", file=sys.stderr)
                progress = None
            if reward is not None and reward.done():
                _reward_ended(launcher, trainer, reward)
                reward = None
            await asyncio.sleep(0.2)
    finally:
        done.set()
        for task in (progress, reward):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def _reward_ended(launcher: Launcher, trainer: Child, reward: asyncio.Task) -> None:
    """The in-process reward server ends with the trainer's Shutdown; anything else stops the run, as a
    crashed reward server child does under launch.on_child_crash = "stop"."""
    if reward.cancelled() or reward.exception() is None or not trainer.alive():
        return
    launcher.failed = True
    launcher.stop_reason = f"the reward function's server failed: {reward.exception()!r}"
    print(f"\ntailrace run: {launcher.stop_reason}; stopping the run", file=sys.stderr)
    trainer.proc.send_signal(signal.SIGINT)


@dataclass
class Prepared:
    """What _prepare found: the config, whether it is a DPO run, and for --resume the line that says so."""

    cfg: RunConfig
    dpo: bool
    resumed: str = ""


def _prepare(args: Any, overrides: list[str]) -> Prepared:
    """The run's config, checked before anything starts (before any model loads). With --resume: the
    run's own config.toml, with the settings of the command line (config file and overrides) on top."""
    data = config.config_data(args.config, overrides)
    resumed = ""
    if args.resume:
        user = data
        data, run_dir = config.resumed_data(user)
        run_lock.check_free(run_dir)  # a run still running is the first thing to say
        step = _checkpoint_step(run_dir / "checkpoint")
        given = [s for s in config.dotted_settings(user) if not s.startswith(("trainer.run_name ", "trainer.runs_dir "))]
        resumed = (f"resumed from step {step} of {run_dir} (config.toml"
                   + (f" + overrides: {', '.join(given)})" if given else ", no overrides)"))
    cfg = from_dict(RunConfig, data)
    if cfg.train.algorithm == "dpo":
        return Prepared(cfg, True, resumed)
    if "bind" not in data.get("trainer", {}):  # not set by the user: a free port, so runs can share a machine
        cfg.trainer.bind = "tcp://127.0.0.1:0"
    if not cfg.trainer.run_name:
        cfg.trainer.run_name = time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name
    preflight.check_model_path(cfg.model.path)
    preflight.check_port_unclaimed(Path(cfg.trainer.runs_dir), cfg.trainer.bind, run_dir)  # names the run
    preflight.check_bind_free(cfg.trainer.bind)
    checks.check_prompts(cfg)
    if cfg.reward.functions and cfg.launch.reward_server:  # one line now, not a reward server's crash later
        reward_fns.components(cfg.reward.functions)
    if cfg.env.server:  # likewise for the environment class
        from tailrace.protocol.env_sdk import load_class

        load_class(cfg.env.server, "env.server")
    return Prepared(cfg, False, resumed)


def _checkpoint_step(root: Path) -> int:
    """The step of the newest complete checkpoint under root (the one the trainer resumes from: a step_N
    folder with its trainer_state.json, engine/trainer/checkpoint.py), read without torch."""
    steps = [int(p.name[len("step_"):]) for p in root.glob("step_*")
             if p.name[len("step_"):].isdigit() and (p / "trainer_state.json").is_file()]
    if not steps:
        raise ValueError(f"--resume: {root} holds no complete checkpoint (set trainer.run_name to the run)")
    return max(steps)


def _say_started(launcher: Launcher, endpoint: dict[str, Any]) -> None:
    cfg, address = launcher.cfg, endpoint["address"]
    for warning in endpoint.get("warnings", []):
        print(f"tailrace run: warning: {warning}", file=sys.stderr)
    print(f"tailrace run: trainer at {address}; starting {cfg.launch.num_generators} generators"
          + (" and a reward server" if launcher.starts_reward_server() else "")
          + (f" and an environment server ({cfg.env.server})" if cfg.env.server else ""))
    if launcher.needs_reward_server():  # else the started server or the built-in functions score data.task
        print(launcher.attach_hint(address), flush=True)


def _say_finished(run_dir: Path) -> None:
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        print("tailrace run: " + json.dumps({k: v for k, v in summary.items() if k != "step_rewards"}))
        print(f"tailrace run: {report.summary_line(summary)}")
    if (run_dir / "samples.jsonl").is_file():  # engine/trainer/sample_log.py
        print(f"tailrace run: what the model wrote, with rewards: tailrace samples {run_dir} [--last K]")


def main(args: Any, overrides: list[str], *, reward: UserReward | None = None) -> int:
    """`tailrace run` (args: config, resume, no_progress); tailrace.run() calls it with a reward function."""
    prepared = _prepare(args, overrides)
    if prepared.dpo and reward is not None:
        raise ValueError("train.algorithm = dpo: a reward function has nothing to score (DPO trains on pairs)")
    if prepared.dpo:  # one role: nothing to launch or supervise beside the trainer (which takes the lock)
        from tailrace.engine.trainer.main import main as trainer_main

        num_ranks = prepared.cfg.launch.trainer_ranks
        print("tailrace run: train.algorithm = dpo: training on data.source "
              + (f"on {num_ranks} trainer ranks (torchrun)" if num_ranks > 1 else "in this process")
              + ", no generators or reward servers", flush=True)
        if prepared.resumed:
            print(f"tailrace run: {prepared.resumed}", flush=True)
        if num_ranks > 1:  # torchrun as a child: this process (tailrace.run()'s caller's, maybe) carries on
            from tailrace.engine.trainer.main import torchrun_argv

            return subprocess.run(torchrun_argv(num_ranks, args, overrides), check=False).returncode
        return trainer_main(args, overrides)
    with StopSignals() as signals:
        return _launch(prepared, args, signals=signals, reward=reward)


def _launch(prepared: Prepared, args: Any, *, signals: StopSignals, reward: UserReward | None) -> int:
    """Own the run folder, start the trainer, then its peers; supervise them until the trainer exits; stop
    everything; then give the folder up."""
    cfg = prepared.cfg
    run_dir = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name
    lock = None
    try:
        try:
            with preflight.removed_if_start_fails(run_dir):  # the trainer's log tail is printed first
                lock = run_lock.take(run_dir, bind=cfg.trainer.bind)  # before anything is written there
                launcher = _set_up(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                                   reward=reward, lock=lock, signals=signals)
                trainer, endpoint = launcher.start_trainer()
        except RuntimeError as exc:
            print(f"tailrace run: {exc}", file=sys.stderr)
            return 1
        _supervise(launcher, trainer, endpoint, prepared.resumed)
        _say_finished(run_dir)
        return 1 if launcher.failed else 0
    finally:
        if lock is not None:
            lock.release()


def _supervise(launcher: Launcher, trainer: Child, endpoint: dict[str, Any], resumed: str) -> None:
    from tailrace.protocol.transport import run

    try:
        if launcher.lock is not None:  # for the next one refused
            launcher.lock.say(address=endpoint["address"])
        if resumed:
            print(f"tailrace run: {resumed}", flush=True)
        _say_started(launcher, endpoint)
        launcher.start_peers(endpoint["address"])
        run(_run_async(launcher, trainer, endpoint["address"]))
    except RuntimeError as exc:
        print(f"tailrace run: {exc}", file=sys.stderr)
        launcher.failed = True
    finally:
        launcher.stop_all()
        _name_the_launchers_reason(launcher)


def _name_the_launchers_reason(launcher: Launcher) -> None:
    """When the launcher stopped the run (a crashed child: SIGINT to the trainer), summary.json's
    stop_reason says why, not only the signal that carried it."""
    path = launcher.run_dir / "summary.json"
    if not launcher.stop_reason or not path.is_file():
        return
    summary = json.loads(path.read_text())
    if summary.get("stop_reason") == "signal SIGINT":
        summary["stop_reason"] = f"{launcher.stop_reason} (tailrace run stopped the trainer: signal SIGINT)"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, path)


def _set_up(cfg: RunConfig, run_dir: Path, *, resume: bool, progress: bool, reward: UserReward | None = None,
            lock: run_lock.RunLock | None = None, signals: StopSignals | None = None) -> Launcher:
    """The run folder (logs, CURVE keys, the children's launch.toml) and its Launcher."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    keys = None
    if cfg.trainer.curve_secret_key_file:
        clients = {f"gen-{i}": "generator" for i in range(cfg.launch.num_generators)}
        clients |= {"reward-0": "reward", "run-progress": "tool"} | ({"env-0": "env"} if cfg.env.server else {})
        keys = CurveKeys(cfg.trainer, run_dir / "keys", clients)
        cfg.trainer.curve_clients_file = str(keys.allow_list)
    if not cfg.trainer.expected_generators:  # the trainer says it waits for them while they load
        cfg.trainer.expected_generators = cfg.launch.num_generators
    config_path = run_dir / "launch.toml"
    config_path.write_text(to_toml(cfg))
    print(f"tailrace run: {run_dir} (logs in {run_dir / 'logs'})")
    return Launcher(cfg, config_path, run_dir, resume=resume, progress=progress, keys=keys, reward=reward,
                    lock=lock, signals=signals)
