"""PNG plots of one or more runs' metrics.jsonl, several runs overlaid with a legend.

    python tools/plot.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out curves.png [--x elapsed]

Panels, each drawn when some run logged its metrics: reward (mean, with a band of one std), the share of
groups without signal (every sample of the group got one reward), completion length in tokens (mean and
max), loss, staleness (mean and max), branch-replay saving (logical / unique tokens), training tokens/s,
speculation acceptance, and every eval/... figure (not the evaluation's bookkeeping: its size, version,
time, failures). The x axis is the optimizer step, or with --x elapsed the wall-clock seconds since the run
began (trainer/time/elapsed_s, counted across resumes). Default --out: plot.png next to the first file.
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
    ("groups without signal (reward std 0)", [("", _key("trainer/reward/frac_zero_std"))]),
    ("completion tokens", [("mean", _key("trainer/completion/mean_tokens")),
                           ("max", _key("trainer/completion/max_tokens"))]),
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
X_AXES = {"step": ("step", "step"), "elapsed": ("trainer/time/elapsed_s", "elapsed s (wall clock)")}


def _panels(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, list[tuple[str, Series]]]]:
    evals = sorted({k for _, records in runs for r in records for k in r
                    if k.startswith("eval/") and k not in EVAL_BOOKKEEPING})
    panels = PANELS + [(k, [("", _key(k))]) for k in evals]
    return [p for p in panels if any(fn(r) is not None for _, records in runs for r in records for _, fn in p[1])]


def points_of(records: list[dict], fn: Series, x_key: str) -> list[tuple[float, float]]:
    """(x, y) of the records that have both."""
    return [(r[x_key], fn(r)) for r in records if fn(r) is not None and r.get(x_key) is not None]


def plot(runs: list[tuple[str, list[dict]]], out: str | Path, x: str = "step") -> Path:
    """x: "step" or "elapsed" (X_AXES); records without that field are left out."""
    x_key, x_label = X_AXES[x]
    for label, records in runs:
        if not any(r.get(x_key) is not None for r in records):
            raise ValueError(f"{label}: no {x_key} in its metrics to put on the x axis (use --x step)")
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
                points = points_of(records, fn, x_key)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, color=colour, linestyle="-" if j == 0 else "--",
                        label=" ".join(x for x in (label, name) if x))
            if title == "reward":
                band = [(r[x_key], r["trainer/reward/mean"], r["trainer/reward/std"]) for r in records
                        if r.get("trainer/reward/mean") is not None and r.get("trainer/reward/std") is not None
                        and r.get(x_key) is not None]
                if band:
                    steps, mean, std = zip(*band, strict=True)
                    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                                    [m + s for m, s in zip(mean, std, strict=True)], color=colour, alpha=0.15,
                                    linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_label)
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
    parser.add_argument("--x", choices=sorted(X_AXES), default="step",
                        help="x axis: the optimizer step (default) or elapsed wall-clock seconds since the run began")
    args = parser.parse_args(argv)
    paths = [Path(p) / "metrics.jsonl" if Path(p).is_dir() else Path(p) for p in args.metrics]
    try:
        runs = [(p.parent.name or str(p), load(p)) for p in paths]
        out = plot(runs, args.out or paths[0].parent / "plot.png", x=args.x)
    except (OSError, ValueError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
