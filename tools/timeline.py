"""Timeline of a tailrace run: what every process did when, as a Perfetto / chrome://tracing trace and a PNG.

    python tools/timeline.py --run runs/NAME                      # writes runs/NAME/timeline.{json,png}
    python tools/timeline.py --run runs/sync --run runs/stream --out DIR   # two runs, one above the other
    python tools/timeline.py --connect tcp://127.0.0.1:5555 --seconds 30 --out DIR

Reads the spans, counters and events that runs/NAME/trace.jsonl holds (engine/trainer/trace.py), or listens
to a live trainer's notice socket for --seconds. timeline.json is Chrome trace-event JSON: one process per
tailrace process, one thread per track, "X" spans, "C" counters (queues, running batch, staleness, in
flight), "i" events; open it at https://ui.perfetto.dev. timeline.png (matplotlib) draws one lane per
process, a colour per state, so that the long tail (a lone decode lane while the others idle) and the
bubbles (the trainer waiting for data, generators parked by the staleness gate) show at a glance.
Test: pytest tests/tools/test_timeline.py
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLOURS = {  # state -> colour: busy states saturated, waiting states pale or red
    "decode": "#1f77b4", "spec_decode": "#6a3d9a", "prefill": "#ff7f0e", "weights_swap": "#17becf",
    "drafter_training": "#e377c2", "idle_parked": "#d62728", "idle_no_work": "#d9d9d9",
    "train_step": "#2ca02c", "wait_data": "#f4a6a6", "weights_gather": "#17becf", "serve_weights": "#9edae5",
    "checkpoint": "#8c564b", "scoring": "#bcbd22",
}
ROLE_ORDER = {"trainer": 0, "generator": 1, "reward": 2}


def load_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "trace.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: runs write it from this version on (metrics.spans = true)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash: the rest still counts
            continue
    return records


def listen(address: str, seconds: float, key: bytes | None = None) -> tuple[str, list[dict]]:
    """(run id, trace records) of what a live trainer publishes during `seconds`."""
    import asyncio

    from tailrace.engine.trainer.trace import records
    from tailrace.protocol.transport import Client, TransportError, run

    async def go() -> tuple[str, list[dict]]:
        out: list[dict] = []
        async with Client(address, role="tool", name=f"timeline-{os.getpid()}", curve_server_key=key) as client:
            welcome = await client.connect(timeout_s=10.0)
            await client.subscribe()
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                try:
                    out += records(await asyncio.wait_for(client.recv_notice(), timeout=left))
                except (TimeoutError, TransportError):  # the window ended, or the run did
                    break
        return welcome.run_id, out

    return run(go())


def lanes(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(process name, track) -> its spans sorted by start, processes in role order (trainer first)."""
    roles = {r["name"]: r["role"] for r in records if "role" in r}
    out: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "span":
            out[(r["name"], r["track"])].append(r)
    for spans in out.values():
        spans.sort(key=lambda s: s["start_wall_s"])
    return dict(sorted(out.items(), key=lambda kv: (ROLE_ORDER.get(roles.get(kv[0][0]), 3), kv[0])))


def trim(records: list[dict]) -> list[dict]:
    """The records from when the first other process began: before that the trainer only waits for its
    generators to load their models, which would squeeze the run itself into a corner of the picture."""
    starts = [r["start_wall_s"] for r in records if r["kind"] == "span" and r["role"] != "trainer"]
    if not starts:
        return records
    t0, out = min(starts), []
    for r in records:
        if r["kind"] == "span":
            end = r["start_wall_s"] + r["duration_s"]
            if end <= t0:
                continue
            r = r | {"start_wall_s": max(t0, r["start_wall_s"]), "duration_s": end - max(t0, r["start_wall_s"])}
        elif r["wall_s"] < t0:
            continue
        out.append(r)
    return out


def _us(wall_s: float, t0: float) -> int:
    return round((wall_s - t0) * 1e6)


def chrome_trace(runs: list[tuple[str, list[dict]]]) -> dict:
    """Chrome trace-event JSON of one or more runs (label, records); each run's time starts at 0."""
    events: list[dict] = []
    pid = 0
    for label, records in runs:
        t0 = min((r.get("start_wall_s", r.get("wall_s", 0.0)) for r in records), default=0.0)
        pids: dict[str, int] = {}
        tids: dict[tuple[str, str], int] = {}
        for (name, track), spans in lanes(records).items():
            if name not in pids:
                pid += 1
                pids[name] = pid
                title = f"{label}: {name}" if len(runs) > 1 else name
                events += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": title}},
                           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
            tid = tids[(name, track)] = len([k for k in tids if k[0] == name]) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pids[name], "tid": tid, "args": {"name": track}})
            for s in spans:
                ts = _us(s["start_wall_s"], t0)
                events.append({"ph": "X", "name": s["state"], "cat": s["role"], "ts": ts,
                               "dur": _us(s["start_wall_s"] + s["duration_s"], t0) - ts, "pid": pids[name], "tid": tid,
                               "args": {"value": s["value"]} if s["value"] else {}})
        for r in records:
            if r["kind"] == "counters" and r["name"] in pids:
                for key, value in r["counters"].items():
                    events.append({"ph": "C", "name": key, "ts": _us(r["wall_s"], t0), "pid": pids[r["name"]],
                                   "tid": 0, "args": {"value": value}})
            elif r["kind"] == "event":
                events.append({"ph": "i", "s": "g", "name": r["event"], "ts": _us(r["wall_s"], t0),
                               "pid": pids.get(r["name"], 1), "tid": 0, "args": {"text": r["text"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _draw_lanes(ax, label: str, records: list[dict], t0: float) -> set[str]:
    """One run's lanes on `ax`; a reward server's concurrency slots share its lane. Returns the states drawn."""
    rows: dict[str, list[dict]] = collections.defaultdict(list)
    for (name, track), spans in lanes(records).items():
        rows[name if track.startswith("slot-") or track == "main" else f"{name} {track}"] += spans
    seen = set()
    for y, spans in enumerate(reversed(list(rows.values()))):
        by_state: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for s in spans:
            by_state[s["state"]].append((s["start_wall_s"] - t0, max(s["duration_s"], 1e-4)))
        for state, bars in by_state.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLOURS.get(state, "#7f7f7f"), linewidth=0)
        seen |= set(by_state)
    ax.set_yticks(range(len(rows)), list(reversed(list(rows))))
    ax.set_title(label, loc="left", fontsize=10)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    return seen


def plot(runs: list[tuple[str, list[dict]]], out: str | Path) -> Path:
    """timeline.png: one panel per run (stacked, same time scale), one lane per process, colour per state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [max(1, len({k[0] for k in lanes(r)})) for _, r in runs]
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False, figsize=(11, 1.0 + 0.45 * sum(heights) + 0.5 * len(runs)),
                             gridspec_kw={"height_ratios": heights})
    seen: set[str] = set()
    for ax, (label, records) in zip(axes[:, 0], runs, strict=True):
        spans = [r for r in records if r["kind"] == "span"]
        t0 = min((s["start_wall_s"] for s in spans), default=0.0)
        end = max((s["start_wall_s"] + s["duration_s"] - t0 for s in spans), default=0.0)
        seen |= _draw_lanes(ax, f"{label}  ({end:.1f} s)", records, t0)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first generator or reward server began")
    handles = [Patch(color=COLOURS.get(s, "#7f7f7f"), label=s) for s in COLOURS if s in seen]
    handles += [Patch(color="#7f7f7f", label=s) for s in sorted(seen - set(COLOURS))]
    fig.legend(handles=handles, loc="upper center", ncol=min(7, len(handles)) or 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if len(handles) <= 7 else 0.89))
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def write(runs: list[tuple[str, list[dict]]], out_dir: str | Path) -> tuple[Path, Path]:
    """timeline.json and timeline.png of `runs` in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(label, trim(records)) for label, records in runs]
    json_path = out_dir / "timeline.json"
    json_path.write_text(json.dumps(chrome_trace(runs)))
    return json_path, plot(runs, out_dir / "timeline.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Perfetto trace and PNG timeline of a tailrace run.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="append", help="a run folder (runs/NAME); twice: side by side")
    source.add_argument("--connect", help="a live trainer's address: record --seconds of it")
    parser.add_argument("--seconds", type=float, default=30.0, help="with --connect: how long to record")
    parser.add_argument("--out", default="", help="folder for timeline.json/.png (default: the (first) run folder)")
    parser.add_argument("--curve-server-key", default="", help="file with the trainer's CURVE public key")
    args = parser.parse_args(argv)
    try:
        if args.connect:
            key = Path(args.curve_server_key).read_bytes().strip() if args.curve_server_key else None
            run_id, records = listen(args.connect, args.seconds, key)
            runs, out = [(run_id, records)], args.out or f"timeline-{run_id}"
        else:
            runs, out = [(Path(r).name, load_trace(r)) for r in args.run], args.out or args.run[0]
    except (ValueError, OSError, TimeoutError) as exc:
        print(f"timeline: {exc}", file=sys.stderr)
        return 1
    if not any(r["kind"] == "span" for _, records in runs for r in records):
        print("timeline: no spans recorded", file=sys.stderr)
        return 1
    for path in write(runs, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
