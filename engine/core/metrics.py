"""One sink interface for metrics, so loops never ask whether logging is on.

`make_sink(run_dir, cfg)` fans out to the sinks that `metrics.sinks` names: "jsonl" (runs/<name>/metrics.jsonl,
what tools/plot.py reads), "tensorboard" (runs/<name>/tensorboard; pip install tailrace[tensorboard]) and
"wandb" (pip install tailrace[wandb]; WANDB_MODE=offline keeps the run in runs/<name>/wandb). TensorBoard and
W&B get the resolved run config too. Metric keys are `role/group/name` (e.g. `trainer/loss/pg`).
Test: pytest tests/engine/core/test_metrics.py
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class MetricsSink:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NullSink(MetricsSink):
    pass


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None marks the gap
    return value


class JsonlSink(MetricsSink):
    """One JSON object per line: {"step": N, key: value, ...}. Flushed per line so tools can tail it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step} | {k: _clean(v) for k, v in metrics.items()}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: the error names this file (the trainer stops, naming it)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class TensorBoardSink(MetricsSink):
    def __init__(self, log_dir: str | Path, config: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(log_dir))
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricsSink):
    """A W&B run named like the run folder, its files under run_dir/wandb. The wandb package reads
    WANDB_MODE (offline: nothing leaves the machine; `wandb sync` uploads it later) and WANDB_API_KEY."""

    def __init__(self, run_dir: str | Path, *, project: str, config: dict[str, Any] | None = None):
        import wandb

        self.run = wandb.init(project=project, name=Path(run_dir).name, dir=str(run_dir), config=config,
                              resume="allow", id=Path(run_dir).name)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class FanOut(MetricsSink):
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _open(kind: str, run_dir: Path, cfg: Any) -> MetricsSink:
    config = dataclasses.asdict(cfg) if cfg is not None else None
    try:
        if kind == "tensorboard":
            return TensorBoardSink(run_dir / "tensorboard", config)
        if kind == "wandb":
            return WandbSink(run_dir, project=cfg.metrics.wandb_project if cfg else "tailrace", config=config)
    except ImportError as exc:
        raise ValueError(f"metrics.sinks: {kind} needs its package: pip install 'tailrace[{kind}]'") from exc
    assert kind == "jsonl", kind
    return JsonlSink(run_dir / "metrics.jsonl")


def make_sink(run_dir: str | Path | None, cfg: Any = None) -> MetricsSink:
    """The sinks `cfg.metrics.sinks` names (a RunConfig; None: JSONL only) for the run in run_dir."""
    if run_dir is None:
        return NullSink()
    kinds = cfg.metrics.sinks if cfg is not None else ("jsonl",)
    return FanOut([_open(kind, Path(run_dir), cfg) for kind in kinds])
