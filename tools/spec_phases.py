"""Where a speculative step's time goes: plain and speculative decode steps of the torch backend, interleaved
in one process (so both see the same machine), timed per phase in thread CPU time (less disturbed by other
processes than wall clock), with the ops each phase dispatches.

    python tools/make_tiny_model.py --deepen 12 --out /tmp/tiny12
    python tools/spec_phases.py --model /tmp/tiny12 --k 8 --batch 1 --steps 200

Phases: draft (drafter catch-up, k - 1 draft forwards, the draws), verify (policy forward over k + 1 tokens,
LM head, processed log-probs), policy_forward (inside verify, and the whole of a plain step's forward),
accept (the acceptance rule), commit (cache bookkeeping); step is the whole backend step. The drafter is
fresh (untrained): per-step costs do not depend on what it drafts, only the emitted tokens do. Ops are
counted for one step, below autograd (aten ops, views included), the policy forward apart.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))


def _instrument(seconds: dict, phase: list) -> None:
    """Accumulate thread CPU seconds per phase and keep the innermost phase's name in phase[-1]."""
    from tailrace.engine.generator.speculation import speculative
    from tailrace.engine.generator.torch_backend import backend

    targets = [(speculative.SpeculativeDecoder, "_draft", "draft"), (speculative.SpeculativeDecoder, "_verify", "verify"),
               (speculative.SpeculativeDecoder, "commit", "commit"), (speculative, "accept_drafts_q_probs", "accept"),
               (backend.TorchBackend, "_forward", "policy_forward")]
    for owner, name, label in targets:
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            phase.append(_label)
            start = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_label] += time.thread_time() - start
                phase.pop()

        setattr(owner, name, functools.wraps(inner)(timed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="policy checkpoint (default: the shipped tiny model)")
    parser.add_argument("--k", type=int, default=8, help="speculation depth (eagle@k)")
    parser.add_argument("--batch", type=int, default=1, help="running batch size")
    parser.add_argument("--steps", type=int, default=200, help="timed steps of each backend")
    args = parser.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tailrace.engine.core.drafter import Drafter
    from tailrace.engine.core.models import load_model
    from tailrace.engine.generator.speculation.speculative import FixedDepth
    from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
    from tailrace.protocol.messages import SamplingParams

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[phase[-1]] += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)  # a generator's setting, as in tools/bench.py spec
    seconds, ops, phase = collections.defaultdict(float), collections.Counter(), ["other"]
    _instrument(seconds, phase)
    model = load_model(args.model).requires_grad_(False)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=200)
    backends = {"plain": TorchBackend(model, max_batch_size=args.batch, max_model_len=256, seed=1),
                "spec": TorchBackend(model, max_batch_size=args.batch, max_model_len=256, seed=1)}
    backends["spec"].enable_speculation(Drafter.for_policy(model, seed=0), FixedDepth(args.k), max_traces=0)
    samples = {name: collections.defaultdict(list) for name in backends}
    counts, num_added = {}, 0
    for step in range(args.steps + 1):
        for name, backend in backends.items():
            while backend.num_running + backend.num_waiting < args.batch:
                backend.add(Request(num_added, 0, list(range(3, 30 + num_added % 10)), sampling))
                num_added += 1
            if backend.num_running < args.batch:  # an admitting step: prefill, not timed
                backend.step()
                continue
            seconds.clear()
            ops.clear()
            start = time.thread_time()
            if step == args.steps:  # the last step counts ops (which slows it): not timed
                with torch.inference_mode(), CountOps():
                    backend.step()
                counts[name] = dict(ops)
                continue
            backend.step()
            seconds["step"] = time.thread_time() - start
            for key, value in seconds.items():
                samples[name][key].append(value)
    stats = backends["spec"].spec_stats
    print(f"{args.model}, eagle@{args.k}, batch {args.batch}, {args.steps} steps each; median thread CPU ms per step")
    for name, phases in samples.items():
        print(f"  {name:5s} " + "  ".join(f"{key} {1e3 * statistics.median(v):.3f}" for key, v in phases.items()))
        print(f"        ops: {counts.get(name, {})}")
    print(f"  emitted per speculative step and row: {stats.num_emitted / max(stats.num_spec_steps, 1) / args.batch:.2f}")


if __name__ == "__main__":
    main()
