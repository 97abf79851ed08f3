"""The writer against a real PostgreSQL: validation, skip mode, round trip, atomicity."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from sqlalchemy import text

from reservoir.errors import ExperienceInvalid, StoreError
from reservoir.store import Experience, codec
from reservoir.store.records import INT32_MAX
from reservoir.store.tasks import add_tasks
from tests.commands import execute
from tests.factories import make_group, planned_relations


def fetch(store, sql: str, **params):
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def counts(store) -> tuple[int, int]:
    """(rows in experiences, sum of runs.rows_inserted)."""
    return tuple(fetch(store, "SELECT (SELECT count(*) FROM experiences), "
                              "(SELECT coalesce(sum(rows_inserted), 0)::bigint FROM runs)")[0])


@pytest.fixture
def seeded(store):
    """Run 'r' (group_size 4) already holding one group, so 'unchanged' is not just 'empty'."""
    store.create_run("r", group_size=4)
    store.write_groups([make_group("r", seed=100)])
    assert counts(store) == (4, 4)
    return store


def row(index: int, **changes):
    """A mutation that changes one row of a group."""
    def mutate(group):
        group[index] = replace(group[index], **changes)
        return group
    return mutate


def every_row(**changes):
    return lambda group: [replace(exp, **changes) for exp in group]


def case(case_id, mutate, field, row_index, shown):
    return pytest.param(mutate, field, row_index, shown, id=case_id)


INVALID = [
    case("logprobs-length", row(2, logprobs=[-0.5] * 5), "logprobs", 2,
         "[-0.5, -0.5, -0.5, -0.5, -0.5]"),
    case("mask-length", row(2, action_mask=[1] * 7), "action_mask", 2, "[1, 1, 1, 1, 1, 1, 1]"),
    case("reward-nan", row(2, reward=math.nan), "reward", 2, "= nan"),
    case("reward-inf", row(2, reward=math.inf), "reward", 2, "= inf"),
    case("component-nan", row(2, reward_components={"accuracy": math.nan}),
         "reward_components.accuracy", 2, "= nan"),
    case("empty-text", row(2, response_text=""), "response_text", 2, "= ''"),
    case("nul-in-text", row(2, response_text="a\x00b"), "response_text", 2, "= 'a\\x00b'"),
    case("blank-text", row(2, response_text=" \n"), "response_text", 2, r"= ' \n'"),
    case("empty-response-ids", row(2, response_ids=[]), "response_ids", 2, "= []"),
    case("negative-token", row(2, response_ids=[5, 6, -1, 7, 8, 9]), "response_ids", 2,
         "[5, 6, -1, 7, 8, 9]"),
    case("token-over-int32", row(2, response_ids=[5, 6, 2**31, 7, 8, 9]), "response_ids", 2,
         "[5, 6, 2147483648, 7, 8, 9]"),
    case("negative-prompt-token", row(2, prompt_ids=[3, -3]), "prompt_ids", 2, "[3, -3]"),
    case("float-tokens", row(2, response_ids=[1.5, 2, 3, 4, 5, 6]), "response_ids", 2,
         "[1.5, 2, 3, 4, 5, 6]"),
    case("mask-value-2", row(2, action_mask=[1, 1, 2, 1, 1, 1]), "action_mask", 2,
         "[1, 1, 2, 1, 1, 1]"),
    case("logprob-nan", row(2, logprobs=[-0.1] * 5 + [math.nan]), "logprobs", 2, "nan]"),
    case("logprob-inf", row(2, logprobs=[-math.inf] + [-0.1] * 5), "logprobs", 2, "[-inf,"),
    case("negative-version", every_row(policy_version=-1), "policy_version", 0, "= -1"),
    case("metadata-object", row(2, metadata={"when": object()}), "metadata", 2, "<object object"),
    case("metadata-nan", row(2, metadata={"x": math.nan}), "metadata", 2, "{'x': nan}"),
    case("run-missing", every_row(run="nope"), "run", 0, "'nope'"),
    case("group-size", lambda group: group[:3], "group_size", None, "3 rows"),
    case("mixed-run", row(2, run="other"), "run", 2, "'other'"),
    case("mixed-task", row(2, task_id=7), "task_id", 2, "= 7"),
    case("mixed-version", row(2, policy_version=1), "policy_version", 2, "= 1"),
    case("empty-group", lambda group: [], "group", None, "is empty"),
    # Regression guard (was a bug): records.py _RowChecker.per_token casts with np.asarray(values, dtype=np.int64), which
    # truncates 0.5 to 0, so a fractional mask is silently stored as 0 instead of rejected.
    case("mask-fraction", row(2, action_mask=[1, 1, 0.5, 1, 1, 1]), "action_mask", 2, "0.5"),
    # Regression guard (was a bug): the same cast raises a bare ValueError for a non-numeric logprob (not ExperienceInvalid),
    # so on_invalid="skip" cannot skip such a group and the whole batch fails.
    case("logprob-text", row(2, logprobs=[-0.1] * 5 + ["x"]), "logprobs", 2, "'x'"),
    # Regression guard (was a bug): policy_version has no upper bound; 2**31 passes validation and asyncpg then fails the
    # COPY on the integer column with a driver error that names no group, row or field.
    case("version-over-int32", every_row(policy_version=2**31), "policy_version", 0, "2147483648"),
    # Issue 8, found on main: accepted, or refused with a raw Python error instead of the writer's.
    case("logprob-overflows-float32", row(2, logprobs=[-1e300] + [-0.1] * 5), "logprobs", 2,
         "[-1e+300"),
    case("logprob-positive", row(2, logprobs=[0.5] + [-0.1] * 5), "logprobs", 2, "[0.5"),
    case("response-int", row(2, response_text=123), "response_text", 2, "= 123"),
    case("response-bytes", row(2, response_text=b"abc"), "response_text", 2, "b'abc'"),
    case("response-none", row(2, response_text=None), "response_text", 2, "= None"),
    case("response-lone-surrogate", row(2, response_text="a\ud800"), "response_text", 2,
         "\\ud800"),
    case("prompt-int", row(2, prompt_text=5), "prompt_text", 2, "= 5"),
    case("task-id-text", every_row(task_id="x"), "task_id", 0, "'x'"),
    case("task-id-bool", every_row(task_id=True), "task_id", 0, "True"),
    case("group-id-text", every_row(group_id="abc"), "group_id", 0, "'abc'"),
    case("run-int", every_row(run=5), "run", 0, "= 5"),
    case("reward-bool", row(2, reward=True), "reward", 2, "True"),
    case("reward-text", row(2, reward="1"), "reward", 2, "'1'"),
    case("components-list", row(2, reward_components=[1.0]), "reward_components", 2, "[1.0]"),
    case("components-key-int", row(2, reward_components={1: 1.0}), "reward_components", 2,
         "{1: 1.0}"),
    case("metadata-list", row(2, metadata=[1]), "metadata", 2, "[1]"),
    case("parent-id-text", row(2, parent_id="p"), "parent_id", 2, "'p'"),
    case("row-not-an-experience", lambda g: g[:2] + [{"run": "r"}] + g[3:], "group", 2,
         "{'run': 'r'}"),
    # Issue 28, found on main: accepted, and then a float32 tensor of inf, an IndexError, or a
    # row of a version no trainer published.
    case("reward-past-float32", row(2, reward=1e39), "reward", 2, "= 1e+39"),
    case("reward-past-the-range", row(2, reward=-1e7), "reward", 2, "= -10000000.0"),
    case("component-past-float32", row(2, reward_components={"accuracy": 1e39}),
         "reward_components.accuracy", 2, "= 1e+39"),
    case("empty-prompt-ids", row(2, prompt_ids=[]), "prompt_ids", 2, "= []"),
    case("version-never-published", every_row(policy_version=3), "policy_version", 0, "= 3"),
]


@pytest.mark.parametrize("mutate, field, row_index, shown", INVALID)
def test_invalid_group_rejects_the_whole_batch(seeded, mutate, field, row_index, shown):
    batch = [make_group("r", seed=1), mutate(make_group("r", seed=2)), make_group("r", seed=3)]
    before = counts(seeded)
    with pytest.raises(ExperienceInvalid) as info:
        seeded.write_groups(batch)
    exc = info.value
    assert (exc.group_index, exc.row_index, exc.field) == (1, row_index, field)
    message = str(exc)
    assert message.startswith("group 1")
    assert field in message and shown in message
    if row_index is not None:
        assert f"group 1 row {row_index}" in message
    assert counts(seeded) == before


def test_a_flat_list_of_experiences_is_not_a_batch_of_groups(seeded):
    before = counts(seeded)
    with pytest.raises(ExperienceInvalid, match="group 0: a group is a list of Experience rows"):
        seeded.write_groups(make_group("r", seed=1))
    assert counts(seeded) == before


@pytest.mark.parametrize("status", ["consumed", "leased", "quarantined", "bogus"])
def test_the_writer_writes_only_raw_or_ready(seeded, status):
    before = counts(seeded)
    with pytest.raises(StoreError, match=f"status {status!r}: the writer writes raw or ready"):
        seeded.write_groups([make_group("r", seed=1)], status=status)
    assert counts(seeded) == before


def test_a_group_id_is_written_once(seeded):
    import uuid

    group_id = uuid.uuid4()
    seeded.write_groups([make_group("r", seed=1, group_id=group_id)])
    before = counts(seeded)
    with pytest.raises(ExperienceInvalid, match=f"group 0: group_id {group_id} already exists"):
        seeded.write_groups([make_group("r", seed=2, group_id=group_id)])
    twin = uuid.uuid4()
    with pytest.raises(ExperienceInvalid, match=f"group 1: group_id {twin} appears twice"):
        seeded.write_groups([make_group("r", seed=3, group_id=twin),
                             make_group("r", seed=4, group_id=twin)])
    result = seeded.write_groups([make_group("r", seed=5),
                                  make_group("r", seed=6, group_id=group_id)], on_invalid="skip")
    assert (result.groups, [e.field for e in result.rejected]) == (1, ["group_id"])
    assert counts(seeded) == (before[0] + 4, before[1] + 4)


def test_a_group_id_names_one_group_of_one_run_and_the_server_says_so(seeded):
    """A group id is taken across runs, and the server holds it (experience_groups): an insert
    that goes round the writer, through the view, of another run's group id is refused. Before
    migration 0015 each run's partition had its own unique group index and only the writer
    looked at the other runs."""
    import uuid

    from sqlalchemy.exc import IntegrityError

    second = seeded.create_run("second", group_size=4)
    group_id = uuid.uuid4()
    seeded.write_groups([make_group("r", seed=1, group_id=group_id)])
    with pytest.raises(ExperienceInvalid, match=f"group 0: group_id {group_id} already exists"):
        seeded.write_groups([make_group("second", seed=2, group_id=group_id)])
    insert = text("INSERT INTO experiences (run_id, group_id, group_row, policy_version, "
                  "prompt_text, response_text, prompt_ids, response_ids, reward) VALUES "
                  "(:run, :group, 0, 0, 'p', 'r', '\\x', '\\x', 0)")
    with pytest.raises(IntegrityError, match="experience_groups_pkey"):
        with seeded.engine.begin() as conn:
            conn.execute(insert, {"run": second, "group": group_id})
    with seeded.engine.connect() as conn:
        rows = conn.execute(text("SELECT count(*) FROM experience_data WHERE group_id = :g"),
                            {"g": group_id}).scalar()
    assert rows == 4  # the first group only


def test_the_writer_s_lookup_reads_no_run_s_partition(seeded):
    """The writer's one lookup before its COPY (rows naming no parent, as explorers write them)
    looks group ids up in one index (experience_groups) and plans no run's partition: on a
    store of 200 runs the lookup took 29 ms of a 512-row write through the partitions' group
    indexes and the parents' lookup, against 1.2 ms on a store of one."""
    from reservoir.store import writer

    seeded.create_run("second", group_size=4)
    read = planned_relations(seeded.engine, writer.LOOKUP_NO_PARENTS, dict(
        names=["r"], groups=["00000000-0000-0000-0000-000000000001"], n=4))
    assert "experience_groups" in read
    assert not {name for name in read if name.startswith("experience_state")}, read


def test_numpy_float32_reward_is_accepted(seeded):
    # Regression guard (was a bug): records.py encode_row checks isinstance(exp.reward, (int, float)); np.float32 (what
    # np.mean of a float32 array returns) is not a float subclass, so 0.5 is rejected as
    # "reward must be a finite number". Same for np.int64 policy_version.
    seeded.write_groups([make_group("r", seed=1, reward=np.float32(0.5))])
    sql = "SELECT DISTINCT reward FROM experiences WHERE prompt_text = 'prompt 1'"
    assert fetch(seeded, sql) == [(0.5,)]


def test_reward_zero_is_a_reward(seeded):
    seeded.write_groups([make_group("r", seed=1, rewards=[0.0, 0.0, 0, 0.0])])
    rows = fetch(seeded, "SELECT reward, reward_components FROM experiences "
                         "WHERE prompt_text = 'prompt 1'")
    assert [tuple(r) for r in rows] == [(0.0, {"accuracy": 0.0})] * 4


def test_skip_writes_the_good_groups_and_returns_the_bad(seeded):
    before = counts(seeded)
    batch = [make_group("r", seed=1), make_group("r", seed=2, reward=math.nan),
             make_group("r", seed=3)]
    result = seeded.write_groups(batch, on_invalid="skip")
    assert (result.groups, result.rows) == (2, 8)
    assert [(e.group_index, e.row_index, e.field) for e in result.rejected] == [(1, 0, "reward")]
    assert counts(seeded) == (before[0] + 8, before[1] + 8)
    written = dict(fetch(seeded, "SELECT DISTINCT prompt_text, group_id FROM experiences "
                                 "WHERE prompt_text <> 'prompt 100'"))
    assert set(written) == {"prompt 1", "prompt 3"}
    assert [written["prompt 1"], written["prompt 3"]] == result.group_ids


def test_skip_with_only_bad_groups_writes_nothing(seeded):
    before = counts(seeded)
    result = seeded.write_groups([make_group("r", seed=1, size=3), []],
                                 on_invalid="skip")
    assert (result.groups, result.rows, result.group_ids) == (0, 0, [])
    assert [e.field for e in result.rejected] == ["group_size", "group"]
    assert counts(seeded) == before


@pytest.fixture
def written(store):
    """A group with edge values written to run 'r' (group_size 3) for a task: (group, result)."""
    store.create_run("r", group_size=3)
    store.publish_version("r", 2, location="file:///v2", train_step=2)
    with store.engine.begin() as conn:
        [task_id] = add_tasks(conn, store.aio.run_ids("r")[0], [{"prompt": "2+2=?"}])
    common = dict(run="r", task_id=task_id, policy_version=2, prompt_text="2+2=? ✓")
    group = [
        Experience(**common, response_text="4", prompt_ids=[0, 7, INT32_MAX],
                   response_ids=[INT32_MAX, 0, 3, 4],
                   logprobs=[-0.1, -1e-45, -3.4028235e38, 0.0], action_mask=[1, 0, 0, 1],
                   reward=1.0, reward_components={"accuracy": 1.0, "format": 0.25},
                   metadata={"seed": 7, "tags": ["a", "é"]}),
        Experience(**common, response_text="four", prompt_ids=[5], response_ids=[9],
                   reward=-0.5),
        Experience(**common, response_text="IV", prompt_ids=np.arange(20),
                   response_ids=np.arange(100, 150, dtype=np.uint16),
                   logprobs=-np.linspace(0.5, 30, 50), action_mask=np.ones(50, np.uint8),
                   reward=0.0),
    ]
    return group, store.write_groups([group])


def test_round_trip_through_numpy(written, store):
    group, result = written
    rows = fetch(store, "SELECT * FROM experiences ORDER BY id")
    assert len(rows) == len(group) == result.rows
    assert {r.group_id for r in rows} == set(result.group_ids) and len(result.group_ids) == 1
    for exp, r in zip(group, rows):
        assert (r.run_id, r.task_id, r.policy_version, r.status) == (
            store.aio.run_ids("r")[0], exp.task_id, 2, "ready")
        assert (r.prompt_text, r.response_text, r.reward) == (
            exp.prompt_text, exp.response_text, exp.reward)
        assert (r.reward_components, r.metadata) == (exp.reward_components, exp.metadata)
        assert np.array_equal(codec.decode(r.prompt_ids, codec.TOKEN), exp.prompt_ids)
        assert np.array_equal(codec.decode(r.response_ids, codec.TOKEN), exp.response_ids)
        assert (r.prompt_len, r.response_len) == (len(exp.prompt_ids), len(exp.response_ids))
        if exp.logprobs is None:
            assert r.logprobs is None and r.action_mask is None
            continue
        logprobs = codec.decode(r.logprobs, codec.LOGPROB)
        assert logprobs.dtype == np.float32
        assert logprobs.tobytes() == np.asarray(exp.logprobs, np.float32).tobytes()
        assert codec.decode(r.action_mask, codec.MASK).tolist() == list(exp.action_mask)


def test_round_trip_through_sql_decoders(written, store):
    group, _ = written
    rows = fetch(store, "SELECT * FROM analytics.experience_tokens WHERE run = 'r' "
                        "ORDER BY experience_id")
    assert len(rows) == len(group)
    for exp, r in zip(group, rows):
        assert r.prompt_ids == [int(t) for t in exp.prompt_ids]
        assert r.response_ids == [int(t) for t in exp.response_ids]
        if exp.logprobs is None:
            assert r.logprobs is None and r.action_mask is None
            continue
        assert (np.asarray(r.logprobs, np.float32).tobytes()
                == np.asarray(exp.logprobs, np.float32).tobytes())
        assert r.action_mask == [int(m) for m in exp.action_mask]


def test_sql_decoder_keeps_the_sign_of_zero(store):
    # Regression guard (was a bug): migrations/versions/0002_analytics_views.py, analytics.float32_from_bits, branch
    # e = 0: (1 - 2 * s) * m is a bigint product, so for m = 0 the sign is lost before the
    # float8 multiply and a logprob of -0.0 decodes as +0.0 (numpy decode keeps -0.0).
    store.create_run("r", group_size=1)
    store.write_groups([[Experience(run="r", prompt_text="p", response_text="r", prompt_ids=[1],
                                    response_ids=[2, 3], logprobs=[-0.0, -1.0], reward=0.0)]])
    [(logprobs,)] = fetch(store, "SELECT logprobs FROM analytics.experience_tokens")
    assert np.signbit(logprobs).tolist() == [True, True]


def test_status_and_rows_inserted(seeded):
    result = seeded.write_groups([make_group("r", seed=1), make_group("r", seed=2)], status="raw")
    assert result.rows == 8
    assert fetch(seeded, "SELECT rows_inserted FROM runs WHERE name = 'r'")[0][0] == 4 + 8
    statuses = dict(fetch(seeded, "SELECT prompt_text, string_agg(DISTINCT status, ',') "
                                  "FROM experiences GROUP BY prompt_text"))
    assert statuses == {"prompt 100": "ready", "prompt 1": "raw", "prompt 2": "raw"}


def test_database_failure_writes_nothing_of_the_batch(seeded):
    before = counts(seeded)
    batch = [make_group("r", seed=1), make_group("r", seed=2, task_id=999_999)]
    # Observed: asyncpg.exceptions.ForeignKeyViolationError, raised by the COPY and not wrapped
    # (see test_database_failure_is_a_store_error).
    with pytest.raises(Exception, match="task_id") as info:
        seeded.write_groups(batch)
    assert not isinstance(info.value, ExperienceInvalid)
    assert counts(seeded) == before
    seeded.write_groups([make_group("r", seed=3)])  # the pooled connection is still usable
    assert counts(seeded) == (before[0] + 4, before[1] + 4)


def test_database_failure_is_a_store_error(seeded):
    # Regression guard (was a bug): writer.py write_groups calls asyncpg's copy_records_to_table without catching driver
    # errors, so an asyncpg.ForeignKeyViolationError escapes instead of a StoreError (STYLE.md:
    # wrap driver errors; ledger.py wraps IntegrityError this way).
    with pytest.raises(StoreError, match="task_id"):
        seeded.write_groups([make_group("r", seed=2, task_id=999_999)])


def test_a_connection_the_server_ends_mid_write_is_one_line_and_writes_nothing(seeded,
                                                                               as_admin):
    """The server ends the writer's connection inside its transaction (here the superuser
    ends it before the COPYs): one line that says the connection was lost, nothing written,
    and the next write gets a new connection. The message used to be SQLAlchemy's error about
    the rollback that could not run, over two lines."""
    from sqlalchemy import text as sql

    async def end_own_backend(conn) -> None:
        pid = (await conn.execute(sql("SELECT pg_backend_pid()"))).scalar()
        execute(as_admin(seeded.url), f"SELECT pg_terminate_backend({pid})")

    before = counts(seeded)
    with pytest.raises(StoreError) as info:
        seeded.write_groups([make_group("r", seed=i) for i in range(20)],
                            before_copy=end_own_backend)
    message = str(info.value)
    assert "\n" not in message and "connection to the database was lost" in message, message
    assert message.startswith("writing 20 groups failed in the database; nothing of this "
                              "batch was written"), message
    assert counts(seeded) == before
    seeded.write_groups([make_group("r", seed=50)])
    assert counts(seeded) == (before[0] + 4, before[1] + 4)


BAD_LATE = {"value": dict(reward=math.nan), "database": dict(task_id=999_999)}


@pytest.mark.parametrize("bad", sorted(BAD_LATE))
def test_a_bad_group_chunks_into_a_write_leaves_nothing_of_it(seeded, bad):
    """The writer sends a batch as one COPY of data and one of state rows per chunk of 16
    groups while it checks the next chunk: a group the writer refuses (a NaN reward) or the
    server refuses (no such task) in the third chunk rolls back the chunks already sent."""
    before = counts(seeded)
    batch = [make_group("r", seed=i) for i in range(40)]
    batch[37] = make_group("r", seed=37, **BAD_LATE[bad])
    expected = ExperienceInvalid if bad == "value" else StoreError
    with pytest.raises(expected, match="group 37 row 0 .*field 'reward' = nan" if bad == "value"
                       else "task_id"):
        seeded.write_groups(batch)
    assert counts(seeded) == before
    seeded.write_groups([make_group("r", seed=50)])  # the pooled connection is still usable
    assert counts(seeded) == (before[0] + 4, before[1] + 4)


def test_skip_across_chunks_writes_each_good_group_whole_with_its_ids(seeded):
    """Bad groups in the first and third chunks are skipped; every other group lands whole, its
    data and state rows under the same ids, in the order given."""
    batch = [make_group("r", seed=i, reward=math.nan if i in (3, 35) else 0.5)
             for i in range(40)]
    result = seeded.write_groups(batch, on_invalid="skip")
    assert [e.group_index for e in result.rejected] == [3, 35]
    assert (result.groups, result.rows) == (38, 152)
    rows = fetch(seeded, "SELECT group_id, group_row, prompt_text FROM experiences "
                         "WHERE reward = 0.5 ORDER BY id")
    assert [(r.group_id, r.group_row) for r in rows] == [
        (group_id, row) for group_id in result.group_ids for row in range(4)]
    assert [r.prompt_text for r in rows[::4]] == [
        f"prompt {i}" for i in range(40) if i not in (3, 35)]


def test_a_parent_names_an_experience_and_its_run(seeded):
    """A parent of another run is stored with that run; a parent id no experience has refuses
    its group (skip mode writes the others)."""
    seeded.create_run("child", group_size=4)
    (parent_id, parent_run), = fetch(seeded, "SELECT id, run_id FROM experiences "
                                              "ORDER BY id LIMIT 1")
    missing = fetch(seeded, "SELECT max(id) + 1000 FROM experiences")[0][0]
    good = make_group("child", seed=1, parent_id=parent_id)
    bad = make_group("child", seed=2, parent_id=missing)
    with pytest.raises(ExperienceInvalid, match=f"group 1 row 0: field 'parent_id' = {missing}: "
                                                "no experience has that id"):
        seeded.write_groups([good, bad])
    assert counts(seeded) == (4, 4)
    result = seeded.write_groups([good, bad], on_invalid="skip")
    assert result.groups == 1 and [e.field for e in result.rejected] == ["parent_id"]
    rows = fetch(seeded, "SELECT parent_id, parent_run_id, run_id FROM experiences "
                         "WHERE parent_id IS NOT NULL")
    child_run = fetch(seeded, "SELECT id FROM runs WHERE name = 'child'")[0][0]
    assert rows == [(parent_id, parent_run, child_run)] * 4 and parent_run != child_run


def test_a_write_cancelled_in_its_lookup_is_one_line_and_writes_nothing(seeded, as_admin):
    """A write whose first statement (the runs, group ids and new ids it looks up) fails in the
    database: one StoreError line, nothing written. It used to raise UnboundLocalError: the
    message counted the admitted groups, which the lookup had not yet made."""
    import threading
    import time

    def cancel_the_waiting_write() -> None:
        with seeded.engine.connect() as conn:
            for _ in range(250):
                pids = conn.execute(text(
                    "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
                    "WHERE NOT l.granted AND a.query LIKE '%experience_groups%'")).scalars().all()
                if pids:
                    execute(as_admin(seeded.url), f"SELECT pg_cancel_backend({int(pids[0])})")
                    return
                time.sleep(0.02)

    before = counts(seeded)
    with seeded.engine.connect() as locker, locker.begin():
        locker.execute(text("LOCK TABLE experience_groups IN ACCESS EXCLUSIVE MODE"))
        canceller = threading.Thread(target=cancel_the_waiting_write)
        canceller.start()
        with pytest.raises(StoreError, match=r"nothing of this batch was written: .*cancel"):
            seeded.write_groups([make_group("r", seed=7)])
        canceller.join(10)
    assert counts(seeded) == before


def test_token_ids_past_the_run_s_vocabulary_are_refused(store):
    """Issue 28: a token id of 2**31 - 1 was written and later crashed a trainer with an
    IndexError in its embedding; a run made from a model knows its vocabulary."""
    store.create_run("v", group_size=4, vocab_size=1000)
    before = counts(store)
    for field in ("prompt_ids", "response_ids"):
        group = make_group("v", seed=1)
        setattr(group[1], field, [5, 1000, 6, 7, 8, 9])
        with pytest.raises(ExperienceInvalid, match=rf"group 0 row 1 .*'{field}'.* run 'v' "
                                                    r"has a vocabulary of 1000 tokens"):
            store.write_groups([group])
    assert counts(store) == before
    store.write_groups([make_group("v", seed=2)])  # ids below 1000 go in


def test_a_version_is_written_once_it_is_published(seeded):
    seeded.publish_version("r", 3, location="file:///v3", train_step=3)
    seeded.write_groups([make_group("r", seed=5, version=3)])
    with pytest.raises(ExperienceInvalid, match="policy_version' = 4: run 'r' has published "
                                                "no version past 3"):
        seeded.write_groups([make_group("r", seed=6, version=4)])
