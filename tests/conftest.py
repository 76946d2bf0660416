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
