"""The import graph, read with `ast` from the source files (every import, also those inside functions):
dependencies point down, tools -> engine -> (kernels, protocol), as docs/architecture.md's "Layout and import names" says.

    engine/*.py         entry points and config only: cli.py (`tailrace`), launch.py (`tailrace run`), api.py
                        (`tailrace.run`), reward_server.py (`tailrace reward`), config.py. Nothing else is
                        loose at the top: a new module goes into the folder of its kind.
    engine/core/        shared types and utilities (samples, losses, models, weights, drafter, metrics,
                        report, preflight, reward_fns, gc_freeze): imports nothing of engine/ but core/ and
                        config.py.
    engine/data/        what the trainer learns from (prompt sources, chat, DPO pairs, parquet rows, built-in
                        tasks): imports only core/, data/ and config.py.
    engine/eval/        suite.py, what an evaluation is, is shared like data/ (the trainer's in-run
                        evaluation, trainer/in_run_eval.py, imports it); main.py (`tailrace eval`) is an
                        entry point: it runs the generator's backend and the trainer's reward dispatcher in
                        one process.
    shared              config.py, core/, data/ and eval/suite.py import no role (trainer/, generator/,
                        replay/) and no entry point; only the entry points do.
    engine/replay/      never imports engine/trainer/: the types both use (samples, prompt records, the
                        SequenceLoss call and its normaliser) live below them, in engine/core/samples.py and
                        engine/core/losses.py. engine/trainer/ may import engine/replay/: the learner runs the
                        branch-replay strategies, so replay is a library the trainer uses, never the reverse.
    engine/trainer/     and engine/generator/ never import each other (they meet only on the wire); nor
                        does engine/replay/ import engine/generator/.
    engine/generator/   speculation/ imports nothing of torch_backend/ or engine_backends/: the torch backend
                        uses speculation, never the reverse; engine_backends/ (vLLM, SGLang) import nothing
                        of torch_backend/ or speculation/.
    protocol/, kernels/ import nothing of engine/.
    engine/, kernels/, protocol/ import nothing of tools/ (benchmark machinery stays in tools/).
    everywhere          the import names are tailrace.*: no bare `engine`, `kernels` or `protocol`.
    no cycles           between modules, counting every import.
    tests/              no test module imports another (bare `test_*` or `tests.*.test_*`), and nothing is
                        imported as `tests.*` from the working directory: shared helpers are conftest.py
                        fixtures, or non-test modules beside a conftest.py that pytest puts on sys.path.

Run: pytest tests/test_layering.py
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ("engine", "kernels", "protocol")  # folders whose import names are tailrace.<folder>
SCANNED = (*INSTALLED, "tools", "tests", "examples")
COMMAND_LINE = "tailrace.engine.cli"
# The commands a user starts; eval/main.py (`tailrace eval`) runs the generator's backend and the trainer's
# reward dispatcher in one process.
ENTRY_POINTS = {COMMAND_LINE, "tailrace.engine.launch", "tailrace.engine.api", "tailrace.engine.reward_server",
                "tailrace.engine.eval.main"}
TOP_LEVEL_MODULES = {*(m for m in ENTRY_POINTS if m.count(".") == 2), "tailrace.engine.config"}
ROLES = ("tailrace.engine.trainer", "tailrace.engine.generator", "tailrace.engine.replay")


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


def test_engine_top_level_holds_entry_points_and_config():
    loose = {m for m, path in MODULES.items() if path.parent == ROOT / "engine" and path.name != "__init__.py"}
    assert loose == TOP_LEVEL_MODULES


def in_folder(folder: str) -> list[str]:
    return [m for m in MODULES if within(m, f"tailrace.engine.{folder}")]


SHARED = ["tailrace.engine.config", *in_folder("core"), *in_folder("data"), "tailrace.engine.eval.suite"]


@pytest.mark.parametrize("folder, may_import", [
    ("core", ("core", "config")),
    ("data", ("core", "data", "config")),
])
def test_shared_folders_import_only_below(folder, may_import):
    found = [f"{module}:{line} imports {name}" for module, name, line in EDGES
             if within(module, f"tailrace.engine.{folder}") and within(name, "tailrace.engine")
             and name != "tailrace.engine" and not any(within(name, f"tailrace.engine.{ok}") for ok in may_import)]
    assert not found


@pytest.mark.parametrize("target", [*ROLES, *sorted(ENTRY_POINTS)])
def test_shared_modules_import_no_role_and_no_entry_point(target):
    found = [v for m in SHARED for v in violations(m, target)]
    assert not found


@pytest.mark.parametrize("source, target", [
    ("tailrace.engine.generator.speculation", "tailrace.engine.generator.torch_backend"),
    ("tailrace.engine.generator.speculation", "tailrace.engine.generator.engine_backends"),
    ("tailrace.engine.generator.engine_backends", "tailrace.engine.generator.torch_backend"),
    ("tailrace.engine.generator.engine_backends", "tailrace.engine.generator.speculation"),
])
def test_generator_folders_point_down(source, target):
    assert not violations(source, target)


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


def test_tests_import_no_test_module_and_nothing_as_tests():
    found = [f"{module}:{line} imports {name}" for module, path in MODULES.items() if within(module, "tests")
             for name, line in imported(module, path)
             if name.split(".")[0] in ("tests", "conftest") or any(p.startswith("test_") for p in name.split("."))]
    assert not found


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
    assert {"tailrace.engine.core.samples", "tailrace.engine.core.losses", "tailrace.engine.data.prompt_sources",
            "tailrace.engine.config", "tailrace.engine.eval.suite"} <= set(SHARED)
    assert ("tailrace.engine.trainer.learner", "tailrace.engine.replay") in {(m, n) for m, n, _ in EDGES}
    assert ("tailrace.engine.data.prompt_sources", "tailrace.engine.core.samples") in {(m, n) for m, n, _ in EDGES}
