"""The metrics sink: JSONL lines a tool can tail, NaN as null, fan-out to every sink, no file without a run.
Run: pytest tests/engine/test_metrics.py
"""

import json

from tailrace.engine.metrics import FanOut, JsonlSink, MetricsSink, NullSink, make_sink


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
