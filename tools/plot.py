"""PNG plots of one or more runs' metrics.jsonl, several runs overlaid with a legend.

    python tools/plot.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out curves.png

Panels, each drawn when some run logged its metrics: reward (mean, with a band of one std), loss,
staleness (mean and max), branch-replay saving (logical / unique tokens), training tokens/s, speculation
acceptance, and every eval/... figure (not the evaluation's bookkeeping: its size, version, time, failures).
Default --out: plot.png next to the first file.
Test: pytest tests/tools/test_timeline.py
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

Series = Callable[[dict], float | None]


def _key(name: str) -> Series:
    return lambda r: r.get(name)


def _ratio(top: str, bottom: str) -> Series:
    return lambda r: r[top] / r[bottom] if r.get(top) is not None and r.get(bottom) else None


PANELS: list[tuple[str, list[tuple[str, Series]]]] = [
    ("reward", [("mean", _key("trainer/reward/mean"))]),
    ("loss", [("total", _key("trainer/loss/total"))]),
    ("staleness (policy versions)", [("mean", _key("trainer/staleness/mean")), ("max", _key("trainer/staleness/max"))]),
    ("replay saving (logical / unique tokens)", [("", _ratio("trainer/strategy/logical_tokens",
                                                             "trainer/strategy/unique_tokens"))]),
    ("training tokens/s", [("", _ratio("trainer/tokens/logical", "trainer/time/step_s"))]),
    ("speculation acceptance", [("", _key("generator/spec/accept_rate"))]),
]


def load(path: str | Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written as we read
            continue
    return [r for r in records if isinstance(r.get("step"), int)]


EVAL_BOOKKEEPING = ("eval/num_prompts", "eval/policy_version", "eval/seconds", "eval/samples_failed")


def _panels(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, list[tuple[str, Series]]]]:
    evals = sorted({k for _, records in runs for r in records for k in r
                    if k.startswith("eval/") and k not in EVAL_BOOKKEEPING})
    panels = PANELS + [(k, [("", _key(k))]) for k in evals]
    return [p for p in panels if any(fn(r) is not None for _, records in runs for r in records for _, fn in p[1])]


def plot(runs: list[tuple[str, list[dict]]], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(runs)
    if not panels:
        raise ValueError("no known metric in these files")
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for i, (label, records) in enumerate(runs):
            colour = f"C{i}"
            for j, (name, fn) in enumerate(series):
                points = [(r["step"], fn(r)) for r in records if fn(r) is not None]
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, color=colour, linestyle="-" if j == 0 else "--",
                        label=" ".join(x for x in (label, name) if x))
            if title == "reward":
                band = [(r["step"], r["trainer/reward/mean"], r["trainer/reward/std"]) for r in records
                        if r.get("trainer/reward/mean") is not None and r.get("trainer/reward/std") is not None]
                if band:
                    steps, mean, std = zip(*band, strict=True)
                    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                                    [m + s for m, s in zip(mean, std, strict=True)], color=colour, alpha=0.15,
                                    linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PNG plots of tailrace metrics.jsonl files.")
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files (runs/NAME/metrics.jsonl) or run folders")
    parser.add_argument("--out", default="", help="the PNG to write (default: plot.png beside the first file)")
    args = parser.parse_args(argv)
    paths = [Path(p) / "metrics.jsonl" if Path(p).is_dir() else Path(p) for p in args.metrics]
    try:
        runs = [(p.parent.name or str(p), load(p)) for p in paths]
        out = plot(runs, args.out or paths[0].parent / "plot.png")
    except (OSError, ValueError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
