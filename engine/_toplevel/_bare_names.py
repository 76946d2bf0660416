"""Keeps the repository's top-level folders from shadowing installed packages of the same name.

The folders engine/, kernels/ and protocol/ are imported as tailrace.engine, tailrace.kernels and
tailrace.protocol. But any process whose sys.path holds the checkout's root (`python -m pytest`,
`python -c`, a notebook or a script started there) also sees them as bare `engine`, `kernels` and
`protocol`, ahead of site-packages; transformers >= 5.25 imports Hugging Face's `kernels` at start-up and
would get ours. Each folder's __init__.py calls `step_aside` when it runs under its bare name: the module
becomes the installed package of that name, found on sys.path without this checkout's root, or, when
none is installed, an empty namespace module (what Python gives for a folder without __init__.py, which
`transformers.utils.is_kernels_available` reads as "not installed").

Test: pytest tests/test_packaging.py
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path


def _same_folder(entry: str, root: Path) -> bool:
    try:
        return Path(entry or ".").resolve() == root
    except OSError:
        return False


def step_aside(name: str, init_file: str) -> None:
    """Replace sys.modules[name] (this checkout's folder, being imported by its bare name) with the
    installed package `name`, or with an empty namespace module when none is installed. The import
    statement that is running returns sys.modules[name], so it gets the replacement."""
    root = Path(init_file).resolve().parent.parent
    path = [entry for entry in sys.path if not _same_folder(entry, root)]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:  # nothing installed, or only namespace folders
        module = types.ModuleType(name, f"No installed package {name!r}; the folder {root / name} is tailrace.{name}")
        module.__path__ = []  # an empty namespace package: no submodules, no __file__
        sys.modules[name] = module
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
