"""Live view of a tailrace pipeline: every process's state, the trainer's progress and the run's events.

    python tools/top.py --connect tcp://127.0.0.1:5555             # full screen, refreshed in place
    python tools/top.py --connect tcp://127.0.0.1:5555 --once --json

Connects once as a read-only tool and listens on the trainer's notice socket: Stats (every process, one
per trainer.stats_interval_s; reward servers too), Events (peers joining, leaving, dying, stalls, leases
running out) and Shutdown. The full-screen view (rich Live) shows one row per process, the trainer's step,
a reward sparkline, loss and branch-replay saving, and the last events. When the run ends it says "run
finished" and exits 0; when the trainer disappears without a Shutdown it reconnects until it is back.
--once prints one snapshot (text, or JSON with --json) after --window-s seconds and exits.
Test: pytest tests/tools/test_top.py tests/tools/test_live_run.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPARK = "▁▂▃▄▅▆▇█"
RECONNECT_S = 1.0  # between attempts to reach a trainer that went away
STALE_AFTER_S = 5.0  # a row whose last Stats is older than this is dimmed


def sparkline(values: list[float], width: int = 32) -> str:
    values = [v for v in values[-width:] if v == v]  # NaN is no point
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[round((v - lo) / span * (len(SPARK) - 1))] for v in values)


@dataclass
class Board:
    """What top knows: fed one notice at a time (on), read by the views."""

    address: str
    run_id: str = ""
    processes: dict[str, dict] = field(default_factory=dict)
    rewards: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    status: str = "connecting"
    finished: str | None = None
    _last_step: float = -1.0

    def on(self, msg: Any) -> None:
        from tailrace.protocol import messages as m

        if isinstance(msg, m.Stats):
            self.processes[msg.name] = {"role": msg.role, "state": msg.state, "policy_version": msg.policy_version,
                                        "wall_s": msg.wall_s, "counters": msg.counters, "seen_s": time.monotonic()}
            step = msg.counters.get("trainer/step", -1.0)
            if msg.role == "trainer" and step != self._last_step and "trainer/reward/last" in msg.counters:
                self._last_step = step
                self.rewards.append(msg.counters["trainer/reward/last"])
        elif isinstance(msg, m.Event):
            self.events.append((msg.wall_s or time.time(), msg.event, msg.text))
            peer = msg.fields.get("peer")
            if msg.event in ("peer_left", "peer_dead") and peer in self.processes:
                self.processes[peer]["state"] = msg.event.removeprefix("peer_")
        elif isinstance(msg, m.Shutdown):
            self.finished = msg.reason or "run finished"

    def snapshot(self) -> dict:
        return {"run_id": self.run_id, "address": self.address, "processes": {
            name: {k: v for k, v in p.items() if k != "seen_s"} for name, p in self.processes.items()}}


def _ordered(processes: dict[str, dict]) -> list[tuple[str, dict]]:
    rank = {"trainer": 0, "generator": 1, "reward": 2, "env": 3}
    return sorted(processes.items(), key=lambda kv: (rank.get(kv[1]["role"], 4), kv[0]))


def highlights(role: str, c: dict[str, float]) -> str:
    """One line of the counters that matter for a process of `role`."""
    if role == "trainer":
        return (f"step {c.get('trainer/step', 0):.0f}/{c.get('trainer/steps_total', 0):.0f}  "
                f"reward {c.get('trainer/reward/last', float('nan')):.3f}  "
                f"in flight {c.get('trainer/controller/groups_in_flight', 0):.0f} groups  "
                f"staleness<= {c.get('trainer/controller/max_staleness_seen', 0):.0f}")
    if role == "generator":
        hi = (f"running {c.get('generator/queue/running', 0):.0f}  waiting {c.get('generator/queue/waiting', 0):.0f}"
              f"{_on_env(c)}  {c.get('generator/throughput/wall_tokens_per_s', 0):.0f} tok/s")
        if c.get("generator/spec/spec_steps", 0):
            hi += (f"  spec: {c.get('generator/spec/mean_accept_len', 0):.2f} drafts accepted/step "
                   f"({c.get('generator/spec/accept_rate', 0):.0%}), drafter v"
                   f"{c.get('generator/spec/drafter_version', 0):.0f}")
        return hi
    if role in ("reward", "env"):  # reward and environment servers: the same request counters
        return (f"answered {c.get(f'{role}/requests/answered', 0):.0f}  in flight "
                f"{c.get(f'{role}/requests/in_flight', 0):.0f}  latency "
                f"{1e3 * c.get(f'{role}/latency/mean_s', 0):.1f} ms  errors {c.get(f'{role}/requests/errors', 0):.0f}")
    return "  ".join(f"{k.rsplit('/', 1)[-1]} {v:g}" for k, v in list(c.items())[:4])


def _on_env(c: dict[str, float], sep: str = "  ") -> str:
    """Multi-turn generators: the rows parked on an environment's answer (they overlap the others' decoding)."""
    return f"{sep}on env {c['generator/env/waiting']:.0f}" if "generator/env/waiting" in c else ""


def version_of(process: dict) -> str:
    """A process's policy version; reward and environment servers hold no model: blank."""
    return "" if process["role"] in ("reward", "env") else str(process["policy_version"])


def render(snapshot: dict) -> str:
    """The plain-text snapshot (--once without --json): one line per process, trainer first."""
    lines = [f"run {snapshot['run_id']} at {snapshot['address']}",
             f"{'name':<14}{'role':<11}{'state':<17}{'version':>8}  highlights"]
    for name, s in _ordered(snapshot["processes"]):
        lines.append(f"{name:<14}{s['role']:<11}{s['state']:<17}{version_of(s):>8}  "
                     f"{highlights(s['role'], s['counters'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- the live view

COLUMNS = ("name", "role", "state", "ver", "queue", "tok/s", "batch", "stale", "spec acc/depth", "drafter",
           "scored", "age")
STATE_STYLE = {"generating": "green", "training": "green", "scoring": "green", "stepping": "green", "idle": "yellow",
               "syncing_weights": "cyan", "drafter_training": "magenta", "checkpointing": "cyan",
               "starting": "blue", "stopping": "red", "left": "red", "dead": "bold red"}


def _cells(role: str, c: dict[str, float]) -> list[str]:
    """queue, tok/s, batch, staleness, speculation, drafter, scored: per role, "" where it does not apply
    (one cell per column of COLUMNS between "ver" and "age")."""
    g = c.get
    if role == "trainer":
        return [f"{g('trainer/controller/groups_in_flight', 0):.0f} in flight / {g('trainer/queue/parked_requests', 0):.0f}"
                f" parked / {g('trainer/queue/scoring', 0):.0f} scoring", "", f"{g('trainer/controller/groups_complete', 0):.0f}",
                f"<= {g('trainer/controller/max_staleness_seen', 0):.0f}", "", "", ""]
    if role == "generator":
        spec = (f"{g('generator/spec/accept_rate', 0):.0%} / {g('generator/spec/mean_accept_len', 0):.2f}"
                if g("generator/spec/spec_steps", 0) else "")
        drafter = f"v{g('generator/spec/drafter_version', 0):.0f}" if "generator/spec/drafter_version" in c else ""
        return [f"{g('generator/queue/waiting', 0):.0f} waiting / {g('generator/queue/pending_items', 0):.0f} items"
                + _on_env(c, sep=" / "),
                f"{g('generator/throughput/wall_tokens_per_s', 0):.0f}", f"{g('generator/queue/running', 0):.0f}",
                "", spec, drafter, ""]
    if role in ("reward", "env"):
        return [f"{g(f'{role}/requests/in_flight', 0):.0f} in flight", "", "", "", "", "",
                f"{g(f'{role}/requests/answered', 0):.0f} ans, {1e3 * g(f'{role}/latency/mean_s', 0):.0f} ms, "
                f"{g(f'{role}/requests/errors', 0):.0f} err"]
    return [""] * 7


def view(board: Board) -> Any:
    """The rich renderable of the whole screen."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(("tailrace top ", "bold"), f"run {board.run_id or '?'} at {board.address}  ",
                         (board.finished and f"run finished: {board.finished}" or board.status,
                          "bold green" if board.finished else "bold"))
    trainer = next((p for p in board.processes.values() if p["role"] == "trainer"), None)
    progress = Text("waiting for the trainer's Stats")
    if trainer is not None:
        c = trainer["counters"]
        loss, saving = c.get("trainer/loss/last"), c.get("trainer/replay/saving")
        progress = Text.assemble(
            ("step ", "dim"), f"{c.get('trainer/step', 0):.0f}/{c.get('trainer/steps_total', 0):.0f}  ",
            ("reward ", "dim"), f"{c.get('trainer/reward/last', float('nan')):.3f} ", (sparkline(list(board.rewards)), "green"),
            ("  loss ", "dim"), f"{loss:.4f}" if loss is not None else "-",
            ("  replay saving ", "dim"), f"{saving:.2f}x" if saving else "-",
            ("  discarded ", "dim"), f"{c.get('trainer/controller/samples_discarded', 0):.0f}")
    table = Table(expand=True, header_style="bold", pad_edge=False)
    for name in COLUMNS:
        table.add_column(name, no_wrap=True, justify="right" if name in ("ver", "tok/s", "batch", "age") else "left")
    now = time.monotonic()
    for name, p in _ordered(board.processes):
        age = now - p["seen_s"]
        style = STATE_STYLE.get(p["state"], "")
        table.add_row(name, p["role"], Text(p["state"], style=style), version_of(p),
                      *_cells(p["role"], p["counters"]), f"{age:.0f}s", style="dim" if age > STALE_AFTER_S else None)
    events = Text("\n".join(f"{time.strftime('%H:%M:%S', time.localtime(t))}  {e:<14} {text}"
                            for t, e, text in board.events) or "none yet", overflow="ellipsis")
    return Group(head, progress, table, Panel(events, title="events", title_align="left"))


def _past(until_s: float | None) -> bool:
    return until_s is not None and time.monotonic() >= until_s


async def follow(board: Board, key: bytes | None, on_change: Any, *, until_s: float | None = None) -> None:
    """Feed board from the notice socket over one connection, calling on_change() after each notice, until
    the run finishes (board.finished set) or until_s (time.monotonic) passes. A trainer that disappears
    without a Shutdown is reconnected to, as often as it takes."""
    from tailrace.protocol.transport import Client, TransportError

    while board.finished is None and not _past(until_s):
        client = Client(board.address, role="tool", name=f"top-{os.getpid()}", curve_server_key=key)
        try:
            async with client:
                board.run_id = (await client.connect(timeout_s=5.0)).run_id
                await client.subscribe()
                board.status = "connected"
                on_change()
                while board.finished is None and not _past(until_s):
                    wait_s = 1.0 if until_s is None else min(1.0, until_s - time.monotonic())
                    try:
                        board.on(await asyncio.wait_for(client.recv_notice(), timeout=max(wait_s, 0.0)))
                    except TimeoutError:
                        pass
                    on_change()
        except TransportError as exc:
            if client.shutdown_reason is not None:  # the trainer said Shutdown on our session
                board.finished = client.shutdown_reason or "run finished"
                break
            board.status = f"trainer unreachable ({type(exc).__name__}); reconnecting"
            on_change()
            await asyncio.sleep(RECONNECT_S)


async def collect(address: str, window_s: float, curve_server_key: bytes | None = None) -> dict:
    """Stats of every process seen within window_s on the notice socket, keyed by name."""
    board = Board(address)
    await follow(board, curve_server_key, lambda: None, until_s=time.monotonic() + window_s)
    if not board.run_id:
        raise ConnectionError(f"no trainer answered at {address} within {window_s} s")
    return board.snapshot()


def live(address: str, key: bytes | None, console: Any = None, screen: bool = True) -> str:
    """The full-screen view until the run finishes; returns the finish reason."""
    from rich.live import Live

    from tailrace.protocol.transport import run

    board = Board(address)
    with Live(view(board), console=console, screen=screen, auto_refresh=False, transient=False) as display:
        last = [0.0]

        def on_change() -> None:
            if time.monotonic() - last[0] >= 0.25 or board.finished:
                last[0] = time.monotonic()
                display.update(view(board), refresh=True)

        run(follow(board, key, on_change))
        display.update(view(board), refresh=True)
    return board.finished or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Live view of a tailrace pipeline.")
    parser.add_argument("--connect", required=True, help="the trainer's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="with --once: the snapshot as one JSON object")
    parser.add_argument("--window-s", type=float, default=2.5,
                        help="--once: how long to listen for a round of Stats (default 2.5, > trainer.stats_interval_s)")
    parser.add_argument("--no-screen", action="store_true", help="draw in the terminal's scrollback, not the alternate screen")
    parser.add_argument("--curve-server-key", default="", help="file with the trainer's CURVE public key")
    args = parser.parse_args(argv)
    from tailrace.protocol.transport import run

    key = Path(args.curve_server_key).read_bytes().strip() if args.curve_server_key else None
    try:
        if args.once or args.json:
            snapshot = run(collect(args.connect, args.window_s, key))
            print(json.dumps(snapshot) if args.json else render(snapshot), flush=True)
            return 0
        reason = live(args.connect, key, screen=not args.no_screen)
        print(f"run finished: {reason}")
        return 0
    except KeyboardInterrupt:
        return 0
    except (TimeoutError, ConnectionError, OSError) as exc:
        print(f"top: cannot reach {args.connect}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
