"""Prometheus metrics (issue 33): `reservoir metrics serve` scraped with prometheus_client's
own parser while a run goes on moves as the SQL views say; a reader login that fails or a
database too slow to answer gives a scrape error series at once, never a hung scrape.
(`/metrics` of `reservoir serve` and of the review page: tests/test_serve.py and
tests/test_review_page.py, on the servers those tests start.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psycopg2
import pytest

from reservoir.metrics.exporter import StoreCollector
from reservoir.plan import urls
from tests.test_colocated import colocated
from reservoir.store import Store
from tests.test_recovery import finish, offline_groups, query, start, wait_for, write_config
from tests.test_serve import free_port, responds


def scrape(url: str, **headers: str) -> dict[tuple, float]:
    """{(sample name, (label, value), ...): value} of one scrape, read by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = httpx.get(url, headers=headers, timeout=15)
    assert answer.status_code == 200, answer.text
    return {(sample.name, *sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(answer.text)
            for sample in family.samples}


def collected(collector: StoreCollector) -> dict[tuple, float]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    registry.register(collector)
    return {(sample.name, *sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def as_the_views_say(db_url: str, run: str) -> dict[str, int]:
    [row] = query(db_url, "SELECT ready, leased, coalesce(last_step, 0) AS last_step, "
                          "rows_inserted, latest_version FROM analytics.runs WHERE run = :run",
                  run=run)
    return dict(row._mapping)


@pytest.mark.slow
@pytest.mark.process
def test_metrics_serve_moves_with_a_run_as_the_views_say(tmp_path, db_url):
    port = free_port()
    raw = colocated(tmp_path, db_url, trainer={"steps": 8, "eval_interval": 100})
    config = write_config(tmp_path / "run.yaml", raw)
    exporter = start("metrics", "serve", "--port", str(port), "-c", str(config), cwd=tmp_path)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_for(lambda: exporter.poll() is not None or responds(url), timeout=60)
        assert exporter.poll() is None, exporter.stdout.read()
        assert ("reservoir_run_info", ("run", "c"), ("status", "running")) not in scrape(url)
        run = start("run", str(config), cwd=tmp_path)
        steps_seen = set()
        while run.poll() is None:  # a counter read between two reads of the view lies between
            before = as_the_views_say(db_url, "c") if query(
                db_url, "SELECT 1 FROM analytics.runs WHERE run = 'c'") else None
            got = scrape(url)
            if before is None or ("reservoir_run_train_steps_total", ("run", "c")) not in got:
                continue
            after = as_the_views_say(db_url, "c")
            step = got[("reservoir_run_train_steps_total", ("run", "c"))]
            written = got[("reservoir_run_rows_written_total", ("run", "c"))]
            assert before["last_step"] <= step <= after["last_step"]
            assert before["rows_inserted"] <= written <= after["rows_inserted"]
            assert got[("reservoir_scrape_error", ("kind", "connect"))] == 0
            steps_seen.add(step)
            time.sleep(0.2)
        finish(run)
        assert len(steps_seen) >= 3, steps_seen
        got, final = scrape(url), as_the_views_say(db_url, "c")
        label = ("run", "c")
        assert got[("reservoir_run_train_steps_total", label)] == final["last_step"] == 8
        assert got[("reservoir_run_rows", label, ("status", "ready"))] == final["ready"]
        assert got[("reservoir_run_rows", label, ("status", "leased"))] == final["leased"] == 0
        assert got[("reservoir_run_policy_version", label)] == final["latest_version"]
        assert got[("reservoir_run_info", label, ("status", "finished"))] == 1
        timed = query(db_url, "SELECT count(*) FILTER (WHERE metrics ? 'wait_s'), "
                              "count(*) FILTER (WHERE metrics ? 'commit_s') FROM train_steps")[0]
        assert got[("reservoir_run_lease_wait_seconds_count", label)] == timed[0] == 8
        assert got[("reservoir_run_commit_seconds_count", label)] == timed[1] == 7
        assert got[("reservoir_run_commit_seconds_bucket", ("le", "+Inf"), label)] == 7
        assert got[("reservoir_database_size_bytes",)] > 0
        # rows an explorer writes and a trainer leases (a sync run leases them at once)
        with Store(db_url) as store:
            store.write_groups(offline_groups("c", 3))
            assert scrape(url)[("reservoir_run_rows", label, ("status", "ready"))] == \
                as_the_views_say(db_url, "c")["ready"] == 12
            store.lease("c", groups=2)
            got, now = scrape(url), as_the_views_say(db_url, "c")
            assert got[("reservoir_run_rows", label, ("status", "ready"))] == now["ready"] == 4
            assert got[("reservoir_run_rows", label, ("status", "leased"))] == now["leased"] == 8
    finally:
        os.killpg(exporter.pid, signal.SIGINT)
        exporter.communicate(timeout=60)


def test_a_reader_login_that_fails_is_a_scrape_error_at_once(db_url):
    wrong = urls.with_user(db_url, "no_such_reader")
    began = time.monotonic()
    got = collected(StoreCollector(db_url, reader_url=wrong, timeout_s=2.0, runs=10))
    assert time.monotonic() - began < 5
    assert got[("reservoir_scrape_error", ("kind", "connect"))] == 1
    assert got[("reservoir_scrape_errors_total", ("kind", "connect"))] == 1
    assert not any(key[0].startswith("reservoir_run_") for key in got)


def test_a_database_too_slow_to_answer_is_a_scrape_error_not_a_hung_scrape(store, db_url):
    """A session holding an exclusive lock on the runs table: the gauges wait on it, and the
    statement timeout ends the scrape in about its timeout."""
    store.create_run("slow")
    locker = psycopg2.connect(db_url)
    try:
        with locker.cursor() as cursor:
            cursor.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
            collector = StoreCollector(db_url, reader_url=None, timeout_s=1.0, runs=10)
            began = time.monotonic()
            got = collected(collector)
            took = time.monotonic() - began
        assert took < 4, took
        assert got[("reservoir_scrape_error", ("kind", "timeout"))] == 1
        assert got[("reservoir_scrape_duration_seconds",)] < 4
    finally:
        locker.rollback()
        locker.close()
    got = collected(collector)  # the lock gone, the next scrape reads the store again
    assert got[("reservoir_scrape_error", ("kind", "timeout"))] == 0
    assert got[("reservoir_scrape_errors_total", ("kind", "timeout"))] == 1
    assert got[("reservoir_run_info", ("run", "slow"), ("status", "created"))] == 1


def test_the_grafana_dashboard_reads_only_series_reservoir_exports(db_url, store):
    """examples/grafana/reservoir.json: every metric an expression names is one the exporter,
    `reservoir serve` or the review page exposes, with a suffix its type has (_total of a
    counter, _bucket of a histogram)."""
    import json
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from reservoir.metrics.requests import COUNTERS, RequestMetrics

    store.create_run("dashboard-run")
    registry = CollectorRegistry()
    registry.register(StoreCollector(db_url, reader_url=None, timeout_s=5.0, runs=10))
    texts = [generate_latest(registry)] + [RequestMetrics(service).exposition()[0]
                                           for service in COUNTERS]
    exposed = {sample_name: family.type for text in texts
               for family in text_string_to_metric_families(text.decode())
               for sample_name in _sample_names(family)}
    dashboard = json.loads((Path(__file__).parents[1] / "examples/grafana/reservoir.json")
                           .read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    named = {name for panel in panels for target in panel["targets"]
             for name in re.findall(r"\breservoir_\w+", target["expr"])}
    assert len(panels) >= 20 and len(named) >= 25
    assert not named - set(exposed), f"series the dashboard reads that nothing exports: " \
                                     f"{sorted(named - set(exposed))}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24 for panel in panels)


def _sample_names(family) -> list[str]:
    """The names a family's samples take in PromQL."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}[family.type]
    return [family.name + suffix for suffix in suffixes]
