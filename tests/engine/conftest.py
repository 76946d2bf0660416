"""Fixtures shared by the backend tests: one vLLM engine per session (it takes most of a minute to start
on a CPU), None where vllm is not installed."""

import pytest

from tests.engine.generator.backend_harness import HAS_VLLM, make_llm


@pytest.fixture(scope="session")
def vllm_llm(tmp_path_factory):
    if not HAS_VLLM:
        return None
    return make_llm(tmp_path_factory.mktemp("vllm-cache"), max_batch_size=8)
