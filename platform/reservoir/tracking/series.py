"""What trackers log at a step beyond the step's own metrics, read from the store.

Each step is a window: from the commit of the step before it to its own commit. In it the
explorers' rounds (explorer_rounds) give `explorer/rollouts_per_s` (experiences written per
second of the window), `explorer/rollouts`, `explorer/rounds`, `explorer/generate_tokens_per_s`
(response tokens per second of generation) and `explorer/update_s` (the longest in-place weight
update the window's rounds waited for); the pipeline runs over the run that finished in it give
`pipeline/<name>/<operator>/kept`, `dropped` and `changed`. A step with a held-out evaluation
(`eval/accuracy`) also gets a few of the rows it trained on as samples. Everything comes from
the store, so a replay (`reservoir runs track`) logs what live tracking logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLES = 4  # rows shown at each evaluation


@dataclass
class StepSeries:
    scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    samples: dict[int, list[dict]] = field(default_factory=dict)


def step_series(store, run_id: int, steps: list[tuple]) -> StepSeries:
    """The extra series of `steps` ((step, stage, loss, metrics, created_at) each, in order)."""
    series = StepSeries()
    if not steps:
        return series
    before = store.ledger.step_time(run_id, steps[0][0] - 1)
    times = [row[4] for row in steps]
    bounds = ([before] if before is not None else []) + times
    offset = 1 if before is not None else 0  # window i ends at bounds[i], the step times[i-offset]
    rounds = store.rounds.per_window(run_id, bounds)
    counts = store.pipelines.operator_counts(run_id, bounds)
    for index in range(1, len(bounds)):
        step = steps[index - offset][0]
        seconds = (bounds[index] - bounds[index - 1]).total_seconds()
        values = series.scalars.setdefault(step, {})
        window = rounds.get(index)
        if window is not None:
            values.update(_explorer(window, seconds))
        for (pipeline, operator), (kept, dropped, changed) in counts.get(index, {}).items():
            prefix = f"pipeline/{pipeline}/{operator}"
            values.update({f"{prefix}/kept": kept, f"{prefix}/dropped": dropped,
                           f"{prefix}/changed": changed})
    for step, _, _, metrics, _ in steps:
        if "eval/accuracy" in (metrics or {}):
            series.samples[step] = store.ledger.step_samples(run_id, step, SAMPLES)
    return series


def _explorer(window, seconds: float) -> dict[str, float]:
    values = {"explorer/rounds": float(window.rounds),
              "explorer/rollouts": float(window.experiences)}
    if seconds > 0:
        values["explorer/rollouts_per_s"] = window.experiences / seconds
    if window.generate_s > 0:
        values["explorer/generate_tokens_per_s"] = window.response_tokens / window.generate_s
    if window.update_s_max is not None:
        values["explorer/update_s"] = window.update_s_max
    return values
