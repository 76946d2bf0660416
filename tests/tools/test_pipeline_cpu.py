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

# A child that spins until it has used SPIN_S of CPU (not of wall time: a loaded machine gives it less CPU
# per second), says how much CPU it used in all (its start-up included), then sleeps.
SPIN_S = 0.6
CHILD = f"""
import time
while time.process_time() < {SPIN_S}:
    pass
print(time.process_time(), flush=True)
time.sleep(30)
"""


def test_counts_the_cpu_seconds_of_busy_processes_and_not_of_sleeping_ones():
    idle = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, text=True)
    busy = None
    sampler = CpuSampler()
    try:
        idle.stdout.readline()  # its start-up is over: from here on it only sleeps
        busy = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        start = time.monotonic()
        sampler.start([busy.pid, idle.pid])
        used_s = float(busy.stdout.readline())  # the busy child's own count, when its spin is over
        time.sleep(0.6)
        end = time.monotonic()
        time.sleep(0.1)
        sampler.stop()
    finally:
        for child in (busy, idle):
            if child is not None:
                child.kill()
                child.wait()
    cpu_s = sampler.seconds_between(start, end)
    # The busy child's CPU, less what it used before the first sample (part of its start-up), at 10 ms
    # clock ticks; nothing from the sleeping one.
    assert used_s - 0.25 <= cpu_s <= used_s + 0.05, (cpu_s, used_s)
    # After the spin the CPU stands still: the last half second adds (almost) nothing.
    assert sampler.seconds_between(end - 0.5, end) <= 0.03


def test_interpolates_between_samples_and_clamps_outside_them():
    sampler = CpuSampler()
    sampler.samples = [(10.0, 1.0), (10.1, 1.5), (10.2, 1.5)]
    assert sampler.at(10.05) == pytest.approx(1.25)
    assert sampler.at(9.0) == 1.0 and sampler.at(11.0) == 1.5
    assert sampler.seconds_between(10.0, 10.2) == pytest.approx(0.5)
    assert sampler.seconds_between(10.1, 10.2) == 0.0
