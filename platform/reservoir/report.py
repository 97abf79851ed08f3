"""`reservoir report RUN -o DIR`: PNG plots of a run and an HTML page that shows them."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
import pandas as pd  # noqa: E402

from reservoir.errors import StoreError  # noqa: E402
from reservoir.store import Store  # noqa: E402

def _plot(path: Path, title: str, xlabel: str, series: dict[str, pd.Series],
          kind: str = "line") -> Path:
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for label, values in series.items():
        values = values.dropna()
        if kind == "bar":
            axes.bar(values.index, values.values, label=label)
        else:
            axes.plot(values.index, values.values, marker="." if len(values) < 60 else None,
                      label=label)
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.grid(alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(store: Store, run: str, out_dir: Path) -> Path:
    """Write the plots and index.html for a run; returns the HTML file."""
    steps = pd.DataFrame(store.ledger.step_history(run),
                         columns=["step", "created_at", "loss", "accuracy", "reward_mean",
                                  "response_len_mean"])
    staleness = pd.DataFrame(store.ledger.staleness_counts(run), columns=["staleness", "n"])
    if steps.empty:
        raise StoreError(f"run {run!r} has no train steps to report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_step = steps.set_index("step")
    minutes = (steps["created_at"] - steps["created_at"].min()).dt.total_seconds() / 60
    by_minute = steps.assign(minute=minutes).set_index("minute")
    plots = [
        _plot(out_dir / "reward_per_step.png", "reward (batch mean) per step", "step",
              {"reward": by_step["reward_mean"]}),
        _plot(out_dir / "accuracy_per_step.png", "held-out accuracy per step", "step",
              {"accuracy": by_step["accuracy"]}),
        _plot(out_dir / "per_minute.png", "reward and accuracy over time", "minutes",
              {"reward": by_minute["reward_mean"], "accuracy": by_minute["accuracy"]}),
        _plot(out_dir / "response_length.png", "response length (tokens) per step", "step",
              {"length": by_step["response_len_mean"]}),
        _plot(out_dir / "staleness.png", "staleness of trained rows (versions)", "staleness",
              {"rows": staleness.set_index("staleness")["n"]}, kind="bar"),
    ]
    page = out_dir / "index.html"
    page.write_text(_html(run, steps, plots))
    return page


def _html(run: str, steps: pd.DataFrame, plots: list[Path]) -> str:
    accuracy = steps["accuracy"].dropna()
    facts = [("steps", int(steps["step"].max())),
             ("accuracy first → last", f"{accuracy.iloc[0]:.3f} → {accuracy.iloc[-1]:.3f}"
              if len(accuracy) else "not measured"),
             ("reward, last step", f"{steps['reward_mean'].dropna().iloc[-1]:.3f}"
              if steps["reward_mean"].notna().any() else "-")]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in facts)
    images = "".join(f'<figure><img src="{p.name}" alt="{p.stem}"></figure>' for p in plots)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;"
            "margin:.5em}th{text-align:left;padding-right:1em}</style></head><body>"
            f"<h1>Run {html.escape(run)}</h1><table>{rows}</table>{images}</body></html>")
