"""The metrics sink: JSONL lines a tool can tail, NaN as null, fan-out to every sink, no file without a run;
metrics.sinks turns on TensorBoard (events its reader reads, the run config as text) and W&B (offline here).
Run: pytest tests/engine/core/test_metrics.py
"""

import json

import pytest

from tailrace.engine.config import load_config
from tailrace.engine.core.metrics import FanOut, JsonlSink, MetricsSink, NullSink, make_sink


class Recording(MetricsSink):
    def __init__(self):
        self.seen, self.closed = [], False

    def log(self, step, metrics):
        self.seen.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def test_jsonl_sink_writes_one_flushed_line_per_step_and_nan_as_null(tmp_path):
    sink = make_sink(tmp_path)
    sink.log(1, {"trainer/loss/pg": 0.5, "trainer/reward/mean": float("nan")})
    # flushed per line: readable before close, as tools/top.py and a `tail -f` read it
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "trainer/loss/pg": 0.5, "trainer/reward/mean": None}]
    sink.log(2, {"trainer/loss/pg": 0.25})
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_jsonl_sink_appends_on_resume(tmp_path):
    for step in (1, 2):
        sink = JsonlSink(tmp_path / "metrics.jsonl")
        sink.log(step, {"x": step})
        sink.close()
    assert [json.loads(line)["x"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_fan_out_reaches_every_sink_and_no_run_dir_writes_nothing(tmp_path):
    a, b = Recording(), Recording()
    fan = FanOut([a, b])
    fan.log(3, {"k": 1.0})
    fan.close()
    assert a.seen == b.seen == [(3, {"k": 1.0})] and a.closed and b.closed
    assert isinstance(make_sink(None), NullSink)
    assert not list(tmp_path.iterdir())


def test_metrics_sinks_setting_names_the_sinks_and_rejects_others():
    cfg = load_config(None, ["--metrics.sinks", "jsonl,tensorboard"])
    assert cfg.metrics.sinks == ("jsonl", "tensorboard")
    with pytest.raises(ValueError, match="metrics.sinks"):
        load_config(None, ["--metrics.sinks", "jsonl,mlflow"])


def test_tensorboard_sink_writes_events_tensorboard_reads_with_the_run_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["--metrics.sinks", "tensorboard", "--train.lr", "0.001"])
    sink = make_sink(tmp_path, cfg)
    for step in (1, 2):
        sink.log(step, {"trainer/loss/pg": 0.5 / step, "trainer/note": "text is skipped"})
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("trainer/loss/pg")] == [(1, 0.5), (2, 0.25)]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.001' in config


def test_wandb_sink_offline_writes_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["--metrics.sinks", "jsonl,wandb"])
    sink = make_sink(tmp_path / "run-1", cfg)
    sink.log(1, {"trainer/reward/mean": 0.25})
    sink.close()
    runs = list((tmp_path / "run-1" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), list((tmp_path / "run-1").rglob("*"))
    assert (tmp_path / "run-1" / "metrics.jsonl").is_file()


def test_resume_drops_steps_past_the_checkpoint_and_a_torn_last_line(tmp_path):
    from tailrace.engine.trainer.runs import keep_metrics_up_to

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    keep_metrics_up_to(path, 3)  # a kill -9 after step 5 was logged, mid-way through step 6's line
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    keep_metrics_up_to(tmp_path / "absent.jsonl", 3)
