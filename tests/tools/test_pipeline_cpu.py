"""The pipeline benchmark's CPU accounting (tools/benches/pipeline.py CpuSampler): the CPU seconds of real
processes between two instants, read from /proc by sampling, so that ratio_bound_cpu and cpu_busy say
what the real runs cost the machine's cores.
Run: pytest tests/tools/test_pipeline_cpu.py
"""

import subprocess
import sys
import time

import pytest

from tools.benches.pipeline import CpuSampler

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A child that spins for SPIN_S, then sleeps: its CPU is SPIN_S, whatever the window's wall time.
SPIN_S = 0.6
CHILD = f"""
import time
end = time.monotonic() + {SPIN_S}
while time.monotonic() < end:
    pass
time.sleep(30)
"""


def test_counts_the_cpu_seconds_of_busy_processes_and_not_of_sleeping_ones():
    busy = subprocess.Popen([sys.executable, "-c", CHILD])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    sampler = CpuSampler()
    try:
        start = time.monotonic()
        sampler.start([busy.pid, idle.pid])
        time.sleep(SPIN_S + 0.9)  # the spin ends inside the window (the interpreter's start adds a little)
        end = time.monotonic()
        time.sleep(0.1)
        sampler.stop()
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    cpu_s = sampler.seconds_between(start, end)
    # The spin, and the busy interpreter's start-up (under 0.3 s), at 10 ms clock ticks; nothing from sleeping.
    assert SPIN_S - 0.05 <= cpu_s <= SPIN_S + 0.35, cpu_s
    # After the spin the CPU stands still: the last half second adds (almost) nothing.
    assert sampler.seconds_between(end - 0.5, end) <= 0.03


def test_interpolates_between_samples_and_clamps_outside_them():
    sampler = CpuSampler()
    sampler.samples = [(10.0, 1.0), (10.1, 1.5), (10.2, 1.5)]
    assert sampler.at(10.05) == pytest.approx(1.25)
    assert sampler.at(9.0) == 1.0 and sampler.at(11.0) == 1.5
    assert sampler.seconds_between(10.0, 10.2) == pytest.approx(0.5)
    assert sampler.seconds_between(10.1, 10.2) == 0.0
