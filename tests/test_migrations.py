"""Migrations: upgrade from empty, idempotence, downgrade and back, agreement with the declared
schema, first-use upgrade, refusal of an old schema, and two processes upgrading at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from reservoir.config import ReservoirConfig, StoreConfig
from reservoir.errors import SchemaOutOfDate, StoreError
from reservoir.store import Store, migrate
from reservoir.store.engine import sync_engine
from reservoir.store.schema import metadata

CORE_TABLES = {"runs", "tasks", "experience_data", "experience_state", "policy_versions", "train_steps", "batch_items",
               "pipeline_runs", "operator_events", "validations", "schedules", "reviews",
               "preferences", "episodes", "episode_calls", "review_actions"}
VIEWS = {"experiences", "experience_tokens", "run_steps", "lineage", "runs", "pipeline_runs",
         "operator_events", "validations", "reviews", "tasks", "policy_versions", "schedules",
         "preferences", "episodes", "episode_calls", "review_actions", "run_gauges",
         "pipeline_gauges", "schedule_gauges", "explorer_rounds", "run_servers"}


@pytest.fixture
def engines():
    """sync_engine(url), disposed after the test."""
    made = []

    def make(url: str):
        made.append(sync_engine(url))
        return made[-1]

    yield make
    for engine in made:
        engine.dispose()


def tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def analytics_views(engine) -> set[str]:
    found = inspect(engine)
    return set(found.get_view_names(schema="analytics")) if found.has_schema("analytics") else set()


def test_upgrade_empty_database_to_head_then_again_is_a_no_op(new_database, engines):
    engine = engines(new_database())
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert CORE_TABLES <= tables(engine) and analytics_views(engine) == VIEWS
    assert "experiences" in inspect(engine).get_view_names()
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()


def test_downgrade_last_step_drops_analytics_keeps_core_then_upgrade_restores(db_url, engines):
    engine = engines(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (name) VALUES ('kept')"))
    migrate.downgrade(engine, "0001")
    assert migrate.current_revision(engine) == "0001"
    assert not inspect(engine).has_schema("analytics")
    assert {"runs", "tasks", "experiences", "batch_items"} <= tables(engine)
    assert not tables(engine) & {"pipeline_runs", "operator_events", "schedules"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM runs")).scalars().all() == ["kept"]
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert analytics_views(engine) == VIEWS
    with engine.connect() as conn:
        assert conn.execute(text("SELECT run FROM analytics.runs")).scalars().all() == ["kept"]


def test_every_revision_downgrades_to_base_and_upgrades_again(db_url, engines):
    engine = engines(db_url)
    migrate.downgrade(engine, "base")
    assert migrate.current_revision(engine) is None
    assert tables(engine) <= {"alembic_version"} and not inspect(engine).has_schema("analytics")
    migrate.upgrade(engine)
    assert CORE_TABLES <= tables(engine) and analytics_views(engine) == VIEWS


def _only_declared_objects(obj, name, type_, reflected, compare_to) -> bool:
    if type_ == "table" and name == "alembic_version":
        return False
    return getattr(obj, "schema", None) != "analytics"


def test_database_built_from_migrations_matches_declared_schema(db_url, engines):
    with engines(db_url).connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "compare_type": True, "compare_server_default": True,
            "include_object": _only_declared_objects})
        diff = compare_metadata(context, metadata)
    print("\n".join(map(repr, diff)))
    assert diff == []


def test_store_open_upgrades_an_empty_database_only_when_asked(new_database, engines, capsys):
    url = new_database()
    with pytest.raises(StoreError, match="has no Reservoir schema.*nothing was changed"):
        Store.open(ReservoirConfig(store=StoreConfig(url=url)))
    assert migrate.current_revision(engines(url)) is None
    store = Store.open(ReservoirConfig(store=StoreConfig(url=url)), migrate=True)
    store.close()
    assert migrate.current_revision(engines(url)) == migrate.head_revision()
    err = " ".join(capsys.readouterr().err.split())
    assert f"upgraded its schema to revision {migrate.head_revision()}" in err


def test_ensure_schema_refuses_an_older_revision(new_database, engines):
    engine = engines(new_database())
    migrate.upgrade(engine, "0001")
    with pytest.raises(SchemaOutOfDate, match=rf"revision 0001.*needs {migrate.head_revision()}"):
        migrate.ensure_schema(engine)
    assert migrate.current_revision(engine) == "0001"


ENSURE_SCHEMA = """
import sys, time
from reservoir.store import migrate
from reservoir.store.engine import sync_engine
engine = sync_engine(sys.argv[1])
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
print(migrate.ensure_schema(engine))
"""


@pytest.mark.slow
@pytest.mark.process
def test_two_processes_upgrade_the_same_empty_database_once(new_database, engines):
    url = new_database()
    start_at = str(time.time() + 3)  # both processes import first, then race from the same instant
    procs = [subprocess.Popen([sys.executable, "-c", ENSURE_SCHEMA, url, start_at],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [proc.communicate(timeout=60) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.strip() in (migrate.head_revision(), "None")
    engine = engines(url)
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    assert versions == [migrate.head_revision()]
    assert analytics_views(engine) == VIEWS


def test_a_populated_store_moves_to_the_narrow_state_row_unchanged(new_database, engines):
    """Rows written before migration 0012 read the same through the view afterwards (every
    column), a lease taken before survives, and the migrated rows lease and commit."""
    url = new_database()
    engine = engines(url)
    migrate.upgrade(engine, "0011")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, group_size) VALUES (1, 'old', 2)"))
        conn.execute(text("""
            INSERT INTO experiences (run_id, group_id, group_row, policy_version, prompt_text,
                response_text, prompt_ids, response_ids, logprobs, action_mask, reward,
                reward_components, metadata, status, priority, times_sampled, lease_token,
                leased_until, shaped_reward)
            SELECT 1, md5(g::text)::uuid, r, g, 'p' || g, 'r' || g || r,
                   int4send(g) || int4send(r), int4send(7 * g + r), float4send(-0.5::real),
                   '\\x01'::bytea, r, jsonb_build_object('accuracy', r), '{}'::jsonb,
                   CASE WHEN g = 0 THEN 'leased' WHEN g = 1 THEN 'consumed' ELSE 'ready' END,
                   g / 10.0, CASE WHEN g = 1 THEN 1 ELSE 0 END,
                   CASE WHEN g = 0 THEN 'c2b7e1a4-0000-4000-8000-000000000000'::uuid END,
                   CASE WHEN g = 0 THEN now() + interval '1 hour' END,
                   CASE WHEN r = 1 THEN 0.25 END
            FROM generate_series(0, 5) g, generate_series(0, 1) r"""))
    read = "SELECT * FROM experiences ORDER BY id"
    with engine.connect() as conn:
        before = [dict(row) for row in conn.execute(text(read)).mappings()]
    migrate.upgrade(engine)
    with engine.connect() as conn:
        after = [dict(row) for row in conn.execute(text(read)).mappings()]
        narrow = conn.execute(text("SELECT count(*) FROM experience_state")).scalar()
    assert len(before) == 12 and narrow == 12
    assert [{name: row[name] for name in before[0]} for row in after] == before
    assert {row["parent_run_id"] for row in after} == {None}  # migration 0013's column
    config = ReservoirConfig(store=StoreConfig(url=url))
    with Store.open(config) as store:
        lease = store.lease("old", rows=8, timeout_s=2)  # the 8 ready rows; 0's stay leased
        assert sorted({row.policy_version for row in lease.rows}) == [2, 3, 4, 5]
        assert lease.rows[0].prompt_bytes == bytes([0, 0, 0, 2, 0, 0, 0, 0])  # int4send: BE
        store.commit_step(lease, step=1, policy_version=0)
    with engine.connect() as conn:
        statuses = dict(conn.execute(text(
            "SELECT status, count(*) FROM experiences GROUP BY status")).all())
    assert statuses == {"leased": 2, "consumed": 10}


POPULATED_0012 = """
INSERT INTO runs (id, name, group_size) VALUES (1, 'one', 2), (2, 'two', 2);
INSERT INTO experiences (id, run_id, group_id, group_row, policy_version, prompt_text,
    response_text, prompt_ids, response_ids, reward, status, parent_id)
VALUES (1, 1, md5('a')::uuid, 0, 0, 'p', 'r1', int4send(1), int4send(2), 1, 'consumed', NULL),
       (2, 1, md5('a')::uuid, 1, 0, 'p', 'r2', int4send(1), int4send(3), 0, 'ready', NULL),
       (3, 1, md5('b')::uuid, 0, 0, 'p', 'r3', int4send(1), int4send(4), 0, 'held', 1),
       (4, 2, md5('c')::uuid, 0, 0, 'p', 'r4', int4send(1), int4send(5), 1, 'ready', 1);
SELECT setval('experience_data_id_seq', 4);
INSERT INTO train_steps (id, run_id, step, policy_version, n_experiences) VALUES (1, 1, 1, 0, 1);
INSERT INTO batch_items (train_step_id, experience_id, policy_version) VALUES (1, 1, 0);
INSERT INTO pipeline_runs (id, pipeline, spec, spec_hash) VALUES (1, 'gate', '{}', 'h');
INSERT INTO operator_events (pipeline_run_id, experience_id, operator, kind)
VALUES (1, 4, 'op', 'scored'), (1, NULL, 'op', 'scored');
INSERT INTO reviews (id, experience_id, pipeline_run_id) VALUES (1, 3, 1);
INSERT INTO preferences (id, run_id, chosen_id, rejected_id) VALUES (1, 1, 1, 2);
INSERT INTO review_actions (reviewer, action, source, experience_id, review_id)
VALUES ('ann', 'accept', 'cli', 3, 1);
"""


def populate_at_0012(engine) -> None:
    """The store at 0012, holding POPULATED_0012."""
    migrate.upgrade(engine, "0012")
    with engine.begin() as conn:
        conn.execute(text(POPULATED_0012))


NAMING = {"batch_items": "experience_id", "operator_events": "experience_id",
          "reviews": "experience_id", "review_actions": "experience_id"}


def test_a_populated_store_moves_into_partitions_by_run_and_back(new_database, engines):
    """Migration 0013 on a store of two runs: every experience reads the same, each run's
    rows are in its own partitions, every row that names an experience names its run (a
    parent of another run too), the keys hold, and the downgrade gives the rows back."""
    url = new_database()
    engine = engines(url)
    populate_at_0012(engine)
    read = "SELECT * FROM experiences ORDER BY id"
    with engine.connect() as conn:
        before = [dict(row) for row in conn.execute(text(read)).mappings()]
    migrate.upgrade(engine, "0013")
    with engine.connect() as conn:
        after = [dict(row) for row in conn.execute(text(read)).mappings()]
        per_partition = {name: conn.execute(text(f"SELECT array_agg(id ORDER BY id) FROM {name}"))
                         .scalar() for name in ("experience_state_r1", "experience_state_r2",
                                                "experience_data_r1", "experience_data_r2")}
        named = {table: conn.execute(text(f"SELECT array_agg(run_id ORDER BY {column}) FROM "
                                          f"{table} WHERE {column} IS NOT NULL")).scalar()
                 for table, column in NAMING.items()}
        unnamed = conn.execute(text("SELECT run_id FROM operator_events "
                                    "WHERE experience_id IS NULL")).scalar()
    assert [{name: row[name] for name in before[0]} for row in after] == before
    assert [row["parent_run_id"] for row in after] == [None, None, 1, 1]
    assert per_partition == {"experience_state_r1": [1, 2, 3], "experience_state_r2": [4],
                             "experience_data_r1": [1, 2, 3], "experience_data_r2": [4]}
    assert named == {"batch_items": [1], "operator_events": [2], "reviews": [1],
                     "review_actions": [1]} and unnamed is None
    with engine.begin() as conn:  # a new run has its partitions; a row names its run
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
        assert conn.execute(text("SELECT count(*) FROM pg_inherits WHERE inhrelid IN "
                                 "('experience_data_r3'::regclass, "
                                 "'experience_state_r3'::regclass)")).scalar() == 2
    with engine.begin() as conn:  # SQL by hand that names an experience but not its run
        conn.execute(text("INSERT INTO reviews (id, experience_id) VALUES (2, 2)"))
        assert conn.execute(text("SELECT run_id FROM reviews WHERE experience_id = 2")
                            ).scalar() == 1
        conn.execute(text("DELETE FROM reviews WHERE experience_id = 2"))
    with pytest.raises(Exception, match="operator_events_experience_run"):
        with engine.begin() as conn:  # no experience 99: no run to name, refused
            conn.execute(text("INSERT INTO operator_events (pipeline_run_id, experience_id, "
                              "operator, kind) VALUES (1, 99, 'op', 'scored')"))
    with pytest.raises(Exception, match="batch_items_experience_id_fkey"):
        with engine.begin() as conn:  # experience 4 is of run 2, not 1
            conn.execute(text("INSERT INTO batch_items (train_step_id, run_id, experience_id, "
                              "policy_version) VALUES (1, 1, 4, 0)"))
    migrate.downgrade(engine, "0012")
    with engine.connect() as conn:
        again = [dict(row) for row in conn.execute(text(read)).mappings()]
        items = conn.execute(text("SELECT experience_id FROM batch_items")).scalars().all()
    assert again == before and items == [1]


PARTITION_KEYS = """
SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND conrelid::regclass::text ~ '_r[0-9]+$' AND conparentid = 0
ORDER BY 1
"""


def test_keys_name_the_run_s_partitions_and_the_ledger_moves_into_them(new_database, engines):
    """Migration 0014 on a populated store: each run's state partition references its data
    partition and its ledger partition its state partition (plain tables, not the partitioned
    parents); the ledger rows move into the runs' partitions; the keys refuse what the parent
    keys refused; the downgrade gives the ledger back."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0014")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
    with engine.connect() as conn:
        keys = conn.execute(text(PARTITION_KEYS)).all()
        on_parents = conn.execute(text(
            "SELECT conname FROM pg_constraint WHERE contype = 'f' AND conrelid IN "
            "('experience_state'::regclass, 'batch_items'::regclass) AND confrelid IN "
            "('experience_data'::regclass, 'experience_state'::regclass)")).scalars().all()
        ledger = conn.execute(text("SELECT tableoid::regclass::text, train_step_id, "
                                   "experience_id, run_id FROM batch_items")).all()
    assert keys == [(f"{table}_r{run}", f"{target}_r{run}") for table, target in
                    (("batch_items", "experience_state"), ("experience_state", "experience_data"))
                    for run in (1, 2, 3)] == sorted(keys)
    assert on_parents == [] and ledger == [("batch_items_r1", 1, 1, 1)]
    with pytest.raises(Exception, match="batch_items_r1_experience_id_fkey"):
        with engine.begin() as conn:  # experience 4 is of run 2, not 1
            conn.execute(text("INSERT INTO batch_items (train_step_id, run_id, experience_id, "
                              "policy_version) VALUES (1, 1, 4, 0)"))
    with pytest.raises(Exception, match="experience_state_r2_data"):
        with engine.begin() as conn:  # a state row with no data row
            conn.execute(text("INSERT INTO experience_state (id, run_id, group_id, group_row, "
                              "policy_version) VALUES (99, 2, md5('z')::uuid, 0, 0)"))
    with engine.begin() as conn:  # deleting an experience takes its ledger row with it
        conn.execute(text("DELETE FROM experiences WHERE id = 1"))
        assert conn.execute(text("SELECT count(*) FROM batch_items")).scalar() == 0
        conn.rollback()
    migrate.downgrade(engine, "0013")
    with engine.connect() as conn:
        assert conn.execute(text(PARTITION_KEYS)).all() == []
        assert conn.execute(text("SELECT train_step_id, experience_id, run_id FROM batch_items")
                            ).all() == [(1, 1, 1)]
    migrate.downgrade(engine, "0012")


def test_group_ids_of_a_populated_store_go_into_one_table_kept_by_the_server(new_database,
                                                                             engines):
    """Migration 0015 on a populated store: every group id goes into experience_groups with its
    run; an id two runs share (0014 allowed it: each partition had its own unique index) stays
    with the earlier run; new groups are added by the server, a taken id is refused; the
    downgrade removes the table and its trigger."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0014")
    with engine.begin() as conn:  # run 2 takes group 'a' of run 1 again
        conn.execute(text("INSERT INTO experiences (run_id, group_id, group_row, policy_version, "
                          "prompt_text, response_text, prompt_ids, response_ids, reward) VALUES "
                          "(2, md5('a')::uuid, 0, 0, 'p', 'r', '\\x', '\\x', 0)"))
    migrate.upgrade(engine, "0015")
    listed = "SELECT group_id::text, run_id FROM experience_groups ORDER BY run_id, group_id"
    with engine.connect() as conn:
        groups = conn.execute(text(listed)).all()
        md5 = dict(conn.execute(text("SELECT x, md5(x)::uuid::text FROM unnest(ARRAY['a', 'b', "
                                     "'c', 'd']) AS x")).all())
    assert groups == sorted([(md5["a"], 1), (md5["b"], 1), (md5["c"], 2)],
                            key=lambda row: (row[1], row[0]))
    insert = text("INSERT INTO experiences (run_id, group_id, group_row, policy_version, "
                  "prompt_text, response_text, prompt_ids, response_ids, reward) VALUES "
                  "(:run, md5(:g)::uuid, 0, 0, 'p', 'r', '\\x', '\\x', 0)")
    with engine.begin() as conn:
        conn.execute(insert, {"run": 2, "g": "d"})
    with pytest.raises(Exception, match="experience_groups_pkey"):
        with engine.begin() as conn:
            conn.execute(insert, {"run": 2, "g": "b"})
    with engine.connect() as conn:
        assert (md5["d"], 2) in conn.execute(text(listed)).all()
    migrate.downgrade(engine, "0014")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('experience_groups')")).scalar() is None
    with engine.begin() as conn:  # the trigger went with it
        conn.execute(insert, {"run": 2, "g": "b"})


GROUP_TRIGGERS = """
SELECT tgrelid::regclass::text, tgname FROM pg_trigger
WHERE tgname IN ('experience_group_add', 'experience_groups_add') ORDER BY 1, 2"""


def test_group_ids_are_added_once_a_statement_on_every_path(new_database, engines):
    """Migration 0016 on a populated store: the row trigger of 0015 becomes a statement trigger
    on experience_state and on each run's state partition (a run created later gets its own);
    a group written through the view, straight into a partition, or into the parent adds its
    id, a taken id is refused on each path; the downgrade brings the row trigger back."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0016")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, group_size) VALUES (3, 'three', 2)"))
        triggers = conn.execute(text(GROUP_TRIGGERS)).all()
    assert triggers == [(table, "experience_groups_add") for table in
                        ("experience_state", "experience_state_r1", "experience_state_r2",
                         "experience_state_r3")]
    view = ("INSERT INTO experiences (run_id, group_id, group_row, policy_version, prompt_text, "
            "response_text, prompt_ids, response_ids, reward) VALUES "
            "({run}, md5('{g}')::uuid, 0, 0, 'p', 'r', '\\x', '\\x', 0)")
    data = ("INSERT INTO {data} (id, run_id, prompt_text, response_text, prompt_ids, "
            "response_ids, reward) VALUES ({id}, {run}, 'p', 'r', '\\x', '\\x', 0)")
    state = ("INSERT INTO {state} (id, run_id, group_id, group_row, policy_version) "
             "VALUES ({id}, {run}, md5('{g}')::uuid, {row}, 0)")
    paths = {  # each writes group g of run 3 (two rows, one of them row 0)
        "view": lambda g, id: [view.format(run=3, g=g)],
        "partition": lambda g, id: [  # one statement of two state rows, as the writer's COPY
            data.format(data="experience_data_r3", id=id, run=3),
            data.format(data="experience_data_r3", id=id + 1, run=3),
            state.format(state="experience_state_r3", id=id, run=3, g=g, row=0)
            + f", ({id + 1}, 3, md5('{g}')::uuid, 1, 0)"],
        "parent": lambda g, id: [data.format(data="experience_data", id=id, run=3),
                                 state.format(state="experience_state", id=id, run=3, g=g,
                                              row=0)],
    }
    for n, (path, statements) in enumerate(paths.items()):
        with engine.begin() as conn:
            for statement in statements(f"new-{path}", 100 + 10 * n):
                conn.execute(text(statement))
        with pytest.raises(Exception, match="experience_groups_pkey"):
            with engine.begin() as conn:  # group 'a' is run 1's
                for statement in statements("a", 200 + 10 * n):
                    conn.execute(text(statement))
    with engine.connect() as conn:
        added = conn.execute(text(
            "SELECT g.run_id, count(*) FROM experience_groups g JOIN experience_state s "
            "USING (group_id) WHERE s.group_row = 0 AND s.run_id = 3 GROUP BY 1")).all()
    assert added == [(3, 3)]
    migrate.downgrade(engine, "0015")
    with engine.connect() as conn:
        assert conn.execute(text(GROUP_TRIGGERS)).all() == [
            ("experience_state", "experience_group_add")] + [
            (f"experience_state_r{run}", "experience_group_add") for run in (1, 2, 3)]
    with pytest.raises(Exception, match="experience_groups_pkey"):
        with engine.begin() as conn:
            conn.execute(text(view.format(run=3, g="a")))


LEDGER_TRIGGERS = """
SELECT tgrelid::regclass::text, tgname FROM pg_trigger
WHERE tgname IN ('batch_items_keys', 'batch_items_keys_update', 'batch_items_unlink',
                 'ledger_ids_kept') ORDER BY 1, 2"""
LEDGER_KEYS = """
SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND conparentid = 0 AND conrelid::regclass::text ~ '^batch_items'
ORDER BY 1"""


def _refused(engine, statement: str) -> str:
    """The SQLSTATE of the error a statement fails with (nothing of it is written)."""
    with pytest.raises(Exception) as raised:
        with engine.begin() as conn:
            conn.execute(text(statement))
    return raised.value.orig.pgcode


def test_the_ledger_s_keys_hold_once_a_statement_on_every_path(new_database, engines):
    """Migration 0017 on a populated store: the ledger's foreign keys become statement triggers
    on batch_items, experience_state (each with every partition, a run created later too) and
    train_steps. They refuse what the keys refused, through the parent and straight into a
    partition; they delete what the keys' ON DELETE CASCADE deleted; an id the ledger names
    does not change; the downgrade gives the keys back."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0017")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
        keys = conn.execute(text(LEDGER_KEYS)).all()
        triggers = conn.execute(text(LEDGER_TRIGGERS)).all()
    assert keys == []
    assert triggers == sorted(
        [(table, name) for table in ("batch_items", "batch_items_r1", "batch_items_r2",
                                     "batch_items_r3")
         for name in ("batch_items_keys", "batch_items_keys_update")]
        + [(table, name) for table in ("experience_state", "experience_state_r1",
                                       "experience_state_r2", "experience_state_r3", "train_steps")
           for name in ("batch_items_unlink", "ledger_ids_kept")])
    item = ("INSERT INTO {table} (train_step_id, run_id, experience_id, policy_version) "
            "VALUES ({step}, {run}, {experience}, 0)")
    refusals = [  # (statement, SQLSTATE): 23503 foreign_key_violation, 23514 check_violation
        (item.format(table="batch_items", step=9, run=1, experience=2), "23503"),
        (item.format(table="batch_items", step=1, run=1, experience=4), "23503"),  # run 2's
        (item.format(table="batch_items_r1", step=1, run=1, experience=99), "23503"),
        (item.format(table="batch_items_r1", step=9, run=1, experience=2), "23503"),
        ("UPDATE batch_items SET experience_id = 99", "23503"),
        ("UPDATE batch_items_r1 SET train_step_id = 9", "23503"),
        ("UPDATE experience_state SET id = id", "23514"),
        ("UPDATE experience_state_r1 SET run_id = run_id", "23514"),
        ("UPDATE train_steps SET id = id", "23514"),
    ]
    assert [_refused(engine, statement) for statement, _ in refusals] == [
        code for _, code in refusals]
    ledger = "SELECT train_step_id, run_id, experience_id FROM batch_items ORDER BY 1, 3"
    with engine.begin() as conn:  # allowed: a row straight into the partition, a step of run 2
        conn.execute(text(item.format(table="batch_items_r1", step=1, run=1, experience=2)))
        conn.execute(text("INSERT INTO train_steps (id, run_id, step, policy_version, "
                          "n_experiences) VALUES (2, 2, 1, 0, 2)"))
        conn.execute(text(item.format(table="batch_items", step=2, run=1, experience=3)
                          + ", (2, 2, 4, 0)"))
        assert conn.execute(text(ledger)).all() == [(1, 1, 1), (1, 1, 2), (2, 1, 3), (2, 2, 4)]
    deletes = {  # what each delete leaves of the ledger
        "DELETE FROM experiences WHERE id = 1": [(1, 1, 2), (2, 1, 3), (2, 2, 4)],
        "DELETE FROM experience_state_r1 WHERE id IN (2, 3)": [(1, 1, 1), (2, 2, 4)],
        "DELETE FROM train_steps WHERE id = 1": [(2, 1, 3), (2, 2, 4)],
        "DELETE FROM runs WHERE id = 2": [(1, 1, 1), (1, 1, 2)],  # its step's row in run 1's
    }
    for statement, left in deletes.items():
        with engine.begin() as conn:
            conn.execute(text(statement))
            assert conn.execute(text(ledger)).all() == left, statement
            conn.rollback()
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM batch_items WHERE train_step_id = 2; "
                          "DELETE FROM train_steps WHERE id = 2"))
    migrate.downgrade(engine, "0016")
    with engine.connect() as conn:
        assert conn.execute(text(LEDGER_KEYS)).all() == [
            ("batch_items", "train_steps")] + [
            (f"batch_items_r{run}", f"experience_state_r{run}") for run in (1, 2, 3)]
        assert conn.execute(text(LEDGER_TRIGGERS)).all() == []
    assert _refused(engine, item.format(table="batch_items", step=1, run=1, experience=4)) == "23503"


STATE_INDEXES = """
SELECT c.relname, regexp_replace(pg_get_indexdef(i.indexrelid), '^.* USING ', '')
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = CAST(:table AS regclass) ORDER BY 1"""
KEYS_FUNCTION = "SELECT prosrc FROM pg_proc WHERE proname = 'batch_items_keys'"


def _state_indexes(engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text(STATE_INDEXES), {"table": table}).all())


def test_a_lease_and_a_step_commit_write_fewer_index_entries(new_database, engines):
    """Migration 0019 on a populated store: the (run_id, status) index keeps rows at rest only
    (a lease and a commit add nothing to it) and still serves a pipeline's read of raw rows, no
    index holds the lease token, the ledger's step check holds, and the downgrade gives the
    indexes and the row-by-row check back."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0019")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
    for table in ("experience_state", "experience_state_r1", "experience_state_r3"):
        indexes = _state_indexes(engine, table)
        assert not [d for d in indexes.values() if "lease_token" in d], (table, indexes)
        assert [d for d in indexes.values() if d.startswith("btree (run_id, status)")] == [
            "btree (run_id, status) WHERE (status <> ALL (ARRAY['leased'::text, "
            "'consumed'::text]))"], (table, indexes)  # the partition's index is named as before
    with engine.begin() as conn:  # a pipeline's read of raw rows (source.FILTERS) can use it
        conn.execute(text("UPDATE experience_state SET status = 'raw' WHERE id = 2; "
                          "SET LOCAL enable_seqscan = off"))
        plan = "\n".join(conn.execute(text(
            "EXPLAIN SELECT id FROM experiences e WHERE e.run_id = ANY('{1}') "
            "AND e.status = ANY('{raw,quarantined}')")).scalars())
        assert "experience_state_r1_run_id_status_idx" in plan, plan
        conn.rollback()
    item = ("INSERT INTO batch_items (train_step_id, run_id, experience_id, policy_version) "
            "VALUES {rows}")
    assert _refused(engine, item.format(rows="(1, 1, 2, 0), (9, 1, 2, 0)")) == "23503"
    with engine.begin() as conn:
        conn.execute(text(item.format(rows="(1, 1, 2, 0), (1, 1, 3, 0)")))
        with engine.connect() as other:
            assert "SELECT DISTINCT train_step_id" in other.execute(text(KEYS_FUNCTION)).scalar()
        conn.rollback()
    migrate.downgrade(engine, "0018")
    indexes = _state_indexes(engine, "experience_state_r1")
    assert indexes["experience_state_r1_run_id_status_idx"] == "btree (run_id, status)"
    assert indexes["experience_state_r1_lease_token_idx"] == (
        "btree (lease_token) WHERE (lease_token IS NOT NULL)")
    with engine.connect() as conn:
        assert "DISTINCT train_step_id" not in conn.execute(text(KEYS_FUNCTION)).scalar()
    assert _refused(engine, item.format(rows="(9, 1, 2, 0)")) == "23503"


def _groups_triggers(engine) -> list[str]:
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT tgrelid::regclass::text FROM pg_trigger "
            "WHERE tgname = 'experience_groups_add' ORDER BY 1")).scalars().all()


def test_the_group_s_columns_move_to_the_data_row_with_their_index(new_database, engines):
    """Migration 0020 on a populated store: every experience reads the same through the view;
    the group's id and row number are on the data row only, under its unique index (a second
    row 0 of a group is refused), and no index of the state row holds them; new group ids are
    recorded from the data table and its partitions, a run created later too; the downgrade
    gives the columns and their index back to the state row, values unchanged."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0019")
    read = "SELECT * FROM experiences ORDER BY id"
    with engine.connect() as conn:
        before = [dict(row) for row in conn.execute(text(read)).mappings()]
    migrate.upgrade(engine, "0020")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
        assert [dict(row) for row in conn.execute(text(read)).mappings()] == before
        state = {c["name"] for c in inspect(conn).get_columns("experience_state_r1")}
    assert not {"group_id", "group_row"} & state
    assert not [d for d in _state_indexes(engine, "experience_state_r1").values()
                if "group_id" in d]
    for table in ("experience_data", "experience_data_r1", "experience_data_r3"):
        assert "btree (group_id, group_row, run_id) INCLUDE (id)" in (
            _state_indexes(engine, table).values()), table
    assert _groups_triggers(engine) == ["experience_data", "experience_data_r1",
                                        "experience_data_r2", "experience_data_r3"]
    new_row = ("INSERT INTO experiences (run_id, group_id, group_row, policy_version, "
               "prompt_text, response_text, prompt_ids, response_ids, reward) VALUES "
               "(3, '{group}', {row}, 0, 'p', 'r', '\\x', '\\x', 0)")
    group = "a0000000-0000-0000-0000-000000000003"
    with engine.begin() as conn:
        conn.execute(text(new_row.format(group=group, row=0)))
        assert conn.execute(text("SELECT run_id FROM experience_groups WHERE group_id = "
                                 f"'{group}'")).scalar() == 3
    assert _refused(engine, new_row.format(group=group, row=0)) == "23505"
    migrate.downgrade(engine, "0019")
    with engine.connect() as conn:
        after = [dict(row) for row in conn.execute(text(read)).mappings()]
        data = {c["name"] for c in inspect(conn).get_columns("experience_data_r1")}
    assert after[:len(before)] == before and not {"group_id", "group_row"} & data
    assert "btree (group_id, group_row, run_id)" in (
        _state_indexes(engine, "experience_state_r1").values())
    assert _groups_triggers(engine) == ["experience_state", "experience_state_r1",
                                        "experience_state_r2", "experience_state_r3"]


DATA_STORAGE = """
SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), ''),
       pg_relation_size(c.reltoastrelid) > 0
FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
WHERE i.inhparent = 'experience_data'::regclass ORDER BY 1"""
# A row of three incompressible 1 KB arrays (~3.2 KB with its texts), into run `run`.
WIDE_ROW = """
WITH kb AS (SELECT decode(string_agg(lpad(to_hex((random() * 4294967295)::bigint), 8, '0'), ''),
                          'hex') AS b FROM generate_series(1, 256))
INSERT INTO experiences (run_id, group_id, group_row, policy_version, prompt_text,
                         response_text, prompt_ids, response_ids, logprobs, reward)
SELECT {run}, gen_random_uuid(), 0, 0, 'p', 'r', b, b || '', b || '\\x00', 0 FROM kb"""


def test_a_run_s_data_rows_stay_in_their_page_up_to_a_page(new_database, engines):
    """Migration 0021 on a populated store: every data partition, and a run's created later,
    keeps rows up to a page whole (toast_tuple_target 8160), so a row of three 1 KB arrays
    writes nothing to the TOAST table, where before its arrays went out of line; the
    downgrade resets the partitions and new runs."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0020")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three')"))
        conn.execute(text(WIDE_ROW.format(run=3)))
        assert conn.execute(text(DATA_STORAGE)).all() == [
            ("experience_data_r1", "", False), ("experience_data_r2", "", False),
            ("experience_data_r3", "", True)]
    migrate.upgrade(engine, "0021")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (4, 'four')"))
        for run in (1, 4):
            conn.execute(text(WIDE_ROW.format(run=run)))
        target = "toast_tuple_target=8160"
        assert conn.execute(text(DATA_STORAGE)).all() == [
            ("experience_data_r1", target, False), ("experience_data_r2", target, False),
            ("experience_data_r3", target, True), ("experience_data_r4", target, False)]
    migrate.downgrade(engine, "0020")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (5, 'five')"))
        assert {option for _, option, _ in conn.execute(text(DATA_STORAGE))} == {""}


EXPERIENCE_KEYS = """
SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND conparentid = 0 AND conrelid::regclass::text ~ '^experience_(data|state)'
  AND confrelid::regclass::text !~ '^(tasks|experience_state)$'
ORDER BY 1"""
EXPERIENCE_TRIGGERS = """
SELECT tgrelid::regclass::text, tgname FROM pg_trigger
WHERE tgname IN ('experience_keys', 'experience_state_unlink', 'experiences_unlink',
                 'ledger_ids_kept', 'experience_data_truncate')
  AND tgrelid::regclass::text ~ '^(experience_data|runs)'
   OR tgname IN ('experience_keys') ORDER BY 1, 2"""
STATE_ROWS = "SELECT run_id, id FROM experience_state ORDER BY 1, 2"


def test_an_experience_s_keys_hold_once_a_statement_on_every_path(new_database, engines):
    """Migration 0022 on a populated store: the keys of the data row (to its run) and of the
    state row (to its data row, and to its run) become statement triggers on the data and
    state tables, each with every partition (a run created later too), and on runs. They
    refuse what the keys refused, through the parent and straight into a partition; they
    delete what the keys' ON DELETE CASCADE deleted; an id a key names does not change; the
    downgrade gives the keys back."""
    engine = engines(new_database())
    populate_at_0012(engine)
    migrate.upgrade(engine, "0022")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name) VALUES (3, 'three'), (4, 'four')"))
        conn.execute(text("DELETE FROM runs WHERE id = 4"))  # its partitions stay, empty
        assert conn.execute(text(EXPERIENCE_KEYS)).all() == []
        triggers = conn.execute(text(EXPERIENCE_TRIGGERS)).all()
    data = [f"experience_data{suffix}" for suffix in ("", "_r1", "_r2", "_r3", "_r4")]
    state = [f"experience_state{suffix}" for suffix in ("", "_r1", "_r2", "_r3", "_r4")]
    assert triggers == sorted(
        [(table, name) for table in data
         for name in ("experience_data_truncate", "experience_keys", "experience_state_unlink",
                      "ledger_ids_kept")]
        + [(table, "experience_keys") for table in state]
        + [("runs", "experiences_unlink"), ("runs", "ledger_ids_kept")])
    data_row = ("INSERT INTO {table} (id, run_id, prompt_text, response_text, prompt_ids, "
                "response_ids, reward, group_id, group_row) "
                "VALUES ({id}, {run}, 'p', 'r', '\\x', '\\x', 0, gen_random_uuid(), 0)")
    state_row = "INSERT INTO {table} (id, run_id, policy_version) VALUES ({id}, {run}, 0)"
    refusals = [  # (statement, SQLSTATE): 23503 foreign_key_violation, 23514 check_violation
        (data_row.format(table="experience_data", id=9, run=4), "23503"),  # run 4 is gone
        (data_row.format(table="experience_data_r4", id=9, run=4), "23503"),
        (state_row.format(table="experience_state", id=9, run=1), "23503"),
        (state_row.format(table="experience_state", id=4, run=1), "23503"),  # run 2's
        (state_row.format(table="experience_state_r1", id=9, run=1), "23503"),
        (data_row.format(table="experience_data_r3", id=9, run=3) + "; "
         + state_row.format(table="experience_state_r3", id=10, run=3), "23503"),
        ("UPDATE experience_data SET id = id", "23514"),
        ("UPDATE experience_data_r1 SET run_id = run_id", "23514"),
        ("UPDATE runs SET id = id", "23514"),
        ("TRUNCATE experience_data_r1", "23503"),  # its state rows would stay
        ("TRUNCATE experience_data", "23503"),
    ]
    assert [_refused(engine, statement) for statement, _ in refusals] == [
        code for _, code in refusals]
    with engine.begin() as conn:  # allowed: a data row and its state row, into either table
        conn.execute(text("TRUNCATE experience_data_r4"))  # nothing of it in the state rows
        conn.execute(text(data_row.format(table="experience_data", id=9, run=3)))
        conn.execute(text(state_row.format(table="experience_state_r3", id=9, run=3)))
        conn.execute(text(data_row.format(table="experience_data_r3", id=10, run=3)
                          + "; " + state_row.format(table="experience_state", id=10, run=3)))
        assert conn.execute(text(STATE_ROWS)).all() == [
            (1, 1), (1, 2), (1, 3), (2, 4), (3, 9), (3, 10)]
    deletes = {  # what each delete leaves of the state rows (and of the ledger)
        "DELETE FROM experiences WHERE id = 1": [(1, 2), (1, 3), (2, 4), (3, 9), (3, 10)],
        "DELETE FROM experience_data_r1 WHERE id IN (2, 3)": [(1, 1), (2, 4), (3, 9), (3, 10)],
        "DELETE FROM experience_data WHERE id IN (1, 4, 9)": [(1, 2), (1, 3), (3, 10)],
        "DELETE FROM runs WHERE id IN (2, 3)": [(1, 1), (1, 2), (1, 3)],
    }
    for statement, left in deletes.items():
        with engine.begin() as conn:
            conn.execute(text(statement))
            assert conn.execute(text(STATE_ROWS)).all() == left, statement
            ledger = conn.execute(text("SELECT experience_id FROM batch_items")).scalars().all()
            assert ledger == ([1] if (1, 1) in left else []), statement
            conn.rollback()
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM experience_data WHERE run_id = 3"))
    migrate.downgrade(engine, "0021")
    with engine.connect() as conn:
        assert conn.execute(text(EXPERIENCE_KEYS)).all() == [
            ("experience_data", "runs"), ("experience_state", "runs")] + [
            (f"experience_state_r{run}", f"experience_data_r{run}") for run in (1, 2, 3, 4)]
        assert conn.execute(text(EXPERIENCE_TRIGGERS)).all() == []
    assert _refused(engine, state_row.format(table="experience_state", id=4, run=1)) == "23503"
