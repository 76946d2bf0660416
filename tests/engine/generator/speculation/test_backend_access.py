"""Speculation uses the torch backend through its public members only, read with `ast` from the source.

speculation/*.py may read the backend's public API (rows, device, policy_version, lm_head, static_forwards,
policy_forward) and the shared row state's (torch_backend/rows.py), never a `_name` of either: the
backend, the rows it shares, and every local name bound to them (`b = self.backend`, `kv, rows =
self.rows.kv, ...`, a parameter named backend) are followed through assignments within each function.
Run: pytest tests/engine/generator/speculation/test_backend_access.py
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
SPECULATION = ROOT / "engine" / "generator" / "speculation"
SHARED = ("backend", "rows")  # self.backend / backend.rows / self.rows: the objects speculation shares


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _shared(node: ast.expr, aliases: set[str]) -> bool:
    """Whether an expression is the backend or its row state: a name bound to one, self.backend,
    self.rows, backend.rows."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.Attribute) and node.attr in SHARED:
        return isinstance(node.value, ast.Name) and node.value.id == "self" or _shared(node.value, aliases)
    return False


def _bind(target: ast.expr, value: ast.expr, aliases: set[str]) -> None:
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts, strict=True):
            _bind(t, v, aliases)
    elif isinstance(target, ast.Name) and _shared(value, aliases):
        aliases.add(target.id)


def private_accesses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, `expr._name`) for every private attribute read or written on the backend or its row state,
    and every getattr/setattr of a private name on them."""
    out = []
    for func in ast.walk(ast.parse(source, filename)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        aliases = {a.arg for a in (*func.args.args, *func.args.kwonlyargs) if a.arg in SHARED}
        # Assignments first (in source order), so a use anywhere in the function sees its aliases.
        for node in sorted((n for n in ast.walk(func) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
            for target in node.targets:
                _bind(target, node.value, aliases)
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and _shared(node.value, aliases):
                out.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                  and _shared(node.args[0], aliases) and isinstance(node.args[1], ast.Constant)
                  and _is_private(str(node.args[1].value))):
                out.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})"))
    return sorted(set(out))


def test_speculation_touches_no_private_attribute_of_the_backend():
    found = {path.name: private_accesses(path.read_text(), str(path)) for path in sorted(SPECULATION.glob("*.py"))}
    assert "speculative.py" in found
    offences = [f"{name}:{line}: {expr}" for name, hits in found.items() for line, expr in hits]
    assert offences == [], "use the backend's public API or backend.rows (torch_backend/rows.py):\n" + "\n".join(
        offences)


def test_the_scan_sees_every_way_of_reaching_in():
    source = '''
class Decoder:
    def __init__(self, backend):
        self.backend = backend
        backend._kv.add_layer()

    def step(self):
        b, kv = self.backend, self.backend.rows.kv
        rows = b.rows
        n = len(b._seqs) + rows._sampling + self.rows._states + kv.end
        self.backend._static.policy()
        getattr(b, "_forward")
        b.rows.kv.end = b.device  # public: fine
        return kv._rows  # the cache's own: not the backend's

def elsewhere(backend):
    backend.rows._x = 1
'''
    assert [expr for _, expr in private_accesses(source)] == [
        "backend._kv", "b._seqs", "rows._sampling", "self.rows._states", "self.backend._static",
        "getattr(b, '_forward')", "backend.rows._x"]
