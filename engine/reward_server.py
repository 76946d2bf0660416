"""Entry point of `tailrace reward`: serve a user's Python function as a reward server.

Run: tailrace reward --connect tcp://127.0.0.1:5555 --fn tailrace.engine.tasks:score [--tasks reverse,copy]
The function is `score(prompt: str, completion: str, metadata: dict) -> float | dict`, sync or async.
Without --tasks the server registers the function's `tasks` attribute when it has one (the built-in
tasks' `score` does), else "*" (every task).
Started before its trainer, it waits for one (saying so every few seconds), for --connect-timeout-s
seconds or, by default, until the trainer comes up.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from pathlib import Path
from typing import Any


def load_function(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--fn {spec!r}: expected module:function, e.g. tailrace.engine.tasks:score")
    sys.path.insert(0, str(Path.cwd()))  # user modules next to where they run the command
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--fn {spec!r}: cannot import {module_name}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--fn {spec!r}: {module_name} has no function {attr!r}")
    return fn


def main(args: Any, overrides: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward %(levelname)s %(message)s")
    from tailrace.engine.report import connect_failed
    from tailrace.protocol.reward_sdk import serve
    from tailrace.protocol.transport import ConnectionLost, ConnectTimeout, Rejected, read_key, run

    fn = load_function(args.fn)
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    tasks = tasks or tuple(getattr(fn, "tasks", ())) or ("*",)
    try:
        run(serve(fn, args.connect, tasks=tasks, name=args.name or None, max_concurrency=args.max_concurrency,
                  timeout_s=args.timeout_s, curve_server_key=read_key(args.curve_server_key, "--curve-server-key"),
                  curve_secret_key=read_key(args.curve_key, "--curve-key"),
                  connect_timeout_s=args.connect_timeout_s or math.inf))
    except (ConnectTimeout, Rejected) as exc:
        print(connect_failed("reward", args.connect, exc, args.connect_timeout_s), file=sys.stderr)
        return 1
    except ConnectionLost as exc:
        print(f"tailrace reward: lost the trainer at {args.connect}: {exc}", file=sys.stderr)
        return 1
    return 0
