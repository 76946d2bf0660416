"""Fixtures every test folder may use. Helpers shared between test modules live in conftest.py files or in
non-test modules that a conftest.py exposes as fixtures; no test module imports another
(tests/test_layering.py checks it).

tiny_lm: the one builder of tiny Hugging Face causal LMs from configs (tests/tiny_lms.py); the presets
of tests/engine/conftest.py, tests/engine/trainer/conftest.py and tests/engine/generator/conftest.py are
built on it.
"""

import pytest
import tiny_lms  # tests/tiny_lms.py: pytest puts this folder on sys.path for its conftest.py


@pytest.fixture(scope="session")
def tiny_lm():
    """tiny_lm(arch="qwen2", *, seed=0, dtype=None, attn=None, **config) -> a tiny causal LM
    (tests/tiny_lms.py: build)."""
    return tiny_lms.build


@pytest.fixture
def overlay_venv(tmp_path):
    """A fresh venv's python that also sees this venv's packages through a .pth line (after its own), so
    torch and transformers are not downloaded again; what is installed into it wins over them."""
    import subprocess
    import sys
    from pathlib import Path

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"

    def purelib(exe):
        return subprocess.run([str(exe), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()

    (Path(purelib(python)) / "base.pth").write_text(purelib(sys.executable) + "\n")
    return python
