"""`reservoir metrics serve`: the store as Prometheus series, read once per scrape.

Each scrape reads the gauges (store.read_gauges: one statement as the reader, bounded in
time) and turns them into series labelled by run, pipeline or schedule. Counters are the
store's own (rows written, rows sampled, the last step), so `rate()` gives writer rows/s and
steps/s across restarts of this exporter. A scrape that cannot read the store still answers:
`reservoir_scrape_error{kind}` is 1 for what went wrong (connect: unreachable or the login
refused; timeout; query) and the store's series are absent for that scrape.
"""

from __future__ import annotations

import datetime as dt
import hmac
import sys
import time
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from reservoir.errors import StoreError, UserSQLError
from reservoir.http import Guard, served_hosts
from reservoir.store import read_gauges

ERROR_KINDS = ("connect", "timeout", "query", "other")
WAITING = ("raw", "ready", "leased", "held", "quarantined")
PIPELINE_STATUSES = ("running", "succeeded", "failed", "dry_run", "abandoned")


class StoreCollector:
    """A prometheus_client collector: `collect()` reads the store once and yields every family."""

    def __init__(self, url: str, *, reader_url: str | None, timeout_s: float, runs: int) -> None:
        self.url, self.reader_url, self.timeout_s, self.runs = url, reader_url, timeout_s, runs
        self.failures = dict.fromkeys(ERROR_KINDS, 0)
        self.last_error: str | None = None

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        started, gauges, error = time.monotonic(), None, None
        try:
            gauges = read_gauges(self.url, reader_url=self.reader_url,
                                 timeout_s=self.timeout_s, runs=self.runs)
        except Exception as exc:
            error = _kind(exc)
            self.failures[error] += 1
            self._warn(error, exc)
        else:
            self.last_error = None
        if gauges is not None:
            yield from families(gauges)
        failed = GaugeMetricFamily("reservoir_scrape_error", "1 when this scrape could not "
                                   "read the store, by kind (connect, timeout, query, other)",
                                   labels=["kind"])
        total = CounterMetricFamily("reservoir_scrape_errors", "Scrapes that could not read "
                                    "the store since the exporter started, by kind",
                                    labels=["kind"])
        for kind in ERROR_KINDS:
            failed.add_metric([kind], float(kind == error))
            total.add_metric([kind], self.failures[kind])
        yield failed
        yield total
        yield GaugeMetricFamily("reservoir_scrape_duration_seconds", "Seconds this scrape "
                                "spent reading the store", value=time.monotonic() - started)

    def _warn(self, kind: str, exc: Exception) -> None:
        """One line on stderr when the store becomes unreadable (not one per scrape)."""
        if self.last_error != kind:
            print(f"warning: metrics: cannot read the store ({kind}): "
                  f"{' '.join(str(exc).split())[:300]}", file=sys.stderr, flush=True)
        self.last_error = kind


def _kind(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, UserSQLError):
        return "query"
    if isinstance(exc, StoreError):
        return "connect"
    return "other"


def families(gauges: dict[str, Any]) -> Iterator:
    """Every series of one reading of the store."""
    yield from _runs(gauges["runs"])
    yield from _pipelines(gauges["pipelines"], gauges["schedules"])
    yield from _database(gauges["database"])


def _runs(runs: list[dict]) -> Iterator:
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily)

    def gauge(name: str, doc: str, labels=("run",)):
        return GaugeMetricFamily(name, doc, labels=list(labels))

    info = gauge("reservoir_run_info", "1 per run read, labelled by its status",
                 ("run", "status"))
    rows = gauge("reservoir_run_rows", "Experiences waiting, by status (consumed and "
                 "retired rows are not counted: see the rows_* counters)", ("run", "status"))
    ready_age = gauge("reservoir_run_oldest_ready_age_seconds", "Age of the oldest ready row "
                      "(0 when none waits)")
    raw_age = gauge("reservoir_run_oldest_raw_age_seconds", "Age of the oldest raw row: how "
                    "far the run's stream pipelines lag (0 when none waits)")
    step_age = gauge("reservoir_run_last_step_age_seconds", "Seconds since the last train step")
    version = gauge("reservoir_run_policy_version", "The latest published policy version")
    staleness = gauge("reservoir_run_staleness", "Mean staleness (versions) of the last step's "
                      "batch")
    written = CounterMetricFamily("reservoir_run_rows_written", "Experiences written (rate: "
                                  "writer rows/s)", labels=["run"])
    sampled = CounterMetricFamily("reservoir_run_rows_sampled", "Experiences handed to a "
                                  "trainer and not handed back", labels=["run"])
    steps = CounterMetricFamily("reservoir_run_train_steps", "The last committed train step "
                                "(rate: steps/s)", labels=["run"])
    lease = HistogramMetricFamily("reservoir_run_lease_wait_seconds", "Seconds each step waited "
                                  "for its batch's lease", labels=["run"])
    commit = HistogramMetricFamily("reservoir_run_commit_seconds", "Seconds each step's commit "
                                   "took", labels=["run"])
    for run in runs:
        name = [run["run"]]
        info.add_metric([run["run"], run["status"]], 1)
        for status in WAITING:
            rows.add_metric([run["run"], status], run[status])
        ready_age.add_metric(name, run["oldest_ready_age_s"] or 0.0)
        raw_age.add_metric(name, run["oldest_raw_age_s"] or 0.0)
        written.add_metric(name, run["rows_written"])
        sampled.add_metric(name, run["rows_sampled"])
        steps.add_metric(name, max(run["last_step"] or 0, 0))
        for family, value in ((step_age, run["last_step_age_s"]),
                              (version, run["latest_version"]),
                              (staleness, run["staleness_mean"])):
            if value is not None:
                family.add_metric(name, value)
        for family, bins, total in ((lease, run["lease_wait_bins"], run["lease_wait_sum"]),
                                    (commit, run["commit_bins"], run["commit_sum"])):
            family.add_metric(name, buckets(run["latency_bounds"], bins or {}),
                              sum_value=total or 0.0)
    yield from (info, rows, ready_age, raw_age, step_age, version, staleness, written,
                sampled, steps, lease, commit)


def buckets(bounds: list[float], bins: dict[str, int]) -> list[tuple[str, int]]:
    """Cumulative (le, count) pairs from width_bucket's bins: bin i holds the values in
    [bounds[i-1], bounds[i]) (1-based), so `le bounds[k]` counts bins 0..k."""
    counts = [bins.get(str(index), 0) for index in range(len(bounds) + 1)]
    cumulative, out = 0, []
    for bound, count in zip(bounds, counts):
        cumulative += count
        out.append((f"{bound:g}", cumulative))
    out.append(("+Inf", sum(counts)))
    return out


def _pipelines(pipelines: list[dict], schedules: list[dict]) -> Iterator:
    from prometheus_client.core import GaugeMetricFamily

    status = GaugeMetricFamily("reservoir_pipeline_last_run_status", "1 for the status of the "
                               "pipeline's last run", labels=["pipeline", "status"])
    age = GaugeMetricFamily("reservoir_pipeline_last_run_age_seconds", "Seconds since the "
                            "pipeline's last run ended (or began, while running)",
                            labels=["pipeline", "trigger"])
    success = GaugeMetricFamily("reservoir_pipeline_last_success_timestamp_seconds", "When the "
                                "pipeline last succeeded (Unix time)", labels=["pipeline"])
    for pipeline in pipelines:
        for known in PIPELINE_STATUSES:
            status.add_metric([pipeline["pipeline"], known],
                              float(pipeline["last_status"] == known))
        age.add_metric([pipeline["pipeline"], pipeline["last_trigger"]],
                       pipeline["last_run_age_s"])
        if pipeline["last_success_at"]:
            success.add_metric([pipeline["pipeline"]], _unix(pipeline["last_success_at"]))
    scheduled = GaugeMetricFamily("reservoir_schedule_last_success_timestamp_seconds", "When "
                                  "the schedule's pipeline last succeeded (Unix time)",
                                  labels=["schedule"])
    missed = GaugeMetricFamily("reservoir_schedule_missed_runs", "Runs the schedule missed",
                               labels=["schedule"])
    enabled = GaugeMetricFamily("reservoir_schedule_enabled", "1 when the schedule is enabled",
                                labels=["schedule"])
    for schedule in schedules:
        name = [schedule["schedule"]]
        if schedule["last_success_at"]:
            scheduled.add_metric(name, _unix(schedule["last_success_at"]))
        missed.add_metric(name, schedule["missed_runs"])
        enabled.add_metric(name, float(schedule["enabled"]))
    yield from (status, age, success, scheduled, missed, enabled)


def _database(database: dict) -> Iterator:
    from prometheus_client.core import GaugeMetricFamily

    yield GaugeMetricFamily("reservoir_database_size_bytes", "Size of the store's database",
                            value=database["size_bytes"])
    connections = GaugeMetricFamily("reservoir_database_connections", "Sessions on the "
                                    "store's database, by state", labels=["state"])
    for state, count in sorted(database["connections"].items()):
        connections.add_metric([state], count)
    yield connections


def _unix(timestamp: str) -> float:
    return dt.datetime.fromisoformat(timestamp).timestamp()


def create_app(collector: StoreCollector, *, host: str, port: int, token: str | None):
    """GET /metrics (the collector's registry) behind reservoir.http.Guard; with a token,
    a scrape must carry it (Authorization: Bearer)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    app = FastAPI(title="Reservoir metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse("pass the bearer token (Authorization: Bearer ...)",
                                     status_code=401)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Guard(app, hosts=served_hosts(host, port), json_posts=True, max_body=0,
                 refuse=lambda status, message: PlainTextResponse(message, status_code=status))
