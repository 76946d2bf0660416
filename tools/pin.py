"""Writes constraints.txt: the exact versions of every distribution installed in this environment, the
pinned set that README's install commands use (`pip install -c constraints.txt -e .`).

Run it in the venv that README's test command built and CI tested (torch's CPU wheel first, then
`.[dev]`), after the suite passed:

    python tools/pin.py            # writes constraints.txt at the repository root
    python tools/pin.py --check    # exit 1 when this environment differs from constraints.txt

tailrace itself, pip/setuptools/wheel and editable installs are left out; a local version label
(`torch 2.13.0+cpu`) is dropped, so `torch==2.13.0` also admits a CUDA build of the same release.
Test: pytest tests/test_install.py
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"tailrace", "pip", "setuptools", "wheel"}
HEADER = """\
# The pinned set of every dependency, written by `python tools/pin.py` from the environment that README's
# test command built and the test suite passed in (Python {python}, {machine}). README's install commands
# use it: pip install -c constraints.txt -e '.[dev]'. pyproject.toml keeps the ranges; CI's drift stage
# (tools/drift.py) installs the newest releases without this file and names the one that breaks.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(local: bool = False) -> dict[str, str]:
    """{canonical name: version} of every regular (non-editable) distribution on sys.path; with `local`
    the versions keep their local label (2.13.0+cpu)."""
    out = {}
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"] or "")
        direct = dist.read_text("direct_url.json")
        if not name or name in SKIPPED or (direct and json.loads(direct).get("dir_info", {}).get("editable")):
            continue
        out[name] = dist.version if local else dist.version.split("+")[0]
    return dict(sorted(out.items()))


def read(path: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: {line!r} is not `name==version`")
            pins[canonical(name)] = version.strip()
    return pins


def render(pins: dict[str, str]) -> str:
    header = HEADER.format(python=platform.python_version(), machine=f"{platform.system()} {platform.machine()}")
    return header + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    parser.add_argument("--check", action="store_true", help="compare this environment with --out, write nothing")
    args = parser.parse_args(argv)
    pins = installed()
    if args.check:
        pinned = read(args.out)
        changed = {n: (pinned.get(n), pins.get(n)) for n in pinned.keys() | pins.keys() if pinned.get(n) != pins.get(n)}
        for name, (want, have) in sorted(changed.items()):
            print(f"{name}: pinned {want or '-'}, installed {have or '-'}")
        return 1 if changed else 0
    args.out.write_text(render(pins))
    print(f"pin: {len(pins)} distributions written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
