"""CI's drift stage: installs the newest releases of every dependency (no constraints.txt; torch stays at
the CPU wheel 2.13.0, since an unpinned torch is a multi-GB CUDA build) into a venv of its own and checks
that tailrace still works there, from the repository root and from another folder:

    imports    every module of tailrace.engine / .kernels / .protocol imports
    run        `tailrace run --train.steps 3` trains
    tests      a few fast test files pass (`python -m pytest`, from the repository root)

When a check fails, each distribution whose version differs from constraints.txt is put back to its
pinned version in turn (tailrace's direct dependencies first) and the check rerun, to name the release
that broke it. The last line printed is the verdict, e.g.
    drift: FAILED: transformers 5.26.0 breaks `run from the repository root` (5.25.0, pinned, passes)

    python tools/drift.py [--venv .venv-drift] [--keep]     (about 5 minutes on 2 cores)
Test: pytest tests/test_install.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
from pin import canonical, read  # noqa: E402  (tools/ is not a package that is installed)

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("tests/engine/trainer/test_loss.py", "tests/engine/replay/test_replay.py", "tests/protocol/test_codec.py",
              "tests/kernels/test_logprobs.py")
OPTIONAL = ("vllm", "sglang")  # backends whose modules need their own venv (docs/scaling.md: Generator backends)
IMPORT_ALL = f"""
import importlib, pathlib, sys
root = pathlib.Path({str(ROOT)!r})
failed = []
for folder in ("engine", "kernels", "protocol"):
    for path in sorted((root / folder).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[:2] == ["engine", "_toplevel"]:  # the `tailrace` package itself
            parts = parts[2:]
        name = ".".join(["tailrace", *parts])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in {OPTIONAL!r}:
                continue
            failed.append(f"{{name}}: {{exc!r}}")
        except Exception as exc:
            failed.append(f"{{name}}: {{exc!r}}")
print("\\n".join(failed) or "all modules import")
sys.exit(1 if failed else 0)
"""


@dataclass
class Check:
    name: str
    argv: list[str]
    cwd: Path
    timeout_s: float

    def run(self, env: dict[str, str]) -> tuple[bool, str]:
        started = time.monotonic()
        try:
            done = subprocess.run(self.argv, cwd=self.cwd, env=env, capture_output=True, text=True,
                                  timeout=self.timeout_s)
        except subprocess.TimeoutExpired as exc:
            return False, f"timed out after {self.timeout_s:.0f} s\n{(exc.stdout or b'')[-2000:]!r}"
        ok = done.returncode == 0
        print(f"drift: {self.name}: {'ok' if ok else f'FAILED (code {done.returncode})'} "
              f"in {time.monotonic() - started:.0f} s", flush=True)
        return ok, (done.stdout + done.stderr)[-3000:]


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True, cwd=ROOT)


def build(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(venv, "torch==2.13.0")
    held = venv / "torch-held.txt"  # the exact build just installed (2.13.0+cpu here): never upgraded to CUDA
    held.write_text(f"torch=={versions(venv, local=True)['torch']}\n")
    pip(venv, "--upgrade", "--upgrade-strategy", "eager", "-c", str(held), "-e", ".[dev]")


def versions(venv: Path, local: bool = False) -> dict[str, str]:
    """{canonical name: version} of what is installed in venv (pin.py's view, run there)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import pin; "
            f"print(json.dumps(pin.installed(local={local})))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def direct_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["dev"]
    names = []
    for spec in specs:
        name = spec.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.append(canonical(name))
    return names


def checks(venv: Path, scratch: Path) -> list[Check]:
    python, tailrace = str(venv / "bin" / "python"), str(venv / "bin" / "tailrace")
    run = [tailrace, "run", "--train.steps", "3", "--no-progress", "--trainer.runs_dir", str(scratch / "runs")]
    return [
        Check("imports from the repository root", [python, "-c", IMPORT_ALL], ROOT, 300),
        Check("imports from another folder", [python, "-c", IMPORT_ALL], scratch, 300),
        Check("run from the repository root", run, ROOT, 600),
        Check("run from another folder", run, scratch, 600),
        Check("tests from the repository root", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                 *TEST_FILES], ROOT, 900),
    ]


def blame(venv: Path, check: Check, env: dict[str, str], changed: dict[str, tuple[str, str]]) -> str:
    """The verdict for a failed check: the first changed distribution whose pinned version makes it pass."""
    first = direct_dependencies()
    order = sorted(changed, key=lambda n: (first.index(n) if n in first else len(first), n))
    for name in order:
        pinned, newest = changed[name]
        print(f"drift: trying {name}=={pinned} (installed: {newest}) ...", flush=True)
        pip(venv, "--no-deps", f"{name}=={pinned}")
        ok, _ = check.run(env)
        pip(venv, "--no-deps", f"{name}=={newest}")
        if ok:
            return f"drift: FAILED: {name} {newest} breaks `{check.name}` ({pinned}, pinned, passes)"
    listed = ", ".join(f"{n} {changed[n][0]} -> {changed[n][1]}" for n in order) or "none"
    return f"drift: FAILED: `{check.name}` fails with the newest releases; no single pinned version fixes it " \
           f"(differing from constraints.txt: {listed})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-drift")
    parser.add_argument("--keep", action="store_true", help="reuse --venv if it exists (no fresh install)")
    args = parser.parse_args(argv)
    args.venv = args.venv.resolve()  # the checks run from other folders too
    if not (args.keep and (args.venv / "bin" / "python").exists()):
        build(args.venv)
    pinned = read(ROOT / "constraints.txt")
    newest = versions(args.venv)
    changed = {n: (pinned[n], v) for n, v in newest.items() if n in pinned and pinned[n] != v}
    new = sorted(n for n in newest if n not in pinned)
    print("drift: differs from constraints.txt: "
          + (", ".join(f"{n} {a} -> {b}" for n, (a, b) in sorted(changed.items())) or "nothing")
          + (f"; not pinned: {', '.join(new)}" if new else ""), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{args.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="tailrace-drift-") as scratch:
        for check in checks(args.venv, Path(scratch)):
            ok, output = check.run(env)
            if not ok:
                print(output, file=sys.stderr)
                print(blame(args.venv, check, env, changed), flush=True)
                return 1
    print(f"drift: OK: the newest releases pass every check ({len(changed)} differing from constraints.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
