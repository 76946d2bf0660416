"""docs/operating.md's "Discard reasons" lists every discard reason the code can count, so the list stays true.

The reasons are found in the source, not in a list kept beside it: string literals given as the reason to
`on_discard`, `ScoringFailed`, `_reclaim` and `on_stop` (also inside a conditional expression), the default
of a `reason` parameter, and the reasons `rollout_problem` returns (service.on_rollout discards with them).
Test: pytest tests/engine/test_discard_reasons.py
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operating.md"
REASON_ARG = {"on_discard": 2, "ScoringFailed": 0, "_reclaim": 1, "on_stop": 0}  # call name -> position
RETURNS_REASONS = {"rollout_problem"}  # functions returning (reason, text) that the service discards with


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _call_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def reasons_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) in REASON_ARG:
            pos = REASON_ARG[_call_name(node)]
            args = [*node.args[pos:pos + 1], *(k.value for k in node.keywords if k.arg == "reason")]
            found |= set().union(*map(_strings, args)) if args else set()
        elif isinstance(node, ast.FunctionDef):
            positional = node.args.args[len(node.args.args) - len(node.args.defaults):]
            found |= {d.value for a, d in zip(positional, node.args.defaults, strict=True)
                      if a.arg == "reason" and isinstance(d, ast.Constant) and isinstance(d.value, str)}
            if node.name in RETURNS_REASONS:
                for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return)):
                    if isinstance(ret.value, ast.Tuple):
                        assert isinstance(ret.value.elts[0], ast.Constant), f"{node.name}: write reasons as literals"
                        found.add(ret.value.elts[0].value)
    return found


def code_reasons() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "engine").rglob("*.py"):
        found |= reasons_in(ast.parse(path.read_text(), filename=str(path)))
    return found


def documented_reasons() -> set[str]:
    text = PAGE.read_text()
    match = re.search(r"^#+ Discard reasons\n(.*?)(?=^#)", text, re.S | re.M)
    assert match, "docs/operating.md has no 'Discard reasons' section"
    return set(re.findall(r"^\| `([a-z_]+)` \|", match.group(1), re.M))


def test_the_scanner_finds_reasons_in_each_form():
    tree = ast.parse(
        "c.on_discard(g, s, 'a')\n"
        "raise ScoringFailed('b' if x else 'c', 'text')\n"
        "self._reclaim(f, reason='d')\n"
        "def on_stop(self, reason='e'): pass\n"
        "def rollout_problem(g, m):\n"
        "    if m: return 'f', 'text'\n"
        "    return None\n")
    assert reasons_in(tree) == set("abcdef")


def test_every_discard_reason_in_the_code_is_documented():
    found = code_reasons()
    # The scanner still sees the code's forms: a reason from each place that discards.
    assert {"generator_dead", "lease_expired", "no_reward_server", "reward_timeout", "bad_rollout",
            "generator_cancelled", "run_ended"} <= found, found
    listed = documented_reasons()
    assert found - listed == set(), f"discard reasons missing from docs/operating.md: {sorted(found - listed)}"
    assert listed - found == set(), f"docs/operating.md lists reasons the code never uses: {sorted(listed - found)}"
