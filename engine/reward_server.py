"""Entry point of `tailrace reward`: serve a user's Python function, or the weighted sum of
reward.functions (engine/core/reward_fns.py), as a reward server.

Run: tailrace reward --connect tcp://127.0.0.1:5555 --fn tailrace.engine.data.tasks:score [--tasks reverse,copy]
 or: tailrace reward --connect tcp://127.0.0.1:5555 --config run.toml   (its reward.functions)
The function is `score(prompt: str, completion: str, metadata: dict) -> float | dict`, sync or async.
Without --tasks the server registers the function's `tasks` attribute when it has one (the built-in
tasks' `score` does), else "*" (every task); for reward.functions, every task one of them scores.
Started before its trainer, it waits for one (saying so every few seconds), for --connect-timeout-s
seconds or, by default, until the trainer comes up.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from tailrace.engine.core import reward_fns
from tailrace.engine.core.reward_fns import load_function

__all__ = ["load_function", "main", "score_function"]


def score_function(args: Any, overrides: list[str]) -> Any:
    """--fn's function, or the weighted sum of reward.functions from --config and the overrides."""
    if args.fn:
        if args.config or overrides:
            raise ValueError("--fn serves one function: give it, or reward.functions (--config FILE / "
                             "--reward.functions ...), not both")
        return load_function(args.fn)
    from tailrace.engine.config import load_config

    functions = load_config(args.config, overrides).reward.functions
    if not functions:
        raise ValueError("needs --fn module:function, or reward.functions in --config FILE (or as "
                         "--reward.functions mod:f,mod:g=0.5)")
    return reward_fns.combine(reward_fns.components(functions))


def main(args: Any, overrides: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward %(levelname)s %(message)s")
    from tailrace.engine.core.report import connect_failed
    from tailrace.protocol.reward_sdk import serve
    from tailrace.protocol.transport import ConnectionLost, ConnectTimeout, Rejected, read_key, run

    fn = score_function(args, overrides)
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
