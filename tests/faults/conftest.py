"""The fault suite imports its machinery from tools/benches/faultkit.py (shared with `python tools/bench.py
faults`); tools/ is not installed, so the repository root goes on sys.path, as in tests/tools/."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
