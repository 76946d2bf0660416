"""One sink interface for metrics, so loops never ask whether logging is on.

`make_sink(run_dir)` fans out to a JSONL file (always) and TensorBoard when installed and asked for.
Metric keys are `role/group/name` (e.g. `trainer/loss/pg`). Test: pytest tests/engine/test_metrics.py
"""

from __future__ import annotations

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
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink(MetricsSink):
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class FanOut(MetricsSink):
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_sink(run_dir: str | Path | None, *, tensorboard: bool = False) -> MetricsSink:
    if run_dir is None:
        return NullSink()
    sinks: list[MetricsSink] = [JsonlSink(Path(run_dir) / "metrics.jsonl")]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
        except ImportError as exc:
            raise ValueError("tensorboard logging needs the `tensorboard` package: pip install tensorboard") from exc
    return FanOut(sinks)
