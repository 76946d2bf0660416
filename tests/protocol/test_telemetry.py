"""SpanBuffer: bounded, merges back-to-back spans, drains into one Spans message; RewardTelemetry keeps
concurrent requests on separate tracks. Run: pytest tests/protocol/test_telemetry.py
"""

import itertools

from tailrace.protocol.codec import decode, encode
from tailrace.protocol.telemetry import MERGE_GAP_S, EnvTelemetry, RewardTelemetry, SpanBuffer


def test_back_to_back_spans_of_one_state_merge_and_others_do_not():
    buf = SpanBuffer("trainer", "trainer")
    buf.add("wait_data", 10.0, 10.5)
    buf.add("wait_data", 10.5 + MERGE_GAP_S / 2, 11.0)  # the loop woke and waited again at once
    buf.add("train_step", 11.0, 12.0, value=8)
    buf.add("serve_weights", 11.2, 11.3, track="net")  # another track: overlaps the main one freely
    buf.add("wait_data", 12.5, 13.0)  # a gap: a new span
    msg = buf.drain()
    assert [(s.state, s.start_wall_s, round(s.duration_s, 9), s.track) for s in msg.spans] == [
        ("wait_data", 10.0, 1.0, "main"), ("train_step", 11.0, 1.0, "main"),
        ("serve_weights", 11.2, 0.1, "net"), ("wait_data", 12.5, 0.5, "main")]
    assert buf.drain() is None and buf.cost_s > 0


def test_the_ring_is_bounded_and_says_how_many_it_dropped():
    buf = SpanBuffer("generator", "gen-0", capacity=3)
    for i in range(5):
        buf.add("decode", float(i), i + 0.5, value=i)
    msg = buf.drain()
    assert [s.value for s in msg.spans] == [2, 3, 4] and msg.dropped == 2
    assert decode(encode(msg)) == msg


def test_a_clock_stepping_back_never_makes_spans_of_a_track_overlap():
    buf = SpanBuffer("generator", "gen-0")
    buf.add("decode", 10.0, 11.0)
    buf.add("prefill", 10.5, 10.7)
    buf.add("decode", 9.0, 9.2, value=3)
    spans = buf.drain().spans
    assert all(b.start_wall_s >= a.start_wall_s + a.duration_s for a, b in itertools.pairwise(spans))


def test_disabled_buffer_records_nothing():
    buf = SpanBuffer("generator", "gen-0", enabled=False)
    with buf.span("decode"):
        pass
    assert buf.drain() is None


def test_reward_telemetry_counts_and_gives_each_concurrent_request_its_own_track():
    tel = RewardTelemetry("grader", max_concurrency=2)
    a, b = tel.start(), tel.start()
    assert tel.stats().state == "scoring" and tel.stats().counters["reward/requests/in_flight"] == 2
    tel.finish(a, failed=False)
    c = tel.start()  # reuses a's slot
    tel.finish(b, failed=True)
    tel.finish(c, failed=False)
    stats = tel.stats()
    assert stats.state == "idle" and stats.role == "reward"
    assert stats.counters["reward/requests/answered"] == 3 and stats.counters["reward/requests/errors"] == 1
    assert sorted({s.track for s in tel.spans.drain().spans}) == ["slot-0", "slot-1"]


def test_env_telemetry_is_the_same_accounting_under_its_own_role():
    tel = EnvTelemetry("env-0", max_concurrency=1)
    tel.finish(tel.start(), failed=True)
    stats = tel.stats()
    assert (stats.role, stats.name, stats.state) == ("env", "env-0", "idle")
    assert stats.counters["env/requests/answered"] == 1 and stats.counters["env/requests/errors"] == 1
    assert not any(k.startswith("reward/") for k in stats.counters)
    assert [s.state for s in tel.spans.drain().spans] == ["stepping"]
