"""A pipeline as a worker (`mode: stream`): new raw rows become ready, or quarantined, as they
arrive; a stream over tasks passes each time rows were written to its runs (a curriculum
updated as the run explores). `reservoir run` starts one per pipeline its config names; `reservoir pipeline run` runs
one until Ctrl-C.

Each pass is an ordinary pipeline run (one transaction, a pipeline_runs row with trigger
`stream`); passes with nothing to do are skipped without a row. Streams of the same run should
not select the same rows: put the operators in one pipeline instead. A stream waits for its
runs to be created, and while a run is failed it goes on with the rows there are and waits
for the trainer to resume (run.resume_wait_s, saying so); it ends when its runs have finished
or stopped and nothing is left.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from reservoir.config import ReservoirConfig
from reservoir.errors import ConfigError
from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import PipelineSpec, load_pipeline
from reservoir.store import Listener, Patience, Resumption, Store, rows_channel
from reservoir.errors import ReservoirError
from reservoir.logs import relayed, say

# Rows written to a run notify its channel, which wakes the stream at once; the poll is a
# fallback (and the only wake-up of a stream over every run, which has no channel to listen on).
POLL_S = 0.5
ALL_RUNS_POLL_S = 0.2
DONE = ("finished", "stopped")


@dataclass
class StreamStats:
    pipeline: str
    passes: int = 0
    rows_in: int = 0
    rows_out: int = 0


def stream_spec(path: Path, index: int | None = None) -> PipelineSpec:
    spec = load_pipeline(path)
    if spec.mode != "stream":
        where = f"pipelines[{index}]: " if index is not None else ""
        raise ConfigError(f"{where}{path}: mode is {spec.mode}; a pipeline that runs as a worker "
                          "needs mode: stream")
    return spec


class PipelineWorker:
    def __init__(self, config: ReservoirConfig, path: Path, runs: list[str] | None = None, *,
                 relay=None):
        self.config, self.path = config, Path(path)
        self.runs, self.relay = runs, relay
        spec = stream_spec(self.path)
        if spec.on_tasks and spec.source.runs == "all" and not runs:
            raise ConfigError(f"{path}: a stream over tasks names its runs (source.runs or "
                              "--run): it passes when rows are written to them")
        self.stats = StreamStats(spec.name)
        self._stop = threading.Event()
        self._written = 0  # rows written to its runs when a stream over tasks last passed

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> StreamStats:
        """Pass after pass until asked to stop, or until its runs have ended and it is idle."""
        with relayed(self.relay, f"pipeline {self.stats.pipeline}"):
            return self._stream()

    def _stream(self) -> StreamStats:
        spec, stats = stream_spec(self.path), self.stats
        runs = spec.runs_to_read(self.runs)
        worker = f"pipeline {spec.name}"
        patience = Patience(self.config.store.outage_patience_s,
                            say=lambda line: say(worker, line))
        resumption = Resumption(", ".join(runs), self.config.run.resume_wait_s,
                                say=lambda line: say(worker, line))
        with Store.open(self.config, quiet=True) as store:
            run_ids = patience(lambda: self._run_ids(store, spec, runs), f"pipeline {spec.name}")
            wait_s = POLL_S if run_ids else ALL_RUNS_POLL_S
            with Listener(store.engine, *[rows_channel(r) for r in run_ids]) as listener:
                while not self._stop.is_set():  # a pass lost to a restart is simply run again
                    outcome, failed = patience(
                        lambda: self._pass(store, spec, runs, run_ids, stats),
                        f"pipeline {spec.name}")
                    if outcome == "ended":
                        break
                    resumption.check(failed)
                    if outcome == "idle":
                        listener.wait(wait_s)
        return stats

    def pass_once(self, store: Store) -> StreamStats:
        """One pass now, in the caller's process (a colocated run's, after each round it
        explored); a pass with nothing to do writes nothing."""
        spec = stream_spec(self.path)
        runs = spec.runs_to_read(self.runs)
        run_ids = list(store.runs.ids_of(runs).values())
        self._pass(store, spec, runs, run_ids, self.stats)
        return self.stats

    def _new_tasks_data(self, store: Store, run_ids: list[int]) -> bool:
        """A stream over tasks passes once rows were written to its runs since its last pass
        (each pass reads the tasks its source selects: pass rates, difficulty, priority)."""
        written = store.runs.rows_written(run_ids)
        if written == self._written:
            return False
        self._written = written
        return True

    def _run_ids(self, store: Store, spec: PipelineSpec, runs: list[str]) -> list[int]:
        """The runs' ids, once each exists (waiting up to run.resume_wait_s, saying so)."""
        limit, waited = self.config.run.resume_wait_s, 0.0
        while True:
            found = store.runs.ids_of(runs)
            missing = [name for name in runs if name not in found]
            if not missing:
                return [found[name] for name in runs]
            if waited == 0:
                say(f"pipeline {spec.name}", f"waiting for run {missing[0]!r} to be created "
                                             f"(up to {limit:g} s)")
            if self._stop.is_set():
                return []  # stopping: the loop that would use them does not start
            if waited > limit:
                raise ReservoirError(f"pipeline {spec.name}: run {missing[0]!r} was not created "
                                     f"within {limit:g} s (run.resume_wait_s)")
            self._stop.wait(POLL_S)
            waited += POLL_S

    def _pass(self, store: Store, spec: PipelineSpec, runs: list[str], run_ids: list[int],
              stats: StreamStats) -> tuple[str, bool]:
        """('ended': its runs ended and nothing is left, 'idle': nothing to do, or 'ran'),
        and whether one of its runs is failed (its trainer may resume)."""
        pending = self._new_tasks_data(store, run_ids) if spec.on_tasks else \
            store.pipelines.has_rows(run_ids, spec.source.status)
        statuses = [store.runs.status_of(r) for r in run_ids]
        failed = "failed" in statuses
        if not pending:
            ended = bool(run_ids) and all(status in DONE for status in statuses)
            return ("ended" if ended else "idle"), failed
        result = run_pipeline(store, spec, runs=runs, trigger="stream",
                              source_file=str(self.path))
        stats.passes += 1
        stats.rows_in += result.rows_in
        stats.rows_out += result.rows_out
        return "ran", failed
