"""The single entry point for every tailrace benchmark.

    python tools/bench.py NAME [--quick] [--json]
    python tools/bench.py pipeline --timeline DIR   # also a timeline (JSON + PNG) of each mode's run
    python tools/bench.py pipeline --backend vllm   # the runs on torch and on vLLM generators, and the ratio
    python tools/bench.py pipeline --workload longtail   # a long-tail workload like the papers'
    python tools/bench.py spec --workload longtail   # speculation on the 12-layer policy, the 4-layer beside it
    python tools/bench.py --list

Each benchmark is a function `run(quick: bool, log: Callable[[str], None]) -> dict` in a module under
tools/benches/, listed in BENCHES below (imported only when chosen, so one benchmark's heavy imports never
slow another). It logs human-readable progress through `log` and returns its named figures, including
the baseline it measured in the same run and the ratio (every benchmark compares in one run). With --json the last
line printed is that dict as one JSON object, with "bench" set to NAME. --quick finishes in under a
minute on 2 CPU cores.

Adding a benchmark: write tools/benches/NAME.py with run(quick, log), add one line to BENCHES.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCHES: dict[str, str] = {
    "protocol": "tools.benches.protocol:run",  # codec + transport: rollout messages/s, tensor GB/s vs raw zmq
    "spec": "tools.benches.spec:run",  # speculative decoding (bandit; eagle / suffix drafters) vs plain at running batch 1-16
    "pipeline": "tools.benches.pipeline:run",  # sync vs stream, real and modelled compute: wall time ratio
    "replay": "tools.benches.replay:run",  # branch-replay: naive vs replay vs packed step, efficiency vs FLOP ideal
    "faults": "tools.benches.faults:run",  # kill -9 of each role, a silent generator, a fuzz burst vs a clean run
    "scale": "tools.benches.scale:run",  # one step over >= 2.1M logical tokens with a tiny model: time, peak RSS
    "checkpointing": "tools.benches.checkpointing:run",  # train.gradient_checkpointing: saved bytes, heap peak, time vs plain
    "backends": "tools.benches.backends:run",  # raw vLLM vs our vLLM backend vs torch backend: tokens/s, update_ms
    "vllm_spec": "tools.benches.vllm_spec:run",  # vLLM's ngram speculation vs plain vLLM, greedy: tokens/s, ratio
    "weights": "tools.benches.weights:run",
    "multiturn": "tools.benches.multiturn:run",  # multi-turn episodes: replay saving vs single-turn, env wait, sync vs stream  # one version of S MB to N = 1, 2, 4 generators: chunks vs broadcast vs memcpy
}
"""NAME -> "module:function"."""


def load(name: str) -> Callable[..., dict]:
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHES))}")
    module, function = BENCHES[name].split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="benchmark to run: " + ", ".join(sorted(BENCHES)))
    parser.add_argument("--quick", action="store_true", help="smaller sizes; under a minute on 2 CPU cores")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object, last line")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--timeline", default="", help="pipeline: write each mode's timeline (tools/timeline.py) into DIR")
    parser.add_argument("--backend", default="torch", choices=("torch", "vllm"),
                        help="pipeline: vllm runs sync and stream with the generators on vLLM and on torch")
    parser.add_argument("--ranks", type=int, default=1, help="scale: also the same step on this many trainer ranks")
    parser.add_argument("--workload", default="default", choices=("default", "longtail"),
                        help="pipeline: default, or longtail (p99/median >= 8, rollout-dominated, a 12-layer policy); "
                             "spec: longtail measures the 12-layer policy, the 4-layer one beside it")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        print("\n".join(f"{name:12s} {target}" for name, target in sorted(BENCHES.items())))
        return 0
    run = load(args.name)
    if args.backend != "torch":  # the pipeline runs on torch and on vLLM generators: their own module
        if args.name != "pipeline" or args.timeline or args.workload != "default":
            raise SystemExit("--backend vllm: for pipeline only, without --timeline or --workload")
        from tools.benches.pipeline_backends import run
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{args.name} {time.perf_counter() - start:6.1f}s] {text}", flush=True)

    extra = ({"timeline": Path(args.timeline)} if args.timeline else {}) | ({"ranks": args.ranks} if args.ranks > 1 else {})
    extra |= {"workload_name": args.workload} if args.workload != "default" else {}
    figures = {"bench": args.name, **run(quick=args.quick, log=log, **extra), "quick": args.quick,
               "wall_s": round(time.perf_counter() - start, 2)}
    width = max(map(len, figures))
    for key, value in figures.items():
        log(f"{key:{width}s}  {value}")
    if args.json:
        print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
