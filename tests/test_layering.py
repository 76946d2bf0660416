"""The import graph, read with `ast` from the source files (every import, also those inside functions):
dependencies point down, tools -> engine -> (kernels, protocol), as docs/architecture.md's "Layout and import names" says.

    engine/replay/      never imports engine/trainer/: the types both use (samples, prompt records, the
                        SequenceLoss call and its normaliser) live below them, in engine/samples.py and
                        engine/losses.py. engine/trainer/ may import engine/replay/: the learner runs the
                        branch-replay strategies, so replay is a library the trainer uses, never the reverse.
    engine/trainer/     and engine/generator/ never import each other (they meet only on the wire); nor
                        does engine/replay/ import engine/generator/.
    engine/*.py         the shared core (config, data, samples, losses, ...) imports none of engine's
                        subpackages; only the command line does: cli.py, which dispatches to a role's
                        main, launch.py (`tailrace run`), which runs the trainer's main in process
                        when it is the only role (DPO), and evaluate.py (`tailrace eval`).
    protocol/, kernels/ import nothing of engine/.
    engine/, kernels/, protocol/ import nothing of tools/ (benchmark machinery stays in tools/).
    everywhere          the import names are tailrace.*: no bare `engine`, `kernels` or `protocol`.
    no cycles           between modules, counting every import.

Run: pytest tests/test_layering.py
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ("engine", "kernels", "protocol")  # folders whose import names are tailrace.<folder>
SCANNED = (*INSTALLED, "tools", "tests", "examples")
COMMAND_LINE = "tailrace.engine.cli"
# evaluate.py (`tailrace eval`) runs the generator's backend and the trainer's reward dispatcher in one process.
ENTRY_POINTS = {COMMAND_LINE, "tailrace.engine.launch", "tailrace.engine.evaluate"}


TOP_LEVEL = ROOT / "engine" / "_toplevel"  # the `tailrace` package itself (pyproject.toml's package-dir)


def module_name(path: Path) -> str:
    if path.parent == TOP_LEVEL:
        return "tailrace" if path.name == "__init__.py" else f"tailrace.{path.stem}"
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tailrace", *parts] if parts[0] in INSTALLED else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py"))
            if ".venv" not in p.parts}


MODULES = source_files()


def imported(module: str, path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import statement in the file; `from a import b` counts as a.b
    where a.b is a module, else as a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, node.lineno)
                    for alias in node.names]
    return out


EDGES = [(module, target, line) for module, path in MODULES.items() for target, line in imported(module, path)]


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(source: str, target: str, allowed=lambda module: False) -> list[str]:
    return [f"{module}:{line} imports {name}" for module, name, line in EDGES
            if within(module, source) and within(name, target) and not allowed(module)]


def test_replay_never_imports_trainer():
    assert not violations("tailrace.engine.replay", "tailrace.engine.trainer")


@pytest.mark.parametrize("source, target", [
    ("tailrace.engine.trainer", "tailrace.engine.generator"),
    ("tailrace.engine.generator", "tailrace.engine.trainer"),
    ("tailrace.engine.replay", "tailrace.engine.generator"),
])
def test_roles_meet_only_on_the_wire(source, target):
    assert not violations(source, target)


CORE = [m for m, path in MODULES.items() if path.parent == ROOT / "engine" and path.name != "__init__.py"]


@pytest.mark.parametrize("subpackage", ["trainer", "generator", "replay"])
def test_engine_core_imports_no_subpackage(subpackage):
    found = [v for m in CORE if m not in ENTRY_POINTS for v in violations(m, f"tailrace.engine.{subpackage}")]
    assert not found


@pytest.mark.parametrize("source", ["tailrace.protocol", "tailrace.kernels"])
def test_protocol_and_kernels_import_nothing_of_engine(source):
    assert not violations(source, "tailrace.engine")


@pytest.mark.parametrize("source", [f"tailrace.{folder}" for folder in INSTALLED])
def test_the_package_imports_nothing_of_tools(source):
    assert not violations(source, "tools") and not violations(source, "tests")


def test_import_names_are_tailrace_everywhere():
    bare = [f"{module}:{line} imports {name}" for module, name, line in EDGES
            if name.split(".")[0] in INSTALLED]
    assert not bare


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, name, _ in EDGES:
        if name in MODULES and name != module:
            graph[module].add(name)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module not in done:
            for name in sorted(graph[module]):
                visit(name, [*path, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_scan_sees_the_layout():
    """Guards the guard: the file walk finds the packages, and the resolver sees known edges."""
    assert {"tailrace.engine.replay", "tailrace.engine.trainer.learner", "tailrace.protocol.messages",
            "tailrace.kernels.logprobs", "tools.benches.modelled"} <= set(MODULES)
    assert {"tailrace.engine.samples", "tailrace.engine.losses", "tailrace.engine.data", COMMAND_LINE} <= set(CORE)
    assert ("tailrace.engine.trainer.learner", "tailrace.engine.replay") in {(m, n) for m, n, _ in EDGES}
