"""The fault suite imports its machinery from tools/benches/faultkit.py (shared with `python tools/bench.py
faults`); tools/ is not installed, so the repository root goes on sys.path, as in tests/tools/."""

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def exact_accounting():
    """Asserts a finished run's accounting is exact (nothing lost, nothing trained twice, trained.jsonl
    agreeing with summary.json) and returns its summary."""
    from tools.benches import faultkit as fk

    def exact(run_dir):
        counted = fk.accounting(run_dir)
        assert counted["samples_lost"] == 0, counted["summary"]
        assert counted["samples_trained_twice"] == 0
        assert counted["samples_trained_logged"] == counted["summary"]["samples_trained"]
        return counted["summary"]

    return exact
