"""Packaging and import hygiene, each in a fresh interpreter so import order is clean:
- the import names live under `tailrace.` (no top-level `engine`, `kernels`, `protocol`), so transformers never
  mistakes us for Hugging Face's `kernels` (a dependency of transformers >= 5.25), and both install side by
  side in one venv (tests/test_install.py covers the checkout's root on sys.path);
- protocol/ imports nothing from engine/ or kernels/, and no torch unless a tensor is encoded or decoded;
- every folder with an __init__.py under engine/, kernels/, protocol/ is a package pyproject.toml lists, so
  none is left out of the wheel.
Run: pytest tests/test_packaging.py
"""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def test_every_package_folder_is_in_the_wheel():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]

    def folder(package: str) -> Path:  # the folder a listed package is built from, by package-dir
        mapped = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
        return Path(package_dir[mapped], *package[len(mapped):].split(".")[1:])

    listed = {folder(package) for package in setuptools["packages"]}
    found = {init.parent.relative_to(REPO) for top in ("engine", "kernels", "protocol")
             for init in (REPO / top).rglob("__init__.py") if ".venv" not in init.parts}
    assert found == listed, f"not listed: {found - listed}; listed without a folder: {listed - found}"


def test_transformers_sees_only_hugging_face_kernels(tmp_path):
    """transformers >= 5.25 depends on Hugging Face's `kernels`: its probe finds that distribution (or,
    where it is not installed, nothing), never a folder of this repository."""
    out = run_python("import importlib.util as iu, importlib.metadata as md; from transformers.utils import "
                     "import_utils as u; spec = iu.find_spec('kernels'); "
                     "print(spec and spec.origin, u._is_package_available('kernels', return_version=True)[1])",
                     tmp_path)
    origin, version = out.split()
    assert str(REPO / "kernels") not in origin
    assert (origin == "None") == (version == "N/A"), out


def test_no_generic_top_level_import_names(tmp_path):
    out = run_python("import importlib.util as u; "
                     "print([n for n in ('engine', 'protocol', 'tailrace.engine') if u.find_spec(n)], "
                     "str((u.find_spec('kernels') or u.find_spec('json')).origin))", tmp_path)
    names, _, kernels_origin = out.partition("] ")
    assert names == "['tailrace.engine'"
    assert str(REPO / "kernels") not in kernels_origin, out


BOTH_INSTALLED = """
import importlib.metadata as md, json, shutil, subprocess
import kernels
from transformers.utils import import_utils as u
import tailrace, tailrace.engine.cli, tailrace.protocol.codec as codec, tailrace.protocol.messages as m
from tailrace.kernels.logprobs import chunked_logprobs
import torch
hidden, head = torch.randn(10, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
labels = torch.randint(0, 11, (10,))
want = torch.log_softmax(hidden @ head.T, -1).gather(-1, labels[:, None])[:, 0]
got = chunked_logprobs(hidden, head, labels, chunk_size=3)
help_out = subprocess.run([shutil.which("tailrace"), "--help"], capture_output=True, text=True).stdout
print(json.dumps({"hf_kernels": hasattr(kernels, "get_kernel") and "/site-packages/kernels/" in kernels.__file__,
                  "kernels_version": md.version("kernels"),
                  "transformers_sees_hf_kernels": u.is_kernels_available.__wrapped__("0.0.0", "999999"),
                  "logprobs_ok": bool(torch.allclose(got, want)),
                  "codec_ok": codec.decode(codec.encode(m.Heartbeat(seq=3))) == m.Heartbeat(seq=3),
                  "console_script": "usage: tailrace" in help_out,
                  "python_api": "/site-packages/tailrace/__init__.py" in tailrace.__file__
                                and tailrace.Config().train.steps > 0 and callable(tailrace.run)}))
"""


def test_tailrace_and_hugging_face_kernels_install_together(tmp_path, overlay_venv):
    """A fresh venv (reusing this one's torch/transformers through a .pth line, so nothing large is
    downloaded) gets a built wheel of tailrace and PyPI's `kernels`: both import, both work."""
    python = overlay_venv
    venv = python.parent.parent
    source = tmp_path / "src"
    source.mkdir()  # a copy, so the wheel build writes no build/ into the checkout
    for name in ("pyproject.toml", "README.md", "engine", "kernels", "protocol"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", str(source), "kernels"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run([str(python), "-c", BOTH_INSTALLED], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures.pop("kernels_version")
    assert figures == {"hf_kernels": True, "transformers_sees_hf_kernels": True, "logprobs_ok": True,
                       "codec_ok": True, "console_script": True, "python_api": True}, figures


PROTOCOL_IMPORTS = """
import importlib, json, pkgutil, sys
import tailrace.protocol as protocol
for info in pkgutil.iter_modules(protocol.__path__):
    importlib.import_module("tailrace.protocol." + info.name)
from tailrace.protocol.codec import decode, encode
from tailrace.protocol.messages import Score, ScoreRequest, Heartbeat, Hello, Work, WorkItem
msgs = [ScoreRequest(request_id=1, task="t", prompt="p", completion="c", metadata={"a": 1}),
        Score(request_id=1, reward=0.5), Heartbeat(seq=1), Work(items=[WorkItem(group_id=1, prompt_token_ids=[1],
        num_samples=2)]), Hello(role="reward", name="r", protocol_version=3, package_version="0")]
for m in msgs:
    assert decode(encode(m)) == m
loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "tailrace", "tools", "numpy"))
print(json.dumps(loaded))
"""


def test_protocol_imports_no_engine_and_no_torch_for_plain_messages(tmp_path):
    loaded = json.loads(run_python(PROTOCOL_IMPORTS, tmp_path))
    assert not [n for n in loaded if n.startswith(("tailrace.engine", "tailrace.kernels", "tools"))], loaded
    assert not [n for n in loaded if n.split(".")[0] == "torch"], "protocol imported torch without a tensor"
