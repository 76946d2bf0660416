"""Live view of a tailrace pipeline: one snapshot of every process's published state.

    python tools/top.py --connect tcp://127.0.0.1:5555 --once --json

Connects as a read-only tool, listens to the trainer's notice socket for one round of Stats (every
process publishes one per trainer.stats_interval_s) and prints them: role, name, state, policy version,
queue depths and throughput (and speculation's acceptance and drafter version on generators that
speculate). Without --once it refreshes until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


async def collect(address: str, window_s: float, curve_server_key: bytes | None = None) -> dict:
    """Stats of every process seen within window_s on the notice socket, keyed by name."""
    from tailrace.protocol import messages as m
    from tailrace.protocol.transport import Client

    snapshot: dict[str, dict] = {}
    async with Client(address, role="tool", name=f"top-{os.getpid()}", curve_server_key=curve_server_key) as client:
        welcome = await client.connect(timeout_s=10.0)
        await client.subscribe()
        deadline = time.monotonic() + window_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await asyncio.wait_for(client.recv_notice(), timeout=left)
            except TimeoutError:
                break
            if isinstance(msg, m.Stats):
                snapshot[msg.name] = {"role": msg.role, "state": msg.state, "policy_version": msg.policy_version,
                                      "wall_s": msg.wall_s, "counters": msg.counters}
    return {"run_id": welcome.run_id, "address": address, "processes": snapshot}


def render(snapshot: dict) -> str:
    lines = [f"run {snapshot['run_id']} at {snapshot['address']}",
             f"{'name':<14}{'role':<11}{'state':<17}{'version':>8}  highlights"]
    for name, s in sorted(snapshot["processes"].items(), key=lambda kv: (kv[1]["role"] != "trainer", kv[0])):
        c = s["counters"]
        if s["role"] == "trainer":
            hi = (f"step {c.get('trainer/step', 0):.0f}/{c.get('trainer/steps_total', 0):.0f}  "
                  f"reward {c.get('trainer/reward/last', float('nan')):.3f}  "
                  f"in flight {c.get('trainer/controller/groups_in_flight', 0):.0f} groups  "
                  f"staleness<= {c.get('trainer/controller/max_staleness_seen', 0):.0f}")
        elif s["role"] == "generator":
            hi = (f"running {c.get('generator/queue/running', 0):.0f}  waiting {c.get('generator/queue/waiting', 0):.0f}"
                  f"  {c.get('generator/throughput/wall_tokens_per_s', 0):.0f} tok/s")
            if c.get("generator/spec/spec_steps", 0):
                hi += (f"  spec: {c.get('generator/spec/mean_accept_len', 0):.2f} drafts accepted/step "
                       f"({c.get('generator/spec/accept_rate', 0):.0%}), drafter v"
                       f"{c.get('generator/spec/drafter_version', 0):.0f}")
        else:
            hi = "  ".join(f"{k.rsplit('/', 1)[-1]} {v:g}" for k, v in list(c.items())[:4])
        lines.append(f"{name:<14}{s['role']:<11}{s['state']:<17}{s['policy_version']:>8}  {hi}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Snapshot or live view of a tailrace pipeline.")
    parser.add_argument("--connect", required=True, help="the trainer's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print the snapshot as one JSON object")
    parser.add_argument("--window-s", type=float, default=2.5,
                        help="how long to listen for a round of Stats (default 2.5, > trainer.stats_interval_s)")
    parser.add_argument("--curve-server-key", default="", help="file with the trainer's CURVE public key")
    args = parser.parse_args(argv)
    from tailrace.protocol.transport import run

    key = Path(args.curve_server_key).read_bytes().strip() if args.curve_server_key else None
    try:
        while True:
            snapshot = run(collect(args.connect, args.window_s, key))
            print(json.dumps(snapshot) if args.json else render(snapshot), flush=True)
            if args.once:
                return 0
            if not args.json:
                print()
    except KeyboardInterrupt:
        return 0
    except (TimeoutError, ConnectionError, OSError) as exc:
        print(f"top: cannot reach {args.connect}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
