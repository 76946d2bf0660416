"""Pipeline benchmark: synchronous (batch barrier) against streaming, real and with modelled compute.

    python tools/bench.py pipeline [--quick] [--json] [--workload longtail]

One workload (`workload()`: the default synthetic task on the shipped tiny model, or the long-tail one on
a 12-layer policy; same train.steps, groups_per_step and group_size, so the same samples trained; the
modelled modes take modelled_steps steps, 24 also with --quick, as they cost sleeps), run
several ways, each as separate OS processes (a trainer and two generators over tcp loopback, built-in rewards):

    sync             controller.max_staleness 0 and train.early_backward false: generate the whole batch,
                     then train it (the batch barrier of synchronous RL)
    stream           controller.max_staleness 1: finished groups stream into training
    modelled_sync    the same two with modelled compute (tools/benches/modelled.py): no model runs in any
    modelled_stream  process; each decode step and training step sleeps for a cost measured first, in
                     this run, so the scheduler alone is timed, free of 2-core CPU contention
    stream+spec      stream with speculative decoding as the defaults run it given a drafter trained before
                     the runs on the policy's own rollouts (other prompts; what a long-lived run resumes with):
                     generator.speculation auto and generator.drafter_path, the bandit choosing per running
                     batch size between plain steps, that drafter and the suffix drafter (on a CPU, whose idle
                     cores are the other processes', the drafter is not trained further; on a GPU it is, in
                     the generators' idle turns); spec_ratio = sync_s / its time
    stream+spec_train  the same with generator.speculation on: the drafter is also trained in the generators'
                     idle turns on a CPU; spec_ratio_train
    stream+spec_cold the same with a drafter that starts untrained in each run; spec_ratio_cold
    stream+default   stream with the default settings (generator.speculation auto: on a CPU the suffix
                     drafter, and the EAGLE one only from a given drafter, not trained in idle turns):
                     default_vs_plain = stream_s / its time, what the default costs or gains against plain stream
    modelled_stream_s2  modelled_stream with controller.max_staleness 2 (AReaL's eta = 2): modelled_ratio_s2. With
                     max_staleness s a group must be trained within s + 1 steps of its admission, so a step
                     lasts at least about 1 / (s + 1) of the longest group's generation: on a long-tail
                     workload that, not the scheduler, caps modelled_ratio near 2 at s = 1
    modelled_stream_s4  the same at max_staleness 4: modelled_ratio_s4
    modelled_stream+spec  modelled_stream whose generators decode at the speculative speedup measured per
                     running batch size (measure_spec_speedup: the pretrained drafter, the bandit over every
                     drafter): modelled_spec_ratio = modelled_sync_s / its time, and modelled_spec_over_stream
                     = modelled_stream_s / its time, what speculation adds on top of streaming where the
                     drafter and verifier do not share the trainer's cores (stream+spec's real runs do)
    stream_barrier   stream and modelled_stream with train.early_backward false (the step's forward/backward
    modelled_stream_barrier  only once its last group is in): early_backward_gain = their time / stream's,
                     modelled_ratio_barrier = modelled_sync_s / the modelled one's: the scheduling rule's gain
    stream-spans     stream with metrics.spans false: spans_ratio = its time / stream's; telemetry_frac is
                     what the generators' own clocks say recording and sending spans cost them, of their wall time

With --timeline DIR (python tools/bench.py pipeline --timeline DIR): DIR/MODE/timeline.{json,png} for each
mode's (first) run, and DIR/sync_vs_stream/ with the two side by side (tools/timeline.py).

Measuring (tools/benches/pipeline_costs.py, a child process, one torch thread like each role): CPU
seconds of real decode steps at every batch size 1..generator.max_batch_size, of prefill, of training
steps against the tokens the trainer runs, and of early forward/backward calls (Learner.accumulate) and the
optimizer step after them, so that a modelled early call pays a call's fixed cost as a real one does (CPU
time, not wall time, so that other load on the machine does not inflate the costs); and
completions of the task by the real model (another data seed than the runs) for the length distribution.

Processes: this process imports torch and transformers once and forks each role, which then runs
`tailrace.engine.cli.main` exactly as `tailrace trainer|generator` would (a role starts in about a second instead
of five); in the modelled modes it runs modelled.role_main, the same roles with the modelled backend and
learner passed to the services. A tool process on the notice socket times each run: from the first generator joining to the
last step's WeightsNotice. Idle: trainer 1 - training seconds / that time; generators 1 - backend busy
seconds / their wall seconds (summary.json). `modelled_ratio_bound` = modelled_sync_s / the busy seconds
of the busiest process of modelled_stream: no schedule of that work beats it, so modelled_ratio close to
it means the workload's balance of compute, not the scheduler, limits the gain (scheduler_efficiency =
modelled_ratio / modelled_ratio_bound). rollout_share_[modelled_]sync: the trainer's idle share of a sync
run, i.e. what of a synchronous step is rollout (and weights out); completion_len_p99_over_median of the
measured completions: both check the long-tail workload's claim in the output. CPU: this process samples
the user + system seconds of the trainer and generators (every thread) from /proc every 20 ms and takes
them over the same window (CpuSampler): cpu_s and cpu_busy (cpu_s over cores x wall) per real mode, and
ratio_bound_cpu = sync_s / (stream's cpu_s / cores): the real modes share this machine's cores, so a real
stream run cannot beat it, and a cpu_busy near 1 says a real ratio is held by the cores, not the schedule. The full run repeats
every mode twice (ABCDEF FEDCBA, real modes first and each next to the one it is compared with) and
reports means.
"""

from __future__ import annotations

import bisect
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.benches.pipeline_costs import (
    _quantile,
    load_1m,
    measure_costs,
    measure_spec_speedup,
    pretrain_drafter,
)

RATIO_TARGET = 1.0
MODELLED_RATIO_TARGET = 2.0
NUM_GENERATORS = 2
BARRIER = ("--train.early_backward", "false")  # sync: the whole batch generated, then the whole step
PLAIN = ("--generator.speculation", "off")  # the default (auto) may speculate: the plain modes say off
MODES = {  # name -> (controller.max_staleness, modelled compute, extra overrides), in the order they run
    # Real runs first and each beside what it is compared with (the full run mirrors the order, so every
    # mode's mean position is the same, but runs in the middle of it were measured 4-10% slower than at
    # its ends on this machine: stream-spans, less work than stream, came out slower); the modelled runs,
    # sleeps that the machine's drift barely moves, in the middle.
    "sync": (0, False, (*BARRIER, *PLAIN)),
    "stream": (1, False, PLAIN),
    "stream+default": (1, False, ()),  # the default settings (speculation auto), against plain stream
    # telemetry's cost: stream without spans (metrics.spans false), against stream
    "stream-spans": (1, False, ("--metrics.spans", "false", *PLAIN)),
    "stream_barrier": (1, False, (*BARRIER, *PLAIN)),
    # speculation: from a drafter trained before the runs (as the defaults use it; also trained in idle
    # turns), and from an untrained one
    "stream+spec": (1, False, ("--generator.drafter_path", "{drafter}")),
    "stream+spec_train": (1, False, ("--generator.speculation", "on", "--generator.drafter_path", "{drafter}")),
    "stream+spec_cold": (1, False, ("--generator.speculation", "on")),
    "modelled_sync": (0, True, BARRIER),
    "modelled_stream": (1, True, ()),
    # the scheduling rule's own gain: stream with the barrier inside the step (train.early_backward false)
    "modelled_stream_barrier": (1, True, BARRIER),
    "modelled_stream_s2": (2, True, ()),  # a looser bound: what max_staleness 1 costs on this workload
    "modelled_stream_s4": (4, True, ()),  # looser still (AReaL's runs go to 4 and beyond)
    # modelled_stream with speculation's measured speedup (measure_spec_speedup), free of the CPU it shares
    "modelled_stream+spec": (1, "spec", ()),
}
_fork = multiprocessing.get_context("fork")


@dataclass(frozen=True)
class Workload:
    steps: int
    groups_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 64
    max_batch_size: int = 32
    model_path: str = ""  # "" = the shipped tiny model; a shipped name (engine/core/models.py) or a folder
    task: str = ""  # "" = the default task
    # The modelled modes cost sleeps, not CPU: enough steps that pipeline fill is small. The first step's
    # rollout overlaps nothing, and modelled_ratio_bound leaves it out: at 12 steps it was ~7% of a modelled
    # stream run on the default workload, so scheduler_efficiency could not pass ~0.93 whatever the schedule.
    modelled_steps: int = 24

    def overrides(self) -> list[str]:
        return ["--train.steps", str(self.steps), "--train.groups_per_step", str(self.groups_per_step),
                "--sampling.group_size", str(self.group_size), "--sampling.max_new_tokens", str(self.max_new_tokens),
                "--generator.max_batch_size", str(self.max_batch_size),
                *(["--model.path", self.model_path] if self.model_path else []),
                *(["--data.task", self.task] if self.task else [])]

    def config(self):
        from tailrace.engine.config import load_config

        return load_config(None, self.overrides())


def workload(name: str, quick: bool) -> Workload:
    """default: the default task on the shipped tiny model. longtail: like the papers' (response lengths
    with p99 / median >= 8, rollout most of a synchronous step): the reverse_longtail task (engine/data/tasks.py),
    max_new_tokens 256, on the shipped 12-layer policy trained on that task (examples/tiny_longtail, model
    name "tiny_longtail"; recipe in tools/make_tiny_model.py), 4 groups of 8 per step."""
    if name == "default":
        return Workload(steps=3 if quick else 12)
    if name == "longtail":
        return Workload(steps=4 if quick else 12, groups_per_step=4, max_new_tokens=256, task="reverse_longtail",
                        model_path="tiny_longtail")
    raise ValueError(f"--workload: {name!r} is not one of default, longtail")


# ---------------------------------------------------------------------------------------- processes


def _preload(model_path: str) -> None:
    """Heavy imports, once, before any fork; no torch op and no ZeroMQ context here (neither survives fork)."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    import importlib

    import torch
    from transformers import AutoConfig

    from tailrace.engine.core import models

    torch.set_num_threads(1)
    for module in ("tailrace.engine.cli", "tailrace.engine.trainer.main", "tailrace.engine.trainer.service",
                   "tailrace.engine.generator.main", "tailrace.engine.generator.service", "tailrace.protocol.transport",
                   "tools.benches.modelled"):
        importlib.import_module(module)
    model_type = AutoConfig.from_pretrained(models.resolve_model_path(model_path)).model_type
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _redirect(log_path: Path) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _role(argv: list[str], log_path: Path, costs_path: Path | None) -> None:
    """A forked child: `tailrace ARGV`, its output in log_path; with costs_path, its compute modelled."""
    _redirect(log_path)
    if costs_path is None:
        from tailrace.engine.cli import main

        sys.exit(main(argv))
    from tools.benches.modelled import role_main

    sys.exit(role_main(argv, costs_path))


def _watcher(address: str, steps: int, out: Path, ready: Path, log_path: Path) -> None:
    """A forked child: a tool on the notice socket recording (time.monotonic, system-wide) when generators
    join and when each policy version is published; writes them to `out` as JSON."""
    _redirect(log_path)
    from tailrace.protocol import messages as m
    from tailrace.protocol.transport import Client, TransportError, run

    async def watch() -> dict[str, float]:
        times: dict[str, float] = {}
        async with Client(address, role="tool", name=f"bench-pipeline-{os.getpid()}") as client:
            await client.connect(timeout_s=30.0)
            await client.subscribe()
            await client.recv_notice()  # the subscription is live: the trainer's Stats reached us
            ready.touch()
            while f"v{steps}" not in times:
                try:
                    msg = await client.recv_notice()
                except TransportError:
                    break
                now = time.monotonic()
                if isinstance(msg, m.Event) and msg.event == "peer_joined" and msg.fields.get("role") == "generator":
                    times.setdefault("first_join", now)
                    times["last_join"] = now
                elif isinstance(msg, m.WeightsNotice) and msg.model == "policy":
                    times.setdefault(f"v{msg.version}", now)
        return times

    out.write_text(json.dumps(run(watch())))


def _start(target: Callable, *args) -> multiprocessing.Process:
    proc = _fork.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _wait(proc: multiprocessing.Process, done: Callable[[], bool], deadline: float, what: str, log_path: Path) -> None:
    while not done():
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} (exit code {proc.exitcode}):\n{_tail(log_path)}")
        time.sleep(0.02)


def _read_json(path: Path) -> dict | None:
    """The file's JSON, or None while it does not exist or is still being written."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


def _stop(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
            proc.join()


class CpuSampler:
    """CPU seconds (user + system, every thread) of a set of processes, sampled from /proc every
    PERIOD_S in a thread of this process, so that a run's CPU can be read between two instants of the
    timing tool's clock (time.monotonic, system-wide) without asking the roles. The kernel counts in
    clock ticks (10 ms): over a run of a few seconds that is about 1%."""

    PERIOD_S = 0.02

    def __init__(self):
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), CPU seconds of all the processes)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pids: list[int]) -> None:
        last = dict.fromkeys(pids, 0)  # clock ticks; a process that exited keeps its last count

        def loop() -> None:
            while not self._done.is_set():
                now = time.monotonic()
                for pid in pids:
                    try:
                        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                    except OSError:
                        continue
                    last[pid] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
                self.samples.append((now, sum(last.values()) / os.sysconf("SC_CLK_TCK")))
                self._done.wait(self.PERIOD_S)

        self._thread = threading.Thread(target=loop, name="cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def at(self, when: float) -> float:
        """CPU seconds at `when`, interpolated between the samples around it (clamped to the ends)."""
        samples = self.samples
        if not samples:
            return float("nan")
        i = bisect.bisect_left(samples, (when, float("-inf")))
        if i == 0:
            return samples[0][1]
        if i == len(samples):
            return samples[-1][1]
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def seconds_between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


def run_pipeline(runs_dir: Path, name: str, args: list[str], steps: int, timeout_s: float,
                 costs_path: Path | None = None, env_server: str = "") -> dict:
    """One run: trainer, NUM_GENERATORS generators and the timing tool as processes, their compute modelled
    by costs_path when one is given; with env_server (module:Class), also that environment server
    (`tailrace env`, multi-turn runs: tools/benches/multiturn.py). Returns its figures."""
    common = [*args, "--trainer.runs_dir", str(runs_dir), "--trainer.run_name", name]
    run_dir = runs_dir / name
    run_dir.mkdir(parents=True)
    deadline = time.monotonic() + timeout_s
    cpu = CpuSampler()
    trainer_log = run_dir / "trainer.log"
    trainer = _start(_role, ["trainer", "--trainer.bind", "tcp://127.0.0.1:0", *common], trainer_log, costs_path)
    procs = [trainer]
    try:
        endpoint = run_dir / "endpoint.json"
        _wait(trainer, lambda: _read_json(endpoint) is not None, deadline, f"{name}: the trainer did not start",
              trainer_log)
        address = _read_json(endpoint)["address"]
        times_path, ready = run_dir / "times.json", run_dir / "watcher.ready"
        watcher = _start(_watcher, address, steps, times_path, ready, run_dir / "watcher.log")
        procs.append(watcher)
        _wait(watcher, ready.is_file, deadline, f"{name}: the timing tool did not connect", run_dir / "watcher.log")
        for i in range(NUM_GENERATORS):
            procs.append(_start(_role, ["generator", "--connect", address, "--name", f"gen-{i}", *common],
                                run_dir / f"gen-{i}.log", costs_path))
        cpu.start([trainer.pid, *(p.pid for p in procs[2:])])
        if env_server:  # after the generators: procs[2:2 + NUM_GENERATORS] stay theirs (an episode's reset waits
            # env.wait_for_server_s for it to attach)
            procs.append(_start(_role, ["env", env_server, "--connect", address, "--name", "env-0"],
                                run_dir / "env-0.log", None))
        trainer.join(timeout=max(0.0, deadline - time.monotonic()))
        if trainer.exitcode != 0:
            raise RuntimeError(f"{name}: the trainer {'timed out' if trainer.is_alive() else 'failed'} "
                               f"(exit code {trainer.exitcode}):\n{_tail(trainer_log)}")
        for proc in procs[1:2 + NUM_GENERATORS]:  # an environment server is stopped below
            proc.join(timeout=20)
    finally:
        cpu.stop()
        _stop(procs)
    summary = json.loads((run_dir / "summary.json").read_text())
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    if f"v{steps}" not in times or "first_join" not in times:
        raise RuntimeError(f"{name}: the timing tool missed the start or the end of the run: {times}")
    seconds = times[f"v{steps}"] - times["first_join"]
    gens = summary["generator_time_s"].values()
    busy, wall = sum(g["busy_s"] for g in gens), sum(g["wall_s"] for g in gens)
    telemetry = sum(g.get("telemetry_s", 0.0) for g in gens)
    return {"seconds": seconds, "join_spread_s": times["last_join"] - times["first_join"],
            "idle_trainer": 1.0 - summary["trainer_busy_s"] / seconds, "trainer_busy_s": summary["trainer_busy_s"],
            "generator_busy_s": [g["busy_s"] for g in gens],
            "cpu_s": cpu.seconds_between(times["first_join"], times[f"v{steps}"]),
            "idle_generators": 1.0 - busy / wall if wall else float("nan"),
            "telemetry_frac": telemetry / wall if wall else float("nan"),
            "samples_trained": summary["samples_trained"], "discarded": summary["discarded"],
            "max_staleness_seen": summary["max_staleness_seen"],
            "generator_exit_codes": [p.exitcode for p in procs[2:2 + NUM_GENERATORS]],
            "env_calls": sum(g.get("env_calls", 0.0) for g in gens), "env_wait_s": sum(g.get("env_wait_s", 0.0) for g in gens)}


# ---------------------------------------------------------------------------------------- the benchmark


def _timeline(run_dir: Path, mode: str, out: Path, traces: dict[str, list[dict]]) -> None:
    """The run's timeline into out/MODE (its first run only); sync and stream also side by side."""
    from tools.timeline import load_trace, write

    if mode in traces or not (run_dir / "trace.jsonl").is_file():
        return
    traces[mode] = load_trace(run_dir)
    write([(mode, traces[mode])], out / mode)
    if "sync" in traces and "stream" in traces and mode in ("sync", "stream"):
        write([("sync", traces["sync"]), ("stream", traces["stream"])], out / "sync_vs_stream")


def run(quick: bool, log: Callable[[str], None], timeline: Path | None = None, workload_name: str = "default") -> dict:
    w = workload(workload_name, quick)
    work = Path(tempfile.mkdtemp(prefix="tailrace-bench-pipeline-"))
    log(f"workload {workload_name}: {w}; load (1 min) {load_1m()} on {os.cpu_count()} cores; files in {work} "
        "(removed unless the benchmark fails)")
    _preload(w.model_path or "tiny")
    costs_path = work / "costs.json"
    measure = _start(measure_costs, w, costs_path, quick, log)
    measure.join()
    if measure.exitcode != 0:
        raise RuntimeError(f"measuring the costs failed (exit code {measure.exitcode})")
    drafter_dir = work / "drafter"
    pretrain = _start(pretrain_drafter, w, drafter_dir, quick, log)
    pretrain.join()
    if pretrain.exitcode != 0:
        raise RuntimeError(f"training the drafter failed (exit code {pretrain.exitcode})")
    spec_costs_path = work / "costs_spec.json"
    measure = _start(measure_spec_speedup, w, drafter_dir, costs_path, spec_costs_path, quick, log)
    measure.join()
    if measure.exitcode != 0:
        raise RuntimeError(f"measuring the speculative speedup failed (exit code {measure.exitcode})")
    # The full run repeats the modes in mirrored order (ABC CBA), so a drift in the machine's other
    # load weighs on every mode alike.
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    traces: dict[str, list[dict]] = {}
    for i, mode in enumerate(list(MODES) if quick else [*MODES, *reversed(MODES)]):
        staleness, modelled, extra = MODES[mode]
        steps = w.modelled_steps if modelled else w.steps
        args = [*w.overrides(), "--train.steps", str(steps), "--controller.max_staleness", str(staleness),
                "--reward.mode", "builtin",
                "--trainer.stats_interval_s", "0.2", *(arg.replace("{drafter}", str(drafter_dir)) for arg in extra)]
        load = load_1m()
        r = run_pipeline(work / "runs", f"{i}-{mode}", args, steps, timeout_s=120 if quick else 600,
                         costs_path=spec_costs_path if modelled == "spec" else costs_path if modelled else None)
        r["load_1m"] = load
        results[mode].append(r)
        if timeline is not None:
            _timeline(work / "runs" / f"{i}-{mode}", mode, timeline, traces)
        log(f"{mode:16s} {r['seconds']:7.2f} s   idle: trainer {r['idle_trainer']:.2f}, generators "
            f"{r['idle_generators']:.2f}   samples {r['samples_trained']}   generators joined "
            f"{r['join_spread_s']:.2f} s apart   load {load}")
    from tools.benches.modelled import load_costs

    out = {"workload": workload_name, **figures(w, load_costs(costs_path), results)}
    shutil.rmtree(work, ignore_errors=True)
    return out


def _mean(runs: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def figures(w: Workload, costs, results: dict[str, list[dict]]) -> dict:
    s, t = _mean(results["sync"], "seconds"), _mean(results["stream"], "seconds")
    ms, mt = _mean(results["modelled_sync"], "seconds"), _mean(results["modelled_stream"], "seconds")
    trained = {modelled: {r["samples_trained"] for mode, runs in results.items() for r in runs
                          if bool(MODES[mode][1]) == modelled} for modelled in (False, True)}
    # No schedule of the stream run's work beats its busiest process: trainer or one generator.
    busiest = statistics.fmean(max(r["trainer_busy_s"], *r["generator_busy_s"]) for r in results["modelled_stream"])
    lengths = sorted(c.completion_tokens for c in costs.completions)
    out = {"sync_s": round(s, 3), "stream_s": round(t, 3), "ratio": round(s / t, 3),
           "modelled_sync_s": round(ms, 3), "modelled_stream_s": round(mt, 3), "modelled_ratio": round(ms / mt, 3)}
    # The real runs share this machine's cores: a stream run cannot end before the CPU seconds its processes
    # spent, spread over every core (ratio_bound_cpu); cpu_s and cpu_busy (that over cores x wall) per real mode.
    cores = len(os.sched_getaffinity(0))
    real = [mode for mode in results if not MODES[mode][1]]
    stream_cpu_s = _mean(results["stream"], "cpu_s")
    out |= {"cores": cores, "ratio_bound_cpu": round(s / (stream_cpu_s / cores), 3),
            "cpu_s": {mode: round(_mean(results[mode], "cpu_s"), 3) for mode in real},
            "cpu_busy": {mode: round(statistics.fmean(r["cpu_s"] / (cores * r["seconds"]) for r in results[mode]), 3)
                         for mode in real}}
    spec_s, cold_s = _mean(results["stream+spec"], "seconds"), _mean(results["stream+spec_cold"], "seconds")
    train_s = _mean(results["stream+spec_train"], "seconds")
    default_s = _mean(results["stream+default"], "seconds")
    nospans_s = _mean(results["stream-spans"], "seconds")
    out |= {"stream_nospans_s": round(nospans_s, 3), "spans_ratio": round(nospans_s / t, 3),
            "telemetry_frac": round(statistics.fmean(r["telemetry_frac"] for m in ("stream", "sync")
                                                     for r in results[m]), 6),
            "telemetry_target_frac": 0.01}
    out |= {"stream_spec_s": round(spec_s, 3), "spec_ratio": round(s / spec_s, 3),
            "stream_spec_train_s": round(train_s, 3), "spec_ratio_train": round(s / train_s, 3),
            "stream_spec_cold_s": round(cold_s, 3), "spec_ratio_cold": round(s / cold_s, 3),
            "stream_default_s": round(default_s, 3), "default_vs_plain": round(t / default_s, 3)}
    for key in ("idle_trainer", "idle_generators"):
        out |= {f"{key}_{mode}": round(_mean(runs, key), 3) for mode, runs in results.items()}
    out |= {f"samples_trained_{mode}": runs[0]["samples_trained"] for mode, runs in results.items()}
    barrier_s, mbarrier_s = _mean(results["stream_barrier"], "seconds"), _mean(results["modelled_stream_barrier"], "seconds")
    out |= {"stream_barrier_s": round(barrier_s, 3), "early_backward_gain": round(barrier_s / t, 3),
            "modelled_stream_barrier_s": round(mbarrier_s, 3), "modelled_ratio_barrier": round(ms / mbarrier_s, 3),
            "modelled_early_backward_gain": round(mbarrier_s / mt, 3)}
    s2_s = _mean(results["modelled_stream_s2"], "seconds")
    s4_s = _mean(results["modelled_stream_s4"], "seconds")
    out |= {"modelled_stream_s2_s": round(s2_s, 3), "modelled_ratio_s2": round(ms / s2_s, 3),
            "modelled_stream_s4_s": round(s4_s, 3), "modelled_ratio_s4": round(ms / s4_s, 3)}
    mspec_s = _mean(results["modelled_stream+spec"], "seconds")
    out |= {"modelled_stream_spec_s": round(mspec_s, 3), "modelled_spec_ratio": round(ms / mspec_s, 3),
            "modelled_spec_over_stream": round(mt / mspec_s, 3),
            "spec_speedup_by_batch": {b: round(x, 3) for b, x in sorted(costs.spec_speedup.items())}}
    out |= {"samples_equal": all(len(v) == 1 for v in trained.values()),
            "ratio_target": RATIO_TARGET, "ratio_met": s / t > RATIO_TARGET,
            "modelled_ratio_target": MODELLED_RATIO_TARGET, "modelled_ratio_met": ms / mt >= MODELLED_RATIO_TARGET,
            "modelled_ratio_bound": round(ms / busiest, 3),
            "runs_per_mode": len(results["sync"]), "steps": w.steps, "modelled_steps": w.modelled_steps,
            "groups_per_step": w.groups_per_step,
            "group_size": w.group_size, "max_new_tokens": w.max_new_tokens, "max_batch_size": w.max_batch_size,
            "max_staleness_seen": {mode: max(r["max_staleness_seen"] for r in runs) for mode, runs in results.items()},
            "staleness_within_bound": all(r["max_staleness_seen"] <= MODES[mode][0] for mode, runs in results.items()
                                          for r in runs),
            "decode_step_ms_b1": round(1e3 * statistics.median(costs.decode_step_s[1]), 3),
            f"decode_step_ms_b{w.max_batch_size}": round(1e3 * statistics.median(costs.decode_step_s[w.max_batch_size]), 3),
            "train_ms_per_1k_padded_tokens": round(1e3 * costs.train(1000), 1),
            "completion_len_median": statistics.median(lengths), "completion_len_p99": _quantile(lengths, 0.99),
            "completion_len_p99_over_median": round(_quantile(lengths, 0.99) / statistics.median(lengths), 2),
            # Of a synchronous step, the share that is not the trainer's: rollout (and weights out).
            "rollout_share_sync": round(_mean(results["sync"], "idle_trainer"), 3),
            "rollout_share_modelled_sync": round(_mean(results["modelled_sync"], "idle_trainer"), 3),
            "scheduler_efficiency": round((ms / mt) / (ms / busiest), 3),
            "num_layers": costs.info.get("num_layers"), "task": w.task or "default",
            "measure_wall_over_cpu": round(costs.info.get("wall_over_cpu", float("nan")), 2),
            "load_1m": {mode: [r["load_1m"] for r in runs] for mode, runs in results.items()}}
    return out
