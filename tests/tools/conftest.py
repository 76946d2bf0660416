"""tools/ is not installed: its scripts run from the repository root (tools/bench.py puts the root on
sys.path), and its tests import it the same way."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
