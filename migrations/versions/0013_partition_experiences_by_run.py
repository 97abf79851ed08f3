"""experiences partitioned by run: a run's rows are two partitions, dropped in one statement

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01

`experience_data` and `experience_state` become tables partitioned by LIST (run_id), one
partition of each per run (`experience_data_r<run id>`, `experience_state_r<run id>`), created
with the run: an AFTER INSERT trigger on `runs` calls `experience_partitions_add(run id)`. An
archived run's rows leave the store with `DROP TABLE` of its two partitions (after the rows
that reference them are archived and deleted), not a row-by-row delete.

A key of a partitioned table includes the partition key, so an experience is now keyed by
(run_id, id) (ids still come from one sequence and stay unique across runs) and every row that
names an experience names its run too:

- batch_items, operator_events, reviews and review_actions gain `run_id`, filled from the rows
  they name (and by a trigger where an insert leaves it out); their foreign keys are
  (run_id, experience_id);
- preferences' chosen and rejected rows are of the preference's run (as every writer made them);
- a parent is (parent_run_id, parent_id), both set or both NULL (a parent may be of another run).

The unique group index is now per run: (group_id, group_row, run_id), led by the group so that
a lookup by group alone still probes one index a partition. The view `experiences`
joins on (run_id, id) and ends with `parent_run_id`; its triggers are replaced to match.
Existing rows move into the run's partitions.
"""

import importlib

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_0012 = importlib.import_module("reservoir.migrations.versions.0012_narrow_experience_state")
STATE, ORDER, EXPERIENCE_STATUSES = _0012.STATE, _0012.ORDER, _0012.EXPERIENCE_STATUSES
DATA = _0012.DATA + ("parent_run_id",)
VIEW_ORDER = ORDER + ("parent_run_id",)
_columns = _0012._columns

# Tables whose rows name an experience: (table, experience column, run column, on delete).
REFERENCING = (
    ("batch_items", "experience_id", "run_id", "CASCADE"),
    ("operator_events", "experience_id", "run_id", "CASCADE"),
    ("reviews", "experience_id", "run_id", "CASCADE"),
    ("preferences", "chosen_id", "run_id", "CASCADE"),
    ("preferences", "rejected_id", "run_id", "CASCADE"),
    ("review_actions", "experience_id", "run_id", "SET NULL"),
    ("experience_data", "parent_id", "parent_run_id", "SET NULL"),
)
GAIN_RUN_ID = ("batch_items", "operator_events", "reviews", "review_actions")


def _tables() -> str:
    return f"""
CREATE TABLE experience_data (
    id bigint NOT NULL DEFAULT nextval('experience_data_id_seq'),
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    task_id bigint REFERENCES tasks (id) ON DELETE SET NULL,
    prompt_text text NOT NULL,
    response_text text NOT NULL,
    prompt_ids bytea NOT NULL,
    response_ids bytea NOT NULL,
    logprobs bytea,
    action_mask bytea,
    reward float8 NOT NULL,
    shaped_reward float8,
    reward_components jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    metadata jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    parent_id bigint,
    parent_run_id bigint,
    prompt_len integer GENERATED ALWAYS AS (length(prompt_ids) / 4) STORED,
    response_len integer GENERATED ALWAYS AS (length(response_ids) / 4) STORED,
    CONSTRAINT experience_data_pkey PRIMARY KEY (id, run_id),
    CONSTRAINT experience_data_parent_both
        CHECK ((parent_id IS NULL) = (parent_run_id IS NULL))
) PARTITION BY LIST (run_id);
CREATE INDEX experience_data_task ON experience_data (task_id);
CREATE INDEX experience_data_parent ON experience_data (parent_run_id, parent_id)
    WHERE parent_id IS NOT NULL;
ALTER SEQUENCE experience_data_id_seq OWNED BY experience_data.id;

CREATE TABLE experience_state (
    id bigint NOT NULL,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    {_0012.STATE_COLUMNS},
    CONSTRAINT experience_state_pkey PRIMARY KEY (id, run_id),
    CONSTRAINT experience_state_data FOREIGN KEY (run_id, id)
        REFERENCES experience_data (run_id, id) ON DELETE CASCADE,
    {", ".join(_0012._state_checks("experience_state"))}
) PARTITION BY LIST (run_id);
CREATE INDEX experience_state_ready ON experience_state (run_id, created_at, id)
    WHERE status = 'ready';
CREATE INDEX experience_state_ready_priority ON experience_state (run_id, priority DESC, id)
    WHERE status = 'ready';
CREATE INDEX experience_state_leased ON experience_state (leased_until) WHERE status = 'leased';
CREATE UNIQUE INDEX experience_state_group_row ON experience_state (group_id, group_row, run_id);
CREATE INDEX experience_state_run_status ON experience_state (run_id, status);
CREATE INDEX experience_state_lease_token ON experience_state (lease_token)
    WHERE lease_token IS NOT NULL;
"""


# One place creates a run's partitions: the trigger on runs (and this migration, for the runs
# that exist). Attaching takes a lock that waits for open writes of experience_state and of the
# tables naming it (a lease, a commit: milliseconds), so a long transaction there makes creating
# a run fail after lock_timeout instead of queueing every writer behind it.
PARTITIONS = """
CREATE FUNCTION experience_partitions_add(run bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    parent text;
    waited text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '10s', true);
    FOREACH parent IN ARRAY ARRAY['experience_data', 'experience_state'] LOOP
        IF to_regclass(format('%I', parent || '_r' || run)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                           'INCLUDING GENERATED)', parent || '_r' || run, parent);
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES IN (%s)',
                           parent, parent || '_r' || run, run);
        END IF;
    END LOOP;
    PERFORM set_config('lock_timeout', waited, true);
END $$;
COMMENT ON FUNCTION experience_partitions_add(bigint) IS
  'Create the run''s partitions of experience_data and experience_state (if missing).';

CREATE FUNCTION runs_add_partitions() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM experience_partitions_add(NEW.id);
    RETURN NEW;
END $$;
CREATE TRIGGER runs_add_partitions AFTER INSERT ON runs
    FOR EACH ROW EXECUTE FUNCTION runs_add_partitions();
"""


# A row that names an experience but not its run (SQL written by hand) gets the run filled in;
# an experience that does not exist leaves it NULL, which its constraints refuse.
NAMED_RUN = """
CREATE FUNCTION experience_run_fill() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT run_id INTO NEW.run_id FROM experience_state WHERE id = NEW.experience_id;
    RETURN NEW;
END $$;
""" + "".join(f"""
CREATE TRIGGER {table}_experience_run BEFORE INSERT ON {table} FOR EACH ROW
    WHEN (NEW.run_id IS NULL AND NEW.experience_id IS NOT NULL)
    EXECUTE FUNCTION experience_run_fill();""" for table in GAIN_RUN_ID)


def _view(state: tuple[str, ...] = STATE) -> str:
    """The view over the two tables, `state` naming the columns the state row holds (0020
    gives it fewer)."""
    source = {name: "s" if name in state else "d" for name in VIEW_ORDER}
    source["id"] = source["run_id"] = "s"
    columns = ", ".join(f"{source[name]}.{name}" for name in VIEW_ORDER)
    defaults = {"id": "nextval('experience_data_id_seq')", "status": "'ready'", "priority": "0",
                "times_sampled": "0", "reward_components": "'{}'::jsonb",
                "metadata": "'{}'::jsonb", "created_at": "now()"}
    return f"""
CREATE VIEW experiences AS
SELECT {columns}
FROM experience_state s LEFT JOIN experience_data d ON d.run_id = s.run_id AND d.id = s.id;
COMMENT ON VIEW experiences IS
  'Every experience: its data (experience_data) and state (experience_state) under one name.';
""" + "".join(f"ALTER VIEW experiences ALTER COLUMN {name} SET DEFAULT {value};\n"
              for name, value in defaults.items())


def _triggers(in_state: tuple[str, ...] = STATE, in_data: tuple[str, ...] = DATA) -> str:
    """The view's trigger functions and triggers, for the columns the state row and the data
    row hold besides id and run_id (0020 moves the group's columns to the data row)."""
    data, state = ("id", "run_id") + in_data, ("id", "run_id") + in_state
    same_state = f"({_columns('s.', in_state)}) IS NOT DISTINCT FROM ({_columns('OLD.', in_state)})"
    parent_run = """
    IF NEW.parent_id IS NOT NULL AND NEW.parent_run_id IS NULL THEN
        SELECT run_id INTO NEW.parent_run_id FROM experience_state WHERE id = NEW.parent_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experiences: parent_id % is no experience', NEW.parent_id
                USING ERRCODE = 'foreign_key_violation';
        END IF;
    END IF;"""
    return f"""
CREATE OR REPLACE FUNCTION experiences_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN{parent_run}
    INSERT INTO experience_data ({_columns('', data)}) VALUES ({_columns('NEW.', data)})
    RETURNING prompt_len, response_len INTO NEW.prompt_len, NEW.response_len;
    INSERT INTO experience_state ({_columns('', state)}) VALUES ({_columns('NEW.', state)});
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION experiences_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id IS DISTINCT FROM OLD.id OR NEW.run_id IS DISTINCT FROM OLD.run_id THEN
        RAISE EXCEPTION 'experiences: an experience keeps its id and run'
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.parent_id IS DISTINCT FROM OLD.parent_id
       AND NEW.parent_run_id IS NOT DISTINCT FROM OLD.parent_run_id THEN
        NEW.parent_run_id := NULL;
    END IF;{parent_run}
    IF ({_columns('NEW.', in_state)}) IS DISTINCT FROM ({_columns('OLD.', in_state)}) THEN
        UPDATE experience_state s SET ({_columns('', in_state)}) = ({_columns('NEW.', in_state)})
        WHERE s.run_id = OLD.run_id AND s.id = OLD.id AND {same_state};
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experience % changed while this statement updated it', OLD.id
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    IF ({_columns('NEW.', in_data)}) IS DISTINCT FROM ({_columns('OLD.', in_data)}) THEN
        UPDATE experience_data SET ({_columns('', in_data)}) = ({_columns('NEW.', in_data)})
        WHERE run_id = OLD.run_id AND id = OLD.id RETURNING prompt_len, response_len
        INTO NEW.prompt_len, NEW.response_len;
    END IF;
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION experiences_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM experience_data WHERE run_id = OLD.run_id AND id = OLD.id;
    RETURN OLD;
END $$;

CREATE TRIGGER experiences_insert INSTEAD OF INSERT ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_insert();
CREATE TRIGGER experiences_update INSTEAD OF UPDATE ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_update();
CREATE TRIGGER experiences_delete INSTEAD OF DELETE ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_delete();
"""


def _drop_references() -> None:
    """Drop every foreign key that names experience_data or experience_state."""
    rows = op.get_bind().exec_driver_sql("""
        SELECT c.conrelid::regclass::text, c.conname FROM pg_constraint c
        WHERE c.contype = 'f' AND c.conparentid = 0
          AND c.confrelid IN ('experience_data'::regclass, 'experience_state'::regclass)
          AND c.conrelid NOT IN ('experience_data'::regclass, 'experience_state'::regclass)
        ORDER BY 1, 2""").all()
    for table, name in rows:
        op.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')


def _add_references() -> None:
    for table, column, run_column, action in REFERENCING:
        op.execute(f"""
            ALTER TABLE {table} ADD CONSTRAINT {table}_{column}_fkey
            FOREIGN KEY ({run_column}, {column}) REFERENCES experience_state (run_id, id)
            ON DELETE {action}""")


def _set_aside(table: str) -> None:
    """Rename a table and its indexes out of the way (`<name>_0012`)."""
    names = op.get_bind().exec_driver_sql(
        "SELECT indexrelid::regclass::text FROM pg_index "
        f"WHERE indrelid = '{table}'::regclass").scalars().all()
    for name in names:
        op.execute(f"ALTER INDEX {name} RENAME TO {name}_0012")
    op.execute(f"ALTER TABLE {table} RENAME TO {table}_0012")


def upgrade() -> None:
    saved = _0012._save_analytics_views()
    op.execute("DROP VIEW experiences")
    _drop_references()
    op.execute("ALTER SEQUENCE experience_data_id_seq OWNED BY NONE")
    _set_aside("experience_state")
    _set_aside("experience_data")
    op.execute(_tables())
    op.execute(PARTITIONS)
    op.execute("SELECT experience_partitions_add(id) FROM runs ORDER BY id")
    moved = _0012.DATA
    op.execute(f"""
        INSERT INTO experience_data (id, run_id, {_columns('', moved)}, parent_run_id)
        SELECT d.id, d.run_id, {_columns('d.', moved)}, p.run_id
        FROM experience_data_0012 d LEFT JOIN experience_state_0012 p ON p.id = d.parent_id;
        INSERT INTO experience_state (id, run_id, {_columns('', STATE)})
        SELECT id, run_id, {_columns('', STATE)} FROM experience_state_0012;
        DROP TABLE experience_state_0012, experience_data_0012;""")
    for table in GAIN_RUN_ID:
        op.execute(f"""
            ALTER TABLE {table} ADD COLUMN run_id bigint;
            UPDATE {table} t SET run_id = s.run_id FROM experience_state s
            WHERE s.id = t.experience_id;""")
    op.execute("""
        ALTER TABLE batch_items ALTER COLUMN run_id SET NOT NULL;
        ALTER TABLE reviews ALTER COLUMN run_id SET NOT NULL;""")
    for table in ("operator_events", "review_actions"):  # the pair is set, or NULL, together
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_experience_run "
                   "CHECK ((experience_id IS NULL) = (run_id IS NULL))")
    _add_references()
    op.execute(NAMED_RUN)
    op.execute(_view())
    op.execute(_triggers())
    _0012._restore_analytics_views(saved)


def downgrade() -> None:
    saved = _0012._save_analytics_views()
    op.execute("DROP VIEW experiences")
    _drop_references()
    op.execute("DROP FUNCTION experience_run_fill() CASCADE")
    for table in GAIN_RUN_ID:
        op.execute(f"ALTER TABLE {table} DROP COLUMN run_id")
    op.execute("""
        DROP TRIGGER runs_add_partitions ON runs;
        DROP FUNCTION runs_add_partitions(), experience_partitions_add(bigint);
        ALTER SEQUENCE experience_data_id_seq OWNED BY NONE;""")
    _set_aside("experience_state")
    _set_aside("experience_data")
    moved = _0012.DATA
    op.execute(f"""
        CREATE TABLE experience_data (
            id bigint PRIMARY KEY DEFAULT nextval('experience_data_id_seq'),
            run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            task_id bigint REFERENCES tasks (id) ON DELETE SET NULL,
            prompt_text text NOT NULL, response_text text NOT NULL,
            prompt_ids bytea NOT NULL, response_ids bytea NOT NULL,
            logprobs bytea, action_mask bytea, reward float8 NOT NULL, shaped_reward float8,
            reward_components jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            metadata jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            parent_id bigint REFERENCES experience_data (id) ON DELETE SET NULL,
            prompt_len integer GENERATED ALWAYS AS (length(prompt_ids) / 4) STORED,
            response_len integer GENERATED ALWAYS AS (length(response_ids) / 4) STORED);
        ALTER SEQUENCE experience_data_id_seq OWNED BY experience_data.id;
        CREATE INDEX experience_data_run ON experience_data (run_id);
        CREATE INDEX experience_data_task ON experience_data (task_id);
        CREATE INDEX experience_data_parent ON experience_data (parent_id)
            WHERE parent_id IS NOT NULL;
        CREATE TABLE experience_state (
            id bigint PRIMARY KEY REFERENCES experience_data (id) ON DELETE CASCADE,
            run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            {_0012.STATE_COLUMNS},
            {", ".join(_0012._state_checks("experience_state"))});
        INSERT INTO experience_data (id, run_id, {_columns('', moved)})
        SELECT id, run_id, {_columns('', moved)} FROM experience_data_0012 ORDER BY id;
        INSERT INTO experience_state (id, run_id, {_columns('', STATE)})
        SELECT id, run_id, {_columns('', STATE)} FROM experience_state_0012;
        DROP TABLE experience_state_0012, experience_data_0012;""")
    op.execute(_0012._lease_indexes("experience_state"))
    for table, column in (("batch_items", "experience_id"), ("operator_events", "experience_id"),
                          ("reviews", "experience_id"), ("preferences", "chosen_id"),
                          ("preferences", "rejected_id"), ("review_actions", "experience_id")):
        target = "experience_state" if table == "batch_items" else "experience_data"
        action = "SET NULL" if table == "review_actions" else "CASCADE"
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_{column}_fkey FOREIGN KEY "
                   f"({column}) REFERENCES {target} (id) ON DELETE {action}")
    op.execute(_0012._view())
    op.execute(_0012._triggers().replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    _0012._restore_analytics_views(saved)
