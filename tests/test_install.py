"""Installs that no folder of the repository can break, and the pinned set README's commands install:
- the top-level folders engine/, kernels/, protocol/ step aside when imported by their bare names (the
  checkout's root on sys.path: `python -m pytest`, `python -c`, notebooks), so transformers >= 5.25 gets
  Hugging Face's `kernels`, and gets no `kernels` at all where none is installed;
- plain `pytest` and `python -m pytest` both run from the repository root;
- constraints.txt pins every dependency within pyproject.toml's ranges (tools/pin.py writes it);
- CI (.ci/run) runs README's two Quickstart commands verbatim, and its drift stage runs tools/drift.py;
- slow: a fresh venv with the newest transformers and `kernels` runs `tailrace run` and a test file from
  the repository root (CI's drift stage, tools/drift.py, does the same with every newest release).
Run: pytest tests/test_install.py (and -m slow for the fresh venv)
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))
import pin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def python(code: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A copy of the checkout's top-level package folders (their __init__.py files and the step-aside
    module), and a site folder with an `installed` package of each bare name."""
    repo, site = tmp_path / "repo", tmp_path / "site"
    for name in ("engine", "kernels", "protocol"):
        (repo / name).mkdir(parents=True)
        shutil.copy(ROOT / name / "__init__.py", repo / name / "__init__.py")
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
        (site / name / "sub.py").write_text("WHAT = 'a submodule of the installed package'\n")
    (repo / "engine" / "_toplevel").mkdir()
    shutil.copy(ROOT / "engine" / "_toplevel" / "_bare_names.py", repo / "engine" / "_toplevel")
    return repo, site


def test_bare_names_are_the_installed_packages_from_the_checkout_root(checkout):
    repo, site = checkout
    env = dict(os.environ, PYTHONPATH=str(site))
    out = python("import engine, kernels, protocol, kernels.sub; "
                 "print(engine.WHO, kernels.WHO, protocol.WHO, kernels.sub.WHAT, sep='|')", repo, env)
    assert out == "installed engine|installed kernels|installed protocol|a submodule of the installed package"


def test_bare_names_are_empty_namespaces_where_nothing_is_installed(checkout):
    """What transformers' probe reads as "not installed" (no __file__, no version)."""
    repo, _ = checkout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; import kernels, engine; "
            "print(kernels.__path__, getattr(kernels, '__file__', None), engine.__path__, hasattr(kernels, 'step_aside'))")
    assert python(code, repo, env) == "[] None [] False"


def test_transformers_builds_a_model_from_the_repository_root():
    """transformers >= 5.25 imports `kernels` at start-up: from the root it must not get our folder."""
    out = python("import kernels, torch, transformers as t; "
                 "m = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, "
                 "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)); "
                 "print(m(torch.tensor([[1, 2]])).logits.shape[-1], kernels.__path__)", ROOT)
    assert out.startswith("32 ") and str(ROOT / "kernels") not in out, out


@pytest.mark.parametrize("command", [[str(BIN / "pytest")], [sys.executable, "-m", "pytest"]],
                         ids=["pytest", "python -m pytest"])
def test_pytest_runs_from_the_repository_root(command):
    """Plain `pytest` too: the conftest.py files load their helpers without the working directory on sys.path."""
    if not Path(command[0]).exists():
        pytest.skip("no pytest executable beside this interpreter")
    done = subprocess.run([*command, "-q", "-p", "no:cacheprovider", "tests/engine/trainer/test_loss.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]


def test_constraints_pin_every_dependency_within_pyproject_ranges():
    pins = pin.read(ROOT / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = pin.canonical(req.name)
        assert name in pins, f"constraints.txt does not pin {name} (run python tools/pin.py)"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {name}=={pins[name]} outside pyproject.toml's {req.specifier}"
    assert "tailrace" not in pins and pins["torch"] == "2.13.0"


def test_ci_runs_the_readme_commands_verbatim():
    """Both commands of README's Quickstart are lines of .ci/run as they stand, and they install the pinned set."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Quickstart\n")
    quickstart = readme[start:readme.index("\n## ", start + 1)]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, re.S)
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    assert commands[0].endswith("tailrace run") and commands[1].endswith("python -m pytest"), commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert "-c constraints.txt" in command, command
        assert command in ci, f".ci/run does not run README's command verbatim: {command}"
    assert any("python tools/drift.py" in line and not line.lstrip().startswith("#") for line in ci)


def test_pin_renders_what_it_reads(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text(pin.render({"torch": "2.13.0", "transformers": "5.25.0"}))
    assert pin.read(path) == {"torch": "2.13.0", "transformers": "5.25.0"}
    path.write_text("torch>=2\n")
    with pytest.raises(ValueError, match="not `name==version`"):
        pin.read(path)


@pytest.mark.slow
def test_newest_transformers_and_kernels_from_the_repository_root(tmp_path, overlay_venv):
    """A fresh venv (this one's packages reached through a .pth line, so torch is not downloaded again)
    with the newest transformers and Hugging Face `kernels` from the package index, and tailrace
    installed editable: `tailrace run` and a test file, both started in the repository root."""
    vpython = overlay_venv
    venv = vpython.parent.parent
    pip = [str(vpython), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "transformers", "kernels"], check=True, timeout=600)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True, timeout=600)
    versions = python_in(vpython, "import importlib.metadata as m; print(m.version('transformers'), "
                                  "m.version('kernels'))")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    run = subprocess.run([str(venv / "bin" / "tailrace"), "run", "--train.steps", "2", "--no-progress",
                          "--trainer.runs_dir", str(tmp_path / "runs")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{versions}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "2 steps (reached train.steps = 2)" in run.stdout
    tests = subprocess.run([str(vpython), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/replay/test_replay.py"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, f"{versions}\n{tests.stdout[-3000:]}\n{tests.stderr[-2000:]}"


def python_in(exe: Path, code: str) -> str:
    return subprocess.run([str(exe), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
