"""The live view of a run, read from the store alone, so it shows every worker on every machine:
step, reward, held-out accuracy, staleness, rows raw (waiting for a pipeline), ready and leased,
rollouts/s, train tokens/s."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.live import Live
from rich.table import Table

from reservoir.store import Store, describe_outage, is_outage

WINDOW_S = 15.0  # rollouts/s over this much recent time


class Monitor:
    def __init__(self, store: Store, run: str, steps: int) -> None:
        self.store, self.run, self.steps = store, run, steps
        self._inserted: deque[tuple[float, int]] = deque()

    def snapshot(self) -> dict | None:
        row = self.store.runs.snapshot(self.run)
        if row is None:
            return None
        now = time.monotonic()
        self._inserted.append((now, row["rows_inserted"]))
        while now - self._inserted[0][0] > WINDOW_S and len(self._inserted) > 2:
            self._inserted.popleft()
        (t0, rows0), (t1, rows1) = self._inserted[0], self._inserted[-1]
        return dict(row) | {"rollouts_per_s": (rows1 - rows0) / (t1 - t0) if t1 > t0 else 0.0}

    def render(self) -> Table:
        table = Table(title=f"run {self.run}", show_header=False, min_width=46)
        table.add_column(style="bold")
        table.add_column(justify="right")
        try:
            snap = self.snapshot()
        except Exception as exc:  # the store restarting: say so, and try again next refresh
            if not is_outage(exc):
                raise
            table.add_row("store", f"unreachable, retrying ({describe_outage(exc)})")
            return table
        if snap is None:
            table.add_row("status", "waiting for the run to be created")
            return table
        metrics = snap["metrics"] or {}
        progress = snap["progress"] or {}
        if progress:
            table.add_row(f"stage {progress.get('stage', '')}",
                          f"{progress.get('step')} / {progress.get('of')}, loss "
                          f"{_fmt(progress.get('loss'))}")
        for name, value in (
            ("status", snap["status"]),
            ("step", f"{snap['step'] if snap['step'] is not None else '-'} / {self.steps}"),
            ("policy version", _fmt(snap["version"])),
            ("reward mean", _fmt(metrics.get("reward_mean"))),
            ("held-out accuracy", _fmt(snap["accuracy"])),
            ("staleness (mean / max)", f"{_fmt(metrics.get('staleness_mean'))} / "
                                       f"{_fmt(metrics.get('staleness_max'))}"),
            ("rows raw / ready / leased", f"{snap['raw']} / {snap['ready']} / {snap['leased']}"),
            ("rollouts/s", _fmt(snap["rollouts_per_s"], 1)),
            ("train tokens/s", _fmt(metrics.get("train_tokens_per_s"), 0)),
            ("partial groups in the last batch", _fmt(metrics.get("partial_groups"))),
            ("zero-variance groups (no signal)",
             _fmt(metrics.get("advantage/zero_variance_groups"))),
        ):
            table.add_row(name, value)
        return table


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


@contextmanager
def live(monitor: Monitor, console: Console, shown: bool = True) -> Iterator[Callable[[], None]]:
    """A Live display of the monitor; the caller refreshes it with the function given. Not
    `shown` (log lines as JSON): nothing is displayed and refreshing does nothing."""
    if not shown:
        yield lambda: None
        return
    with Live(monitor.render(), console=console, refresh_per_second=2,
              auto_refresh=False) as view:
        yield lambda: view.update(monitor.render(), refresh=True)
        view.update(monitor.render(), refresh=True)
    console.print()
