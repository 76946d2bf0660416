"""The `tailrace` package itself. pyproject.toml maps the import name `tailrace` to this folder, so the
repository keeps its layout (engine/, kernels/, protocol/ at the top, imported as tailrace.engine, ...).
It holds only the Python API, imported on first use, so `import tailrace` pulls in no torch:

    tailrace.run(config, reward_fn=...)   engine/api.py: the launcher of `tailrace run`, from Python
    tailrace.Config                       engine/config.py RunConfig: nested dataclasses, one per section
    tailrace.RunResult, tailrace.RunFailed

Test: pytest tests/engine/test_api.py
"""

from typing import Any

__all__ = ["Config", "RunFailed", "RunResult", "run"]


def __getattr__(name: str) -> Any:
    if name == "Config":
        from tailrace.engine.config import RunConfig

        return RunConfig
    if name in ("run", "RunResult", "RunFailed"):
        from tailrace.engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'tailrace' has no attribute {name!r}")
