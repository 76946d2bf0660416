"""Packaging and import hygiene, each in a fresh interpreter so import order is clean:
- our top-level `kernels` package must not make transformers believe Hugging Face's `kernels` is installed;
- protocol/ imports nothing from engine/ or kernels/, and no torch unless a tensor is encoded or decoded.
Run: pytest tests/test_packaging.py
"""

import json
import subprocess
import sys

import pytest


def run_python(code: str, cwd) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def test_transformers_does_not_see_hugging_face_kernels(tmp_path):
    out = run_python("import transformers.utils as u; print(u.is_kernels_available())", tmp_path)
    assert out == "False"


@pytest.mark.xfail(strict=True, reason=(
    "transformers maps the import name `kernels` to the `tailrace` distribution and reads its version "
    "(0.1.0); is_kernels_available() is False only because 0.1.0 is below its minimum kernels version. "
    "Renaming our top-level `kernels` package (or shipping it under a `tailrace` namespace) fixes this."))
def test_transformers_probe_finds_no_kernels_distribution_of_any_version(tmp_path):
    out = run_python("from transformers.utils import import_utils as u; "
                     "print(u.is_kernels_available.__wrapped__('0.0.0', '999999'))", tmp_path)
    assert out == "False"


PROTOCOL_IMPORTS = """
import importlib, json, pkgutil, sys
import protocol
for info in pkgutil.iter_modules(protocol.__path__):
    importlib.import_module("protocol." + info.name)
from protocol.codec import decode, encode
from protocol.messages import Score, ScoreRequest, Heartbeat, Hello, Work, WorkItem
msgs = [ScoreRequest(request_id=1, task="t", prompt="p", completion="c", metadata={"a": 1}),
        Score(request_id=1, reward=0.5), Heartbeat(seq=1), Work(items=[WorkItem(group_id=1, prompt_token_ids=[1],
        num_samples=2)]), Hello(role="reward", name="r", protocol_version=1, package_version="0")]
for m in msgs:
    assert decode(encode(m)) == m
loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "engine", "kernels", "tools", "numpy"))
print(json.dumps(loaded))
"""


def test_protocol_imports_no_engine_and_no_torch_for_plain_messages(tmp_path):
    loaded = json.loads(run_python(PROTOCOL_IMPORTS, tmp_path))
    assert not [n for n in loaded if n.split(".")[0] in ("engine", "kernels", "tools")], loaded
    assert not [n for n in loaded if n.split(".")[0] == "torch"], "protocol imported torch without a tensor"
