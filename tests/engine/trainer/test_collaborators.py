"""The trainer service's typed collaborators: early.py, publish.py, watchdog.py and in_run_eval.py each name
what they use of the service in a Protocol. Checked both ways: a constructed TrainerService has every
member (methods with the same parameters, async where the Protocol's are), and each module's functions
touch exactly the members their Protocol names, no more (read from the source with `ast`), no fewer.
Run: pytest tests/engine/trainer/test_collaborators.py
"""

import ast
import inspect
from pathlib import Path

import pytest

from tailrace.engine.config import load_config
from tailrace.engine.trainer import early, in_run_eval, publish, watchdog
from tailrace.engine.trainer.service import TrainerService

COLLABORATORS = [(early, early.EarlyService), (publish, publish.PublishService),
                 (watchdog, watchdog.WatchedService), (in_run_eval, in_run_eval.EvalService)]
IDS = [module.__name__.rpartition(".")[2] for module, _ in COLLABORATORS]


def data_members(proto: type) -> set[str]:
    return set(proto.__dict__.get("__annotations__", {}))


def method_members(proto: type) -> dict[str, object]:
    return {name: fn for name, fn in vars(proto).items() if inspect.isfunction(fn) and not name.startswith("_")}


def missing(service: object, proto: type) -> list[str]:
    """The members of `proto` that `service` lacks or has in another shape."""
    out = [name for name in sorted(data_members(proto)) if not hasattr(service, name)]
    for name, fn in method_members(proto).items():
        have = getattr(service, name, None)
        if not callable(have):
            out.append(name)
        elif inspect.iscoroutinefunction(fn) != inspect.iscoroutinefunction(have):
            out.append(f"{name} (async in one, not the other)")
        elif list(inspect.signature(fn).parameters)[1:] != list(inspect.signature(have).parameters):
            out.append(f"{name}{inspect.signature(have)} (the Protocol has {name}{inspect.signature(fn)})")
    return out


def used_members(module: object, proto: type) -> set[str]:
    """Attributes read or written through a parameter annotated with `proto` in the module's source."""
    tree = ast.parse(Path(module.__file__).read_text())
    used: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs
                  if isinstance(a.annotation, ast.Name) and a.annotation.id == proto.__name__}
        used |= {node.attr for node in ast.walk(fn) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id in params}
    return used


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cfg = load_config(None, ["--train.steps", "1", "--reward.mode", "builtin",
                             "--trainer.runs_dir", str(tmp_path_factory.mktemp("runs")),
                             "--trainer.run_name", "collaborators"])
    return TrainerService(cfg)


@pytest.mark.parametrize(("module", "proto"), COLLABORATORS, ids=IDS)
def test_the_service_has_every_member_of_each_protocol(service, module, proto):
    assert data_members(proto) or method_members(proto)
    assert missing(service, proto) == []


@pytest.mark.parametrize(("module", "proto"), COLLABORATORS, ids=IDS)
def test_a_member_the_service_lost_is_caught(service, module, proto):
    """The check above can fail: each attribute taken off the service in turn is reported."""
    for name in sorted(data_members(proto)):
        value = service.__dict__.pop(name)
        try:
            assert missing(service, proto) == [name]
        finally:
            service.__dict__[name] = value

    class Reshaped(TrainerService):  # each method in another shape than the Protocols'
        def serve_parked(self):
            pass

        def event(self, name, text, now):
            pass

        def spawn(self, coro):
            pass

        def spawn_scoring(self, coro, name):
            pass

    reshaped = object.__new__(Reshaped)
    reshaped.__dict__.update(service.__dict__)
    assert {text.split("(")[0].split()[0] for text in missing(reshaped, proto)} == set(method_members(proto))


@pytest.mark.parametrize(("module", "proto"), COLLABORATORS, ids=IDS)
def test_each_module_touches_exactly_what_its_protocol_names(module, proto):
    used = used_members(module, proto)
    names = data_members(proto) | set(method_members(proto))
    assert used - names == set(), f"{module.__name__} uses service members its {proto.__name__} does not name"
    assert names - used == set(), f"{proto.__name__} names members {module.__name__} never uses"


@pytest.mark.parametrize(("module", "proto"), COLLABORATORS, ids=IDS)
def test_no_function_takes_the_service_untyped(module, proto):
    tree = ast.parse(Path(module.__file__).read_text())
    untyped = [f"{fn.name}({a.arg})" for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
               for a in fn.args.args if a.arg in ("service", "svc")
               and not (isinstance(a.annotation, ast.Name) and a.annotation.id == proto.__name__)]
    assert untyped == []
