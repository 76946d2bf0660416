"""Shared by the kernel tests: re-running a module's `under_interpreter` tests in a fresh process with
TRITON_INTERPRET=1, so the interpreter never leaks into other test modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailrace.kernels._triton import HAS_TRITON, interpreting

ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_FLAG = "TAILRACE_KERNEL_INTERPRETER_SUBPROCESS"
IN_SUBPROCESS = os.environ.get(SUBPROCESS_FLAG) == "1" and interpreting()


def run_interpreter_subprocess(test_file: str, marker: str, timeout_s: int) -> None:
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", **{SUBPROCESS_FLAG: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "--strict-markers", "-m", marker, "-k", "under_interpreter"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


@pytest.fixture
def run_interpreter():
    return run_interpreter_subprocess
