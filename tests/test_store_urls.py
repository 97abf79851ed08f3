"""Runs over several PostgreSQL servers (`store.urls`, issue 34): the first server's run_servers
says where each run lives, every part of a run works on that server only, commands route by
run, `sql --all` reads every server, and a server going down stops only its runs.

Two databases of the test server stand in for two servers where only placement and routing are
checked (a server is host, port and database); the runs' test uses a second embedded server,
which it stops.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import yaml
from sqlalchemy.exc import ProgrammingError

from reservoir.config import parse_config
from reservoir.errors import ConfigError, StoreError
from reservoir.models import build_tiny_model
from reservoir.plan.urls import server_key, with_database
from reservoir.servers import routed
from reservoir.store import Store, server
from tests.commands import RESERVOIR, scalar
from tests.test_recovery import query, start, wait_for
from tests.test_run import ledger

TASKS = {"generate": "addition"}


def config(urls: list[str], name: str = "r", **run) -> object:
    return parse_config({"run": {"name": name, **run}, "tasks": TASKS,
                         "store": {"urls": urls}})


@pytest.fixture
def two_databases(db_url, new_database, template_db) -> list[str]:
    return [db_url, new_database(template_db)]


def server_of(urls: list[str], name: str, *, create: bool = True, **run) -> str:
    return server_key(routed(config(urls, name, **run), create=create).store.url)


def test_new_runs_go_where_the_declared_demand_is_least(two_databases):
    first, second = (server_key(url) for url in two_databases)
    assert server_of(two_databases, "big", demand=3.0) == first  # a tie: the first
    assert server_of(two_databases, "small", demand=1.0) == second
    assert server_of(two_databases, "small-2", demand=1.0) == second  # 2 there, 3 on the first
    assert server_of(two_databases, "pinned", store=0) == first  # run.store decides
    assert server_of(two_databases, "small", create=False) == second  # placed once, read after
    assert server_of(two_databases, "child", branch_from="small@1") == second  # its parent's
    with pytest.raises(StoreError, match="a branch lives on its parent's server"):
        server_of(two_databases, "child-2", branch_from="small@1", store=0)
    with pytest.raises(StoreError, match="run 'nobody' is on none of store.urls' servers"):
        server_of(two_databases, "nobody", create=False)
    placed = query(two_databases[0], "SELECT run_name, server, demand FROM run_servers "
                                     "ORDER BY run_name")
    assert placed == [("big", first, 3.0), ("child", second, 1.0), ("pinned", first, 1.0),
                      ("small", second, 1.0), ("small-2", second, 1.0)]
    assert scalar(two_databases[1], "SELECT count(*) FROM run_servers") == 0  # the first's only
    routed_config = routed(config(two_databases, "pinned", store=0))
    assert routed_config.store.urls == () and server_key(routed_config.store.url) == first
    parse_config(routed_config.model_dump(mode="json"))  # valid again where it is read again


def test_a_server_that_does_not_answer_gets_no_new_run_and_finished_runs_weigh_nothing(
        two_databases):
    gone = "postgresql://nobody@127.0.0.1:1/nothing"
    urls = [two_databases[0], gone, two_databases[1]]
    first, second = server_key(urls[0]), server_key(urls[2])
    assert server_of(urls, "p") == first
    assert server_of(urls, "q") == second  # not the silent server, though nothing is on it
    with Store.open(routed(config(urls, "p"))) as store:  # p finishes: its demand is gone
        store.runs.set_status(store.create_run("p"), "finished")
    assert server_of(urls, "r") == first


def test_store_urls_are_checked_with_the_config(db_url):
    other = with_database(db_url, "other")
    with pytest.raises(ConfigError, match="store.urls: set it or store.url"):
        parse_config({"tasks": TASKS, "store": {"urls": [db_url, other], "url": db_url}})
    with pytest.raises(ConfigError, match="a server is named twice"):
        parse_config({"tasks": TASKS, "store": {"urls": [db_url, db_url + ("&" if "?" in db_url else "?")
                                                   + "sslmode=prefer"]}})
    with pytest.raises(ConfigError, match="run.store: 2 is not a place in store.urls"):
        config([db_url, other], store=2)
    with pytest.raises(ConfigError, match="work on one run's server"):
        config([db_url, other]).store.resolved_url()  # never the embedded server by mistake
    assert server_key("postgresql://u:secret@db.example:6543/x") == "db.example:6543/x"


def write(path, raw: dict):
    parse_config(raw)
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "RESERVOIR_DB_URL"}
    return subprocess.run([str(RESERVOIR), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**env, "COLUMNS": "200"})


@pytest.mark.process
def test_commands_route_by_run_and_sql_all_reads_every_server(two_databases, tmp_path):
    first, second = (server_key(url) for url in two_databases)
    path = write(tmp_path / "c.yaml", {"tasks": TASKS, "store": {"urls": two_databases}})
    for run in ("a", "b"):
        made = cli("demo", "store", "--run", run, "--groups", "12", "--group-size", "2",
                   "--steps", "1", "--groups-per-step", "4", "-c", str(path), cwd=tmp_path)
        assert made.returncode == 0, made.stderr
    every = cli("sql", "--all", "SELECT run, count(*) AS n FROM analytics.experiences GROUP BY "
                "run", "--format", "csv", "-c", str(path), cwd=tmp_path)
    assert every.stdout.splitlines() == ["server,run,n", f"{first},a,24", f"{second},b,24"]
    one = cli("sql", "--run", "b", "SELECT run FROM analytics.runs", "--format", "csv",
              "-c", str(path), cwd=tmp_path)
    assert one.stdout.splitlines() == ["run", "b"]
    vague = cli("sql", "SELECT 1", "-c", str(path), cwd=tmp_path)
    assert vague.returncode == 1 and vague.stderr.splitlines() == [
        "error: store.urls names 2 servers and this command works on one: name the run whose "
        "server it is (--run NAME)"]
    inspected = cli("inspect", "run", "b", "-c", str(path), cwd=tmp_path)
    assert inspected.returncode == 0 and "run b" in inspected.stdout
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(yaml.safe_dump({"name": "keep", "source": {"runs": ["a", "b"], "status": ["ready"]},
                                        "process": [{"text_length_filter": {"min_len": 1}}]}))
    ran = cli("pipeline", "run", str(pipeline), "-c", str(path), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    for url in two_databases:  # each server's pass read its own run's rows only
        assert query(url, "SELECT p.rows_in, r.name FROM pipeline_runs p, runs r") == [
            (16, "a" if url == two_databases[0] else "b")]  # 24 rows, 8 trained
    archive = tmp_path / "b-archive"  # archived from b's server and restored there
    assert cli("runs", "archive", "b", "--out", str(archive), "-c", str(path),
               cwd=tmp_path).returncode == 0
    assert scalar(two_databases[1], "SELECT count(*) FROM experiences") == 0
    restored = cli("runs", "restore", str(archive), "-c", str(path), cwd=tmp_path)
    assert restored.returncode == 0, restored.stderr
    assert scalar(two_databases[1], "SELECT count(*) FROM experiences") == 24
    assert scalar(two_databases[0], "SELECT count(*) FROM runs WHERE name = 'b'") == 0
    # a server that cannot be reached: the others' rows, one line for it, exit code 1
    gone = "postgresql://nobody@127.0.0.1:1/nothing"
    path = write(tmp_path / "d.yaml", {"tasks": TASKS, "store": {"urls": [*two_databases, gone]}})
    listed = cli("runs", "list", "--wide", "-c", str(path), cwd=tmp_path)
    assert listed.returncode == 1
    assert "error: server 127.0.0.1:1/nothing: " in listed.stderr
    rows = [line for line in listed.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[2].strip() for row in rows] == ["a", "b"]
    every = cli("sql", "--all", "SELECT run FROM analytics.runs", "--format", "csv", "-c",
                str(path), cwd=tmp_path)
    assert every.returncode == 1 and every.stdout.splitlines() == [
        "server,run", f"{first},a", f"{second},b"]
    assert every.stderr.splitlines()[-1] == ("error: --all: 127.0.0.1:1/nothing could not be "
                                             "reached: their rows are missing")


@pytest.fixture
def second_server(embedded_dir):
    """A second embedded server of this test's own (the runs' test stops and starts it)."""
    url = server.start(embedded_dir)
    return url, embedded_dir


def colocated(tmp_path, urls: list[str], name: str, steps: int) -> dict:
    model = tmp_path / "tiny"
    if not model.exists():
        build_tiny_model(model, seed=0)
    gate = tmp_path / "gate.yaml"
    gate.write_text("mode: stream\nsource: {status: [raw]}\n"
                    "process:\n  - text_length_filter: {min_len: 3}\n")
    return {"run": {"name": name, "placement": "colocated", "seed": 5},
            "model": {"path": str(model)}, "tasks": {"generate": "reverse", "count": 80},
            "explorer": {"n": 4, "batch_tasks": 3, "max_tokens": 5},
            "trainer": {"steps": steps, "batch_groups": 3, "micro_batch": 12,
                        "eval_interval": 100, "lr": 0.01,
                        "checkpoint_dir": str(tmp_path / "checkpoints")},
            "store": {"urls": urls, "outage_patience_s": 2.0}, "pipelines": [str(gate)]}


def trained(url: str) -> bool:
    """Whether the run on that server committed a step past 0 (False before its schema)."""
    try:
        return bool(query(url, "SELECT 1 FROM train_steps WHERE step >= 1"))
    except ProgrammingError:
        return False


@pytest.mark.slow
@pytest.mark.both_servers  # the server pass: the 5432 server and an embedded one
@pytest.mark.process
@pytest.mark.timeout(900)
def test_two_runs_on_two_servers_and_one_server_lost(tmp_path, db_url, second_server):
    """Two runs at once, placed on two servers by demand; the second server stops mid-run: its
    run fails with one line, the other finishes. Each run's rows, ledger and pipeline passes
    are on its server only, and `sql --all` shows both."""
    other, other_dir = second_server
    urls = [db_url, other]
    paths = {name: write(tmp_path / f"{name}.yaml", colocated(tmp_path, urls, name, steps))
             for name, steps in (("a", 6), ("b", 200))}
    def placed(name: str) -> None:
        wait_for(lambda: query(db_url, "SELECT 1 FROM run_servers WHERE run_name = :r", r=name),
                 timeout=120)

    runs = {"a": start("run", str(paths["a"]), cwd=tmp_path)}
    placed("a")  # on the first server: no demand anywhere yet
    # a (6 steps) is held until b is placed: finished, its demand would weigh nothing and b
    # would go to the first server too (it did in CI, where b took long to start)
    runs["a"].send_signal(signal.SIGSTOP)
    try:
        runs["b"] = start("run", str(paths["b"]), cwd=tmp_path)
        placed("b")
    finally:
        runs["a"].send_signal(signal.SIGCONT)
    assert query(db_url, "SELECT run_name, server FROM run_servers ORDER BY run_name") == [
        ("a", server_key(db_url)), ("b", server_key(other))]
    wait_for(lambda: trained(other) or runs["b"].poll() is not None, timeout=420, every=1)
    assert runs["b"].poll() is None, runs["b"].communicate()[0]
    server.stop(other_dir)
    out_b, _ = runs["b"].communicate(timeout=180)
    assert runs["b"].returncode == 1, out_b
    assert out_b.strip().splitlines()[-1].startswith("error: "), out_b
    assert "unreachable" in out_b.strip().splitlines()[-1]
    out_a, _ = runs["a"].communicate(timeout=600)
    assert runs["a"].returncode == 0, out_a
    server.start(other_dir)
    assert query(db_url, "SELECT name FROM runs") == [("a",)]
    assert query(other, "SELECT name FROM runs") == [("b",)]
    found = ledger(db_url)
    assert (found["steps"], found["status"]) == (list(range(7)), "finished")
    assert (found["bad_steps"], found["trained_twice"], found["live_claims"]) == (0, 0, 0)
    found = ledger(other)
    assert (found["bad_steps"], found["trained_twice"]) == (0, 0) and len(found["steps"]) >= 2
    for url in urls:  # the run's stream pipeline passed its rows on its own server
        assert query(url, "SELECT count(*) > 0 FROM pipeline_runs") == [(True,)]
        assert query(url, "SELECT count(*) FROM operator_events o LEFT JOIN experiences e "
                          "ON e.id = o.experience_id WHERE e.id IS NULL "
                          "AND o.experience_id IS NOT NULL") == [(0,)]
    every = cli("sql", "--all", "SELECT run, count(*) > 0 AS trained FROM analytics.run_steps "
                "GROUP BY run", "--format", "csv", "-c", str(paths["a"]), cwd=tmp_path)
    assert every.stdout.splitlines() == [
        "server,run,trained", f"{server_key(db_url)},a,True", f"{server_key(other)},b,True"]
