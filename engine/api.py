"""The Python API, for people who embed tailrace: a RunConfig built in Python (or a dict shaped like the
TOML file, or the path of one) runs through the same launcher, run folder and checks as `tailrace run`,
with a reward function passed as a callable.

    import tailrace
    cfg = tailrace.Config()
    cfg.train.steps = 20
    result = tailrace.run(cfg, reward_fn=lambda prompt, completion, metadata: float(...))
    result.summary["reward_last"], result.run_dir

Test: pytest tests/engine/test_api.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from tailrace.engine.config import RunConfig, apply_overrides, config_data, from_dict, to_dict

ScoreFn = Callable[[str, str, dict[str, Any]], Any]


class RunFailed(RuntimeError):
    """tailrace.run() did not finish its steps; the run folder's logs/ say why."""

    def __init__(self, text: str, run_dir: Path):
        super().__init__(text)
        self.run_dir = run_dir


@dataclasses.dataclass(frozen=True)
class RunResult:
    run_dir: Path
    summary: dict[str, Any]  # summary.json: steps, rewards, accounting, wall time (docs/getting-started.md)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def checkpoint(self) -> Path:
        """checkpoint/latest: what transformers' from_pretrained loads."""
        return self.run_dir / "checkpoint" / "latest"


def _changed(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The settings that differ from their defaults, as nested tables: what a user's TOML file would hold
    (so that, as there, an unset trainer.bind means "a free port")."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            inner = _changed(value, default)
            if inner:
                out[key] = inner
        elif value != default:
            out[key] = value
    return out


def config_table(config: RunConfig | dict[str, Any] | str | Path | None) -> dict[str, Any]:
    """The nested table of settings that `config` stands for (not yet validated)."""
    if config is None:
        return {}
    if isinstance(config, RunConfig):
        return _changed(to_dict(config), to_dict(RunConfig()))
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a copy the launcher may fill in, JSON-plain like TOML
    if isinstance(config, str | Path):
        return config_data(config)
    raise TypeError(f"config must be a tailrace.Config, a dict, a TOML path or None, not {type(config).__name__}")


def _user_reward(reward_fn: ScoreFn | str | None, tasks: Iterable[str]) -> Any:
    from tailrace.engine.launch import UserReward
    from tailrace.engine.reward_server import load_function

    if reward_fn is None:
        return None
    if isinstance(reward_fn, str):  # "module:function": its own process, restarted like any child
        load_function(reward_fn)  # a bad name is one clear line now, not a crashed child later
        return UserReward(fn=None, tasks=tuple(tasks), spec=reward_fn)
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be a callable or 'module:function', not {type(reward_fn).__name__}")
    return UserReward(fn=reward_fn, tasks=tuple(tasks))


def run(config: RunConfig | dict[str, Any] | str | Path | None = None, *, overrides: Sequence[str] = (),
        reward_fn: ScoreFn | str | None = None, reward_tasks: Iterable[str] = (), resume: bool = False,
        progress: bool = False) -> RunResult:
    """Run a trainer, launch.num_generators generators and a reward server on this machine, as
    `tailrace run` does, and return when the run ends.

    config:      a tailrace.Config (RunConfig), a dict of TOML-shaped tables, a TOML file, or None (defaults).
    overrides:   dotted settings as on the command line, e.g. ["--train.steps", "20"].
    reward_fn:   score(prompt, completion, metadata) -> float | dict, replacing the built-in reward server.
                 A callable is served inside this process (sync functions in a thread pool, coroutine
                 functions on the launcher's loop); a string "module:function" runs as its own process,
                 restarted by launch.on_child_crash. It scores reward_tasks (default: the function's
                 `tasks` attribute, else every task).
    resume:      continue the run named by trainer.run_name from its last checkpoint.
    progress:    a line per step on stdout (bars on a terminal).
    Raises ValueError for a bad setting (naming it) and RunFailed when the run stops before its steps."""
    from tailrace.engine import launch

    data = config_table(config)
    # every setting checked before anything starts, as the CLI does
    cfg = from_dict(RunConfig, apply_overrides(copy.deepcopy(data), list(overrides)))
    if not cfg.trainer.run_name:  # named here so that the result can point at the folder
        cfg.trainer.run_name = time.strftime("run-%Y%m%d-%H%M%S")
        data.setdefault("trainer", {})["run_name"] = cfg.trainer.run_name
    reward = _user_reward(reward_fn, reward_tasks)
    with tempfile.TemporaryDirectory(prefix="tailrace-api-") as folder:
        path = Path(folder) / "config.toml"
        path.write_text(tomli_w.dumps(data))
        args = argparse.Namespace(role="run", config=str(path), resume=resume, no_progress=not progress, nproc=1)
        code = launch.main(args, list(overrides), reward=reward)
    run_dir = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if code != 0:
        raise RunFailed(f"tailrace.run: the run stopped (exit {code}); its logs are in {run_dir / 'logs'}", run_dir)
    return RunResult(run_dir=run_dir, summary=summary)

