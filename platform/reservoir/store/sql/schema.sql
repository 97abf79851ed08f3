-- Reservoir's database as the migrations leave it (migrations/versions, head 0028), in one file
-- for a person learning it: every table, index, function, trigger, view and grant, by family.
--
-- When you add a migration, update this file; tests/test_schema.py checks they agree (it builds
-- one database by the migrations, one from this file, and compares their catalogs).
--
-- What it assumes (as a deployment has it, roles.bootstrap having run as a superuser first):
-- - the roles reservoir_owner (owns everything here) and reservoir_reader (reads the analytics
--   views, nothing else) exist;
-- - it runs as reservoir_owner in a database where bootstrap gave that role CREATE, and took
--   from PUBLIC temporary tables, creating in schema public, the large-object creators and
--   pg_terminate_backend / pg_cancel_backend: none of that is repeated here.
-- It is for reading (and for the test), not for making a store: it has no alembic_version,
-- so Alembic would take a database made from it for an empty one (`reservoir db upgrade`
-- makes a store). Function bodies are the migrations' text byte for byte (the catalog keeps a
-- body as written), hence their long lines.
--
-- Names: a table's rows are its plural (runs, tasks); `<thing>_id` names another table's row;
-- a run's experiences and ledger rows live in partitions named `<table>_r<run id>`, made with
-- the run (experience_partitions_add), so an empty store has none.


-- ============================================================================================
-- Runs: one row per training run (or task set); everything else names its run.
-- ============================================================================================

CREATE TABLE runs (
    id bigserial PRIMARY KEY,
    name text NOT NULL UNIQUE,
    config jsonb NOT NULL DEFAULT '{}'::jsonb,      -- the run's config, passwords removed
    model text,
    status text NOT NULL DEFAULT 'created',
    group_size integer,                             -- responses a task gets, when fixed
    rows_inserted bigint NOT NULL DEFAULT '0'::bigint,
    rows_sampled bigint NOT NULL DEFAULT '0'::bigint,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    progress jsonb NOT NULL DEFAULT '{}'::jsonb,    -- work that is not a train step (warm-up)
    parent_run_id bigint REFERENCES runs (id) ON DELETE SET NULL,  -- branched `--from RUN@STEP`
    parent_step integer,
    vocab_size integer,                             -- the writer refuses token ids past it
    CONSTRAINT runs_status_valid
        CHECK (status IN ('created', 'running', 'stopped', 'finished', 'failed')),
    CONSTRAINT runs_group_size_positive CHECK (group_size IS NULL OR group_size > 0),
    CONSTRAINT runs_vocab_size_positive CHECK (vocab_size IS NULL OR vocab_size > 0)
);


-- ============================================================================================
-- Tasks and their claims: the prompts explorers answer. An explorer claims a task
-- (claim_token, claimed_by, claimed_until) until its group is written or the claim expires.
-- ============================================================================================

CREATE TABLE tasks (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    prompt text NOT NULL,
    answer text,
    payload jsonb NOT NULL DEFAULT '{}'::jsonb,
    source text,
    split text NOT NULL DEFAULT 'train',
    difficulty double precision,
    priority double precision NOT NULL DEFAULT '0'::double precision,
    times_explored integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    claim_token uuid,
    claimed_by text,
    claimed_until timestamptz,
    status text NOT NULL DEFAULT 'active',
    parent_id bigint REFERENCES tasks (id) ON DELETE SET NULL,
    metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
    CONSTRAINT tasks_status_valid CHECK (status IN ('active', 'retired')),
    CONSTRAINT tasks_difficulty_range
        CHECK (difficulty IS NULL OR (difficulty >= 0 AND difficulty <= 1)),
    CONSTRAINT tasks_priority_finite
        CHECK (priority <> 'NaN' AND priority > '-Infinity' AND priority < 'Infinity')
);
CREATE INDEX tasks_run_split ON tasks (run_id, split);
-- the three claim orders (explorer.task_order), each an index on active tasks
CREATE INDEX tasks_claim_order ON tasks (run_id, split, times_explored, id)
    WHERE status = 'active';
CREATE INDEX tasks_claim_priority ON tasks (run_id, split, priority DESC, times_explored, id)
    WHERE status = 'active';
CREATE INDEX tasks_claim_difficulty ON tasks (run_id, split, difficulty, times_explored, id)
    WHERE status = 'active';
CREATE INDEX tasks_claimed ON tasks (run_id, claimed_until) WHERE claim_token IS NOT NULL;
CREATE INDEX tasks_parent ON tasks (parent_id) WHERE parent_id IS NOT NULL;
COMMENT ON COLUMN tasks.status IS
  'active (explorers claim it) or retired (a task pipeline dropped or replaced it: never claimed again, never deleted).';
COMMENT ON COLUMN tasks.difficulty IS
  '1 - the pass rate of its experiences (task_difficulty_mapper), in [0, 1]; NULL while unmeasured.';


-- ============================================================================================
-- Experiences: each response an explorer wrote, in two tables partitioned by run.
-- - experience_data: what is written once (texts, token ids, logprobs, mask, rewards, group,
--   parent), wide; a run's data partition keeps rows up to a page (toast_tuple_target).
-- - experience_state: what leases and commits rewrite (status, priority, lease), narrow.
-- - experiences: a view of both under one name, writable through INSTEAD OF triggers.
-- Foreign keys between them are statement triggers (experience_keys, *_unlink): a key checked
-- through a partitioned parent costs a query a row.
-- Lifecycle (status): raw -> ready -> leased -> consumed, or quarantined / retired / held
-- (waiting for a review). A leased row has its lease_token, and only a leased row.
-- ============================================================================================

CREATE SEQUENCE experience_data_id_seq;  -- one id sequence across runs: ids are unique

CREATE TABLE experience_data (
    id bigint NOT NULL DEFAULT nextval('experience_data_id_seq'),
    run_id bigint NOT NULL,
    task_id bigint REFERENCES tasks (id) ON DELETE SET NULL,
    prompt_text text NOT NULL,
    response_text text NOT NULL,
    prompt_ids bytea NOT NULL,                      -- int32 little-endian token ids
    response_ids bytea NOT NULL,
    logprobs bytea,                                 -- float32 little-endian, one a response token
    action_mask bytea,                              -- one byte a response token
    reward double precision NOT NULL,               -- as the reward function wrote it
    shaped_reward double precision,                 -- an operator's; the trainer uses it if set
    reward_components jsonb NOT NULL DEFAULT '{}'::jsonb,
    metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
    parent_id bigint,                               -- (parent_run_id, parent_id): any run's row
    parent_run_id bigint,
    prompt_len integer GENERATED ALWAYS AS (length(prompt_ids) / 4) STORED,
    response_len integer GENERATED ALWAYS AS (length(response_ids) / 4) STORED,
    group_id uuid NOT NULL,                         -- one group of one run (experience_groups)
    group_row smallint NOT NULL,                    -- the row's place in its group
    PRIMARY KEY (id, run_id),
    CONSTRAINT experience_data_parent_both CHECK ((parent_id IS NULL) = (parent_run_id IS NULL)),
    CONSTRAINT experience_data_group_row_valid CHECK (group_row >= 0)
) PARTITION BY LIST (run_id);
ALTER SEQUENCE experience_data_id_seq OWNED BY experience_data.id;
CREATE UNIQUE INDEX experience_data_group_row ON experience_data (group_id, group_row, run_id)
    INCLUDE (id);
CREATE INDEX experience_data_parent ON experience_data (parent_run_id, parent_id)
    WHERE parent_id IS NOT NULL;
CREATE INDEX experience_data_task ON experience_data (task_id);

CREATE TABLE experience_state (
    id bigint NOT NULL,
    run_id bigint NOT NULL,
    policy_version integer NOT NULL,                -- the policy that generated the row
    status text NOT NULL DEFAULT 'ready',
    priority double precision NOT NULL DEFAULT 0,
    times_sampled integer NOT NULL DEFAULT 0,
    lease_token uuid,
    leased_until timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id, run_id),
    CONSTRAINT experience_state_status_valid CHECK (status IN
        ('raw', 'ready', 'leased', 'consumed', 'quarantined', 'retired', 'held')),
    CONSTRAINT experience_state_lease_iff_leased
        CHECK ((status = 'leased') = (lease_token IS NOT NULL))
) PARTITION BY LIST (run_id);
-- The indexes that serve leases; a lease and a commit change status, so at_rest leaves out
-- leased and consumed rows (a rewrite adds no entry to it).
CREATE INDEX experience_state_ready ON experience_state (run_id, created_at, id)
    WHERE status = 'ready';
CREATE INDEX experience_state_ready_priority ON experience_state (run_id, priority DESC, id)
    WHERE status = 'ready';
CREATE INDEX experience_state_leased ON experience_state (leased_until) WHERE status = 'leased';
CREATE INDEX experience_state_at_rest ON experience_state (run_id, status)
    WHERE status NOT IN ('leased', 'consumed');

ALTER TABLE experience_data ADD CONSTRAINT experience_data_parent_id_fkey
    FOREIGN KEY (parent_run_id, parent_id) REFERENCES experience_state (run_id, id)
    ON DELETE SET NULL;

CREATE TABLE experience_groups (
    group_id uuid PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE
);
CREATE INDEX experience_groups_run ON experience_groups (run_id);
COMMENT ON TABLE experience_groups IS
  'Every group id, with its run: a group id names one group of one run.';

-- A run's partitions: created with the run, dropped when it is archived.
CREATE FUNCTION experience_partitions_add(run bigint) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    part record;
    waited text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '10s', true);
    FOR part IN SELECT * FROM (VALUES
        (1, 'experience_data', NULL, NULL, NULL),
        (2, 'experience_state', NULL, NULL, NULL),
        (3, 'batch_items', NULL, NULL, NULL))
        AS p (n, parent, key, columns, target) ORDER BY n
    LOOP
        IF to_regclass(format('%I', part.parent || '_r' || run)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                           'INCLUDING GENERATED)', part.parent || '_r' || run, part.parent);
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES IN (%s)',
                           part.parent, part.parent || '_r' || run, run);
            IF part.key IS NOT NULL THEN
                EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I FOREIGN KEY %s '
                               'REFERENCES %I (run_id, id) ON DELETE CASCADE',
                               part.parent || '_r' || run, part.parent || '_r' || run || '_'
                               || part.key, part.columns, part.target || '_r' || run);
            END IF;
            IF part.parent = 'experience_data' THEN
                EXECUTE format('ALTER TABLE %I SET (toast_tuple_target = 8160)', part.parent || '_r' || run);
                EXECUTE format('CREATE TRIGGER experience_groups_add AFTER INSERT ON %I REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_groups_add()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_state' THEN
                EXECUTE format('CREATE TRIGGER batch_items_unlink AFTER DELETE ON %I REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION batch_items_unlink()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_state' THEN
                EXECUTE format('CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON %I FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept(''id, run_id'')',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'batch_items' THEN
                EXECUTE format('CREATE TRIGGER batch_items_keys AFTER INSERT ON %I REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'batch_items' THEN
                EXECUTE format('CREATE TRIGGER batch_items_keys_update AFTER UPDATE ON %I REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_data' THEN
                EXECUTE format('CREATE TRIGGER experience_keys AFTER INSERT ON %I REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_keys()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_data' THEN
                EXECUTE format('CREATE TRIGGER experience_state_unlink AFTER DELETE ON %I REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION experience_state_unlink()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_data' THEN
                EXECUTE format('CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON %I FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept(''id, run_id'')',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_data' THEN
                EXECUTE format('CREATE TRIGGER experience_data_truncate BEFORE TRUNCATE ON %I FOR EACH STATEMENT EXECUTE FUNCTION experience_data_truncate()',
                               part.parent || '_r' || run);
            END IF;
            IF part.parent = 'experience_state' THEN
                EXECUTE format('CREATE TRIGGER experience_keys AFTER INSERT ON %I REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_keys()',
                               part.parent || '_r' || run);
            END IF;
        END IF;
    END LOOP;
    PERFORM set_config('lock_timeout', waited, true);
END $$;
COMMENT ON FUNCTION experience_partitions_add(bigint) IS
  'Create the run''s partitions of experience_data, experience_state and batch_items (if '
  'missing), and their triggers.';

CREATE FUNCTION runs_add_partitions() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM experience_partitions_add(NEW.id);
    RETURN NEW;
END $$;

CREATE TRIGGER runs_add_partitions AFTER INSERT ON runs
    FOR EACH ROW EXECUTE FUNCTION runs_add_partitions();

-- The keys between runs, data rows and state rows, a statement at a time.
CREATE FUNCTION experience_keys() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
    missing bigint;
    locking boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    FOR run IN SELECT DISTINCT a.run_id FROM added a LOOP
        IF TG_TABLE_NAME LIKE 'experience_data%' THEN
            PERFORM FROM runs r WHERE r.id = run FOR KEY SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'experience_data: run % is not in runs', run
                    USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'experience_data_run';
            END IF;
            CONTINUE;
        END IF;
        EXECUTE format('SELECT a.id FROM added a WHERE a.run_id = $1 AND NOT EXISTS '
                       '(SELECT FROM %I d WHERE d.run_id = $1 AND d.id = a.id) LIMIT 1',
                       'experience_data_r' || run) INTO missing USING run;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'experience_state: experience % of run % is not in experience_data',
                missing, run
                USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'experience_state_data';
        END IF;
        IF locking THEN
            EXECUTE format('SELECT FROM %I d WHERE d.run_id = $1 AND d.id IN (SELECT id '
                           'FROM added WHERE run_id = $1) FOR KEY SHARE',
                           'experience_data_r' || run) USING run;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_keys() IS
  'An experience''s keys: every data row a statement wrote names a run, every state row its '
  'data row.';

CREATE FUNCTION experience_state_unlink() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    FOR run IN SELECT DISTINCT r.run_id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'experience_state_r' || run)) IS NULL;
        EXECUTE format('LOCK TABLE %I IN SHARE ROW EXCLUSIVE MODE', 'experience_state_r' || run);
        EXECUTE format('DELETE FROM %I s USING removed r WHERE r.run_id = $1 AND s.id = r.id',
                       'experience_state_r' || run) USING run;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_state_unlink() IS
  'The state rows of deleted data rows go with them.';

CREATE FUNCTION experiences_unlink() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    FOR run IN SELECT r.id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'experience_data_r' || run)) IS NULL;
        EXECUTE format('DELETE FROM %I', 'experience_data_r' || run);
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experiences_unlink() IS
  'The experiences of deleted runs go with them.';

CREATE FUNCTION experience_data_truncate() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    state text := replace(TG_TABLE_NAME, 'experience_data', 'experience_state');
    held boolean;
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT FROM %I)', state) INTO held;
    IF held THEN
        RAISE EXCEPTION '%: TRUNCATE would leave the rows of % without their data rows; DELETE '
            'the rows (their state rows go with them) or drop the run''s partitions', TG_TABLE_NAME,
            state USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_data_truncate() IS
  'A data table is truncated only when its state rows are gone.';

CREATE FUNCTION experience_groups_add() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO experience_groups (group_id, run_id)
    SELECT group_id, run_id FROM added WHERE group_row = 0;
    RETURN NULL;
END $$;

CREATE TRIGGER experience_keys AFTER INSERT ON experience_data
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_keys();
CREATE TRIGGER experience_keys AFTER INSERT ON experience_state
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_keys();
CREATE TRIGGER experience_state_unlink AFTER DELETE ON experience_data
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION experience_state_unlink();
CREATE TRIGGER experiences_unlink AFTER DELETE ON runs
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION experiences_unlink();
CREATE TRIGGER experience_data_truncate BEFORE TRUNCATE ON experience_data
    FOR EACH STATEMENT EXECUTE FUNCTION experience_data_truncate();
CREATE TRIGGER experience_groups_add AFTER INSERT ON experience_data
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_groups_add();

-- A row of another table that names an experience but not its run gets the run filled in.
CREATE FUNCTION experience_run_fill() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    SELECT run_id INTO NEW.run_id FROM experience_state WHERE id = NEW.experience_id;
    RETURN NEW;
END $$;

-- The view: an experience's columns in one row, as the table was before it was split.
CREATE VIEW experiences AS
SELECT s.id, s.run_id, d.task_id, d.group_id, d.group_row, s.policy_version, d.prompt_text,
       d.response_text, d.prompt_ids, d.response_ids, d.logprobs, d.action_mask, d.reward,
       d.shaped_reward, d.reward_components, d.metadata, s.status, s.priority, s.times_sampled,
       s.lease_token, s.leased_until, d.parent_id, d.prompt_len, d.response_len, s.created_at,
       d.parent_run_id
FROM experience_state s LEFT JOIN experience_data d ON d.run_id = s.run_id AND d.id = s.id;
COMMENT ON VIEW experiences IS
  'Every experience: its data (experience_data) and state (experience_state) under one name.';
ALTER VIEW experiences ALTER COLUMN id SET DEFAULT nextval('experience_data_id_seq');
ALTER VIEW experiences ALTER COLUMN status SET DEFAULT 'ready';
ALTER VIEW experiences ALTER COLUMN priority SET DEFAULT 0;
ALTER VIEW experiences ALTER COLUMN times_sampled SET DEFAULT 0;
ALTER VIEW experiences ALTER COLUMN reward_components SET DEFAULT '{}'::jsonb;
ALTER VIEW experiences ALTER COLUMN metadata SET DEFAULT '{}'::jsonb;
ALTER VIEW experiences ALTER COLUMN created_at SET DEFAULT now();

-- An update that changes a row's state applies only if the state is still what the statement
-- read (else SQLSTATE 40001): a pipeline's update never overwrites a lease taken meanwhile.
CREATE FUNCTION experiences_insert() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.parent_id IS NOT NULL AND NEW.parent_run_id IS NULL THEN
        SELECT run_id INTO NEW.parent_run_id FROM experience_state WHERE id = NEW.parent_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experiences: parent_id % is no experience', NEW.parent_id
                USING ERRCODE = 'foreign_key_violation';
        END IF;
    END IF;
    INSERT INTO experience_data (id, run_id, task_id, prompt_text, response_text, prompt_ids, response_ids, logprobs, action_mask, reward, shaped_reward, reward_components, metadata, parent_id, parent_run_id, group_id, group_row) VALUES (NEW.id, NEW.run_id, NEW.task_id, NEW.prompt_text, NEW.response_text, NEW.prompt_ids, NEW.response_ids, NEW.logprobs, NEW.action_mask, NEW.reward, NEW.shaped_reward, NEW.reward_components, NEW.metadata, NEW.parent_id, NEW.parent_run_id, NEW.group_id, NEW.group_row)
    RETURNING prompt_len, response_len INTO NEW.prompt_len, NEW.response_len;
    INSERT INTO experience_state (id, run_id, policy_version, status, priority, times_sampled, lease_token, leased_until, created_at) VALUES (NEW.id, NEW.run_id, NEW.policy_version, NEW.status, NEW.priority, NEW.times_sampled, NEW.lease_token, NEW.leased_until, NEW.created_at);
    RETURN NEW;
END $$;

CREATE FUNCTION experiences_update() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id IS DISTINCT FROM OLD.id OR NEW.run_id IS DISTINCT FROM OLD.run_id THEN
        RAISE EXCEPTION 'experiences: an experience keeps its id and run'
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.parent_id IS DISTINCT FROM OLD.parent_id
       AND NEW.parent_run_id IS NOT DISTINCT FROM OLD.parent_run_id THEN
        NEW.parent_run_id := NULL;
    END IF;
    IF NEW.parent_id IS NOT NULL AND NEW.parent_run_id IS NULL THEN
        SELECT run_id INTO NEW.parent_run_id FROM experience_state WHERE id = NEW.parent_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experiences: parent_id % is no experience', NEW.parent_id
                USING ERRCODE = 'foreign_key_violation';
        END IF;
    END IF;
    IF (NEW.policy_version, NEW.status, NEW.priority, NEW.times_sampled, NEW.lease_token, NEW.leased_until, NEW.created_at) IS DISTINCT FROM (OLD.policy_version, OLD.status, OLD.priority, OLD.times_sampled, OLD.lease_token, OLD.leased_until, OLD.created_at) THEN
        UPDATE experience_state s SET (policy_version, status, priority, times_sampled, lease_token, leased_until, created_at) = (NEW.policy_version, NEW.status, NEW.priority, NEW.times_sampled, NEW.lease_token, NEW.leased_until, NEW.created_at)
        WHERE s.run_id = OLD.run_id AND s.id = OLD.id AND (s.policy_version, s.status, s.priority, s.times_sampled, s.lease_token, s.leased_until, s.created_at) IS NOT DISTINCT FROM (OLD.policy_version, OLD.status, OLD.priority, OLD.times_sampled, OLD.lease_token, OLD.leased_until, OLD.created_at);
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experience % changed while this statement updated it', OLD.id
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    IF (NEW.task_id, NEW.prompt_text, NEW.response_text, NEW.prompt_ids, NEW.response_ids, NEW.logprobs, NEW.action_mask, NEW.reward, NEW.shaped_reward, NEW.reward_components, NEW.metadata, NEW.parent_id, NEW.parent_run_id, NEW.group_id, NEW.group_row) IS DISTINCT FROM (OLD.task_id, OLD.prompt_text, OLD.response_text, OLD.prompt_ids, OLD.response_ids, OLD.logprobs, OLD.action_mask, OLD.reward, OLD.shaped_reward, OLD.reward_components, OLD.metadata, OLD.parent_id, OLD.parent_run_id, OLD.group_id, OLD.group_row) THEN
        UPDATE experience_data SET (task_id, prompt_text, response_text, prompt_ids, response_ids, logprobs, action_mask, reward, shaped_reward, reward_components, metadata, parent_id, parent_run_id, group_id, group_row) = (NEW.task_id, NEW.prompt_text, NEW.response_text, NEW.prompt_ids, NEW.response_ids, NEW.logprobs, NEW.action_mask, NEW.reward, NEW.shaped_reward, NEW.reward_components, NEW.metadata, NEW.parent_id, NEW.parent_run_id, NEW.group_id, NEW.group_row)
        WHERE run_id = OLD.run_id AND id = OLD.id RETURNING prompt_len, response_len
        INTO NEW.prompt_len, NEW.response_len;
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION experiences_delete() RETURNS trigger
    LANGUAGE plpgsql AS $$
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


-- ============================================================================================
-- The ledger: each train step, the experiences it trained on (batch_items, partitioned by the
-- experience's run) and the policy versions published. A step commit is one statement that
-- consumes its whole lease or nothing (lease_consumed). The ledger's keys are statement
-- triggers, as the experiences' are.
-- ============================================================================================

CREATE TABLE train_steps (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    step integer NOT NULL,
    policy_version integer NOT NULL,                -- the trainer's version
    loss double precision,
    metrics jsonb NOT NULL DEFAULT '{}'::jsonb,
    n_experiences integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    stage text,                                     -- the run's stage the step belongs to
    CONSTRAINT train_steps_run_step UNIQUE (run_id, step)
);

CREATE TABLE batch_items (
    train_step_id bigint NOT NULL,
    experience_id bigint NOT NULL,
    policy_version integer NOT NULL,
    weight double precision NOT NULL DEFAULT 1,
    run_id bigint NOT NULL,
    PRIMARY KEY (train_step_id, experience_id, run_id)
) PARTITION BY LIST (run_id);
CREATE INDEX batch_items_experience ON batch_items (experience_id);

CREATE TABLE policy_versions (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    version integer NOT NULL,
    location text,                                  -- where its weights are
    train_step integer,                             -- the last step it holds
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT policy_versions_run_version UNIQUE (run_id, version)
);

CREATE FUNCTION batch_items_keys() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
    missing bigint;
    locking boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    SELECT a.train_step_id INTO missing FROM (SELECT DISTINCT train_step_id FROM added) a
    WHERE NOT EXISTS (SELECT FROM train_steps t WHERE t.id = a.train_step_id) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'batch_items: train step % is not in train_steps', missing
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'batch_items_train_step';
    END IF;
    IF locking THEN
        PERFORM FROM train_steps t WHERE t.id IN (SELECT train_step_id FROM added)
        FOR KEY SHARE;
    END IF;
    FOR run IN SELECT DISTINCT a.run_id FROM added a LOOP
        EXECUTE format('SELECT a.experience_id FROM added a WHERE a.run_id = $1 AND NOT EXISTS '
                       '(SELECT FROM %I s WHERE s.run_id = $1 AND s.id = a.experience_id) '
                       'LIMIT 1', 'experience_state_r' || run) INTO missing USING run;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'batch_items: experience % of run % is not in experience_state',
                missing, run
                USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'batch_items_experience';
        END IF;
        IF locking THEN
            EXECUTE format('SELECT FROM %I s WHERE s.run_id = $1 AND s.id IN (SELECT '
                           'experience_id FROM added WHERE run_id = $1) FOR KEY SHARE',
                           'experience_state_r' || run) USING run;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION batch_items_keys() IS
  'The ledger''s keys: every batch_items row a statement wrote names a train step and an '
  'experience of its run.';

CREATE FUNCTION batch_items_unlink() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    IF TG_TABLE_NAME = 'train_steps' THEN
        LOCK TABLE batch_items IN SHARE ROW EXCLUSIVE MODE;
        DELETE FROM batch_items b USING removed r WHERE b.train_step_id = r.id;
        RETURN NULL;
    END IF;
    FOR run IN SELECT DISTINCT r.run_id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'batch_items_r' || run)) IS NULL;
        EXECUTE format('LOCK TABLE %I IN SHARE ROW EXCLUSIVE MODE', 'batch_items_r' || run);
        EXECUTE format('DELETE FROM %I b USING removed r WHERE r.run_id = $1 '
                       'AND b.experience_id = r.id', 'batch_items_r' || run) USING run;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION batch_items_unlink() IS
  'The ledger rows of deleted experiences or train steps go with them.';

CREATE FUNCTION ledger_ids_kept() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: an id the ledger names does not change (UPDATE of %)', TG_TABLE_NAME,
        TG_ARGV[0] USING ERRCODE = 'check_violation';
END $$;

CREATE FUNCTION lease_consumed(consumed bigint, leased bigint, token uuid) RETURNS bigint
    LANGUAGE plpgsql AS $$
BEGIN
    IF consumed <> leased THEN
        RAISE EXCEPTION 'lease % holds % of its % rows (it expired and was reclaimed)',
            token, consumed, leased USING ERRCODE = 'RS001';
    END IF;
    RETURN consumed;
END $$;
COMMENT ON FUNCTION lease_consumed(bigint, bigint, uuid) IS
  'A step commit''s check that it consumed all its lease''s rows: raises RS001 if not.';

CREATE TRIGGER batch_items_keys AFTER INSERT ON batch_items
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys();
CREATE TRIGGER batch_items_keys_update AFTER UPDATE ON batch_items
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys();
CREATE TRIGGER batch_items_unlink AFTER DELETE ON train_steps
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION batch_items_unlink();
CREATE TRIGGER batch_items_unlink AFTER DELETE ON experience_state
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION batch_items_unlink();
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id ON runs
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id');
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id ON train_steps
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id');
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON experience_data
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id, run_id');
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON experience_state
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id, run_id');


-- ============================================================================================
-- Pipelines: each execution (pipeline_runs, `abandoned` when its server session is gone),
-- each decision an operator made about a row (operator_events), great-expectations results
-- (validations), and cron schedules.
-- ============================================================================================

CREATE TABLE schedules (
    id bigserial PRIMARY KEY,
    name text NOT NULL UNIQUE,
    pipeline_file text NOT NULL,
    cron text NOT NULL,
    enabled boolean NOT NULL DEFAULT true,
    last_run_at timestamptz,
    next_run_at timestamptz NOT NULL,
    missed_runs integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE pipeline_runs (
    id bigserial PRIMARY KEY,
    pipeline text NOT NULL,
    source_file text,
    spec jsonb NOT NULL,
    spec_hash text NOT NULL,
    run_ids jsonb NOT NULL DEFAULT '[]'::jsonb,
    trigger text NOT NULL DEFAULT 'cli',
    status text NOT NULL DEFAULT 'running',
    rows_in integer,
    rows_out integer,
    rows_dropped integer,
    operators jsonb NOT NULL DEFAULT '[]'::jsonb,   -- per-operator counts
    duration_s double precision,
    error text,
    schedule_id bigint REFERENCES schedules (id) ON DELETE SET NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    backend_pid integer,                            -- the server session running it
    backend_started_at timestamptz,
    CONSTRAINT pipeline_runs_status_valid
        CHECK (status IN ('running', 'succeeded', 'failed', 'dry_run', 'abandoned'))
);
CREATE INDEX pipeline_runs_pipeline ON pipeline_runs (pipeline, started_at);
CREATE INDEX pipeline_runs_running ON pipeline_runs (id) WHERE status = 'running';
CREATE INDEX pipeline_runs_schedule_success ON pipeline_runs (schedule_id, finished_at)
    WHERE status = 'succeeded';

CREATE TABLE operator_events (
    id bigserial PRIMARY KEY,
    pipeline_run_id bigint NOT NULL REFERENCES pipeline_runs (id) ON DELETE CASCADE,
    experience_id bigint,
    task_id bigint REFERENCES tasks (id) ON DELETE CASCADE,
    operator text NOT NULL,
    kind text NOT NULL,
    reason text,
    stats jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    run_id bigint,                                  -- the experience's run
    CONSTRAINT operator_events_kind_valid CHECK (kind IN ('dropped', 'changed', 'added',
        'scored', 'quarantined', 'retired', 'held', 'unselected')),
    CONSTRAINT operator_events_experience_run CHECK ((experience_id IS NULL) = (run_id IS NULL)),
    CONSTRAINT operator_events_experience_id_fkey FOREIGN KEY (run_id, experience_id)
        REFERENCES experience_state (run_id, id) ON DELETE CASCADE
);
CREATE INDEX operator_events_run ON operator_events (pipeline_run_id);
CREATE INDEX operator_events_experience ON operator_events (experience_id);
CREATE TRIGGER operator_events_experience_run BEFORE INSERT ON operator_events FOR EACH ROW
    WHEN (NEW.run_id IS NULL AND NEW.experience_id IS NOT NULL)
    EXECUTE FUNCTION experience_run_fill();

CREATE TABLE validations (
    id bigserial PRIMARY KEY,
    pipeline_run_id bigint NOT NULL REFERENCES pipeline_runs (id) ON DELETE CASCADE,
    expectation text NOT NULL,
    kwargs jsonb NOT NULL DEFAULT '{}'::jsonb,
    success boolean NOT NULL,
    element_count integer,
    unexpected_count integer,
    sample jsonb NOT NULL DEFAULT '[]'::jsonb,
    on_failure text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX validations_run ON validations (pipeline_run_id);


-- ============================================================================================
-- People and agents: reviews of held rows and every action a person took (review_actions);
-- preference pairs, a leasable pool like experiences, and the pairs a step trained on
-- (batch_pairs); episodes of agents served by `reservoir serve` and their calls, which become
-- one group of experiences when the episode's reward is reported.
-- ============================================================================================

CREATE TABLE reviews (
    id bigserial PRIMARY KEY,
    experience_id bigint NOT NULL UNIQUE,
    pipeline_run_id bigint REFERENCES pipeline_runs (id) ON DELETE SET NULL,
    reason text,
    status text NOT NULL DEFAULT 'pending',
    verdict text,
    label jsonb NOT NULL DEFAULT '{}'::jsonb,
    reviewer text,
    created_at timestamptz NOT NULL DEFAULT now(),
    labelled_at timestamptz,
    run_id bigint NOT NULL,
    CONSTRAINT reviews_status_valid CHECK (status IN ('pending', 'labelled')),
    CONSTRAINT reviews_verdict_valid CHECK (verdict IS NULL OR verdict IN ('accept', 'reject')),
    CONSTRAINT reviews_experience_id_fkey FOREIGN KEY (run_id, experience_id)
        REFERENCES experience_state (run_id, id) ON DELETE CASCADE
);
CREATE TRIGGER reviews_experience_run BEFORE INSERT ON reviews FOR EACH ROW
    WHEN (NEW.run_id IS NULL AND NEW.experience_id IS NOT NULL)
    EXECUTE FUNCTION experience_run_fill();

CREATE TABLE preferences (
    id bigserial PRIMARY KEY,
    task_id bigint REFERENCES tasks (id) ON DELETE CASCADE,
    chosen_id bigint NOT NULL,
    rejected_id bigint NOT NULL,
    source text,
    created_at timestamptz NOT NULL DEFAULT now(),
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    margin double precision,
    status text NOT NULL DEFAULT 'ready',
    times_sampled integer NOT NULL DEFAULT 0,
    lease_token uuid,
    leased_until timestamptz,
    CONSTRAINT preferences_status_valid
        CHECK (status IN ('ready', 'leased', 'consumed', 'retired')),
    CONSTRAINT preferences_lease_iff_leased
        CHECK ((status = 'leased') = (lease_token IS NOT NULL)),
    CONSTRAINT preferences_two_responses CHECK (chosen_id <> rejected_id),
    CONSTRAINT preferences_pair UNIQUE (chosen_id, rejected_id),
    CONSTRAINT preferences_chosen_id_fkey FOREIGN KEY (run_id, chosen_id)
        REFERENCES experience_state (run_id, id) ON DELETE CASCADE,
    CONSTRAINT preferences_rejected_id_fkey FOREIGN KEY (run_id, rejected_id)
        REFERENCES experience_state (run_id, id) ON DELETE CASCADE
);
CREATE INDEX preferences_ready ON preferences (run_id, id) WHERE status = 'ready';
CREATE INDEX preferences_lease_token ON preferences (lease_token) WHERE lease_token IS NOT NULL;

CREATE TABLE batch_pairs (
    train_step_id bigint NOT NULL REFERENCES train_steps (id) ON DELETE CASCADE,
    preference_id bigint NOT NULL REFERENCES preferences (id) ON DELETE CASCADE,
    PRIMARY KEY (train_step_id, preference_id)
);
CREATE INDEX batch_pairs_preference ON batch_pairs (preference_id);

CREATE TABLE review_actions (
    id bigserial PRIMARY KEY,
    reviewer text NOT NULL,
    action text NOT NULL,
    source text NOT NULL,                           -- the review page or the CLI
    review_id bigint REFERENCES reviews (id) ON DELETE SET NULL,
    experience_id bigint,
    preference_id bigint REFERENCES preferences (id) ON DELETE SET NULL,
    detail jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    run_id bigint,
    CONSTRAINT review_actions_action_valid
        CHECK (action IN ('accept', 'reject', 'label', 'prefer')),
    CONSTRAINT review_actions_experience_run CHECK ((experience_id IS NULL) = (run_id IS NULL)),
    CONSTRAINT review_actions_experience_id_fkey FOREIGN KEY (run_id, experience_id)
        REFERENCES experience_state (run_id, id) ON DELETE SET NULL
);
CREATE INDEX review_actions_reviewer ON review_actions (reviewer, created_at);
CREATE TRIGGER review_actions_experience_run BEFORE INSERT ON review_actions FOR EACH ROW
    WHEN (NEW.run_id IS NULL AND NEW.experience_id IS NOT NULL)
    EXECUTE FUNCTION experience_run_fill();

CREATE TABLE episodes (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    key text NOT NULL,                              -- the client's id of the episode
    status text NOT NULL DEFAULT 'open',
    reward double precision,
    group_id uuid,                                  -- its experiences, once reported
    created_at timestamptz NOT NULL DEFAULT now(),
    reported_at timestamptz,
    secret_sha256 bytea,                            -- of the secret its first call returned
    CONSTRAINT episodes_status_valid CHECK (status IN ('open', 'reported')),
    CONSTRAINT episodes_reported_iff_time
        CHECK ((status = 'reported') = (reported_at IS NOT NULL)),
    CONSTRAINT episodes_run_key UNIQUE (run_id, key),
    CONSTRAINT episodes_secret_sha256_length CHECK (octet_length(secret_sha256) = 32)
);

CREATE TABLE episode_calls (
    id bigserial PRIMARY KEY,
    episode_id bigint NOT NULL REFERENCES episodes (id) ON DELETE CASCADE,
    call_id text NOT NULL,
    choice smallint NOT NULL,
    policy_version integer NOT NULL,
    temperature double precision NOT NULL,
    prompt_text text NOT NULL,
    response_text text NOT NULL,
    prompt_ids bytea NOT NULL,
    response_ids bytea NOT NULL,
    logprobs bytea NOT NULL,
    finish_reason text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT episode_calls_choice_valid CHECK (choice >= 0)
);
CREATE INDEX episode_calls_episode ON episode_calls (episode_id, id);


-- ============================================================================================
-- Archives: each archive a run was moved into; a restore writes only into the run it was
-- made from, with that very manifest.
-- ============================================================================================

CREATE TABLE run_archives (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    manifest_sha256 bytea NOT NULL CHECK (octet_length(manifest_sha256) = 32),
    experiences bigint NOT NULL CHECK (experiences >= 0),
    archived_at timestamptz NOT NULL DEFAULT now(),
    restored_at timestamptz,
    CONSTRAINT run_archives_manifest UNIQUE (run_id, manifest_sha256)
);
COMMENT ON TABLE run_archives IS
  'Each archive of a run (the SHA-256 of its manifest.json) and when it was restored.';

-- Experiment trackers that follow a run (TensorBoard, MLflow, W&B): their own run id and the
-- last step each logged.
CREATE TABLE run_trackers (
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    tracker text NOT NULL,
    destination text NOT NULL,
    external_id text,
    last_step integer NOT NULL DEFAULT -1,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, tracker, destination),
    CONSTRAINT run_trackers_tracker_valid CHECK (tracker IN ('tensorboard', 'mlflow', 'wandb'))
);
COMMENT ON TABLE run_trackers IS
  'Each experiment tracker following a run: its own run id and the last step it logged (a resumed run logs no step twice).';

-- Each explorer round, written with its groups: the rates trackers log per step.
CREATE TABLE explorer_rounds (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    worker text NOT NULL,
    policy_version integer NOT NULL,
    groups integer NOT NULL,
    experiences integer NOT NULL,
    response_tokens bigint NOT NULL,
    generate_s double precision NOT NULL,
    update_s double precision,                      -- the in-place update it waited for
    finished_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT explorer_rounds_counts_valid
        CHECK (groups > 0 AND experiences >= groups AND response_tokens >= 0),
    CONSTRAINT explorer_rounds_seconds_valid
        CHECK (generate_s >= 0 AND (update_s IS NULL OR update_s >= 0))
);
CREATE INDEX explorer_rounds_run ON explorer_rounds (run_id, finished_at);
COMMENT ON TABLE explorer_rounds IS
  'Each explorer round a run''s groups came from: worker, policy version, groups, experiences, response tokens, generation seconds and the in-place weight update it waited for.';

-- Where each run lives when store.urls names several servers (only the first one's rows count).
CREATE TABLE run_servers (
    run_name text PRIMARY KEY,
    server text NOT NULL,                           -- host:port/database, never a login
    demand double precision NOT NULL,
    placed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT run_servers_demand_valid CHECK (demand >= 0 AND demand < 'Infinity')
);
CREATE INDEX run_servers_server ON run_servers (server);
COMMENT ON TABLE run_servers IS
  'Which server each run lives on when store.urls names several (read on the first): host:port/database, the demand the run declared, when it was placed.';


-- ============================================================================================
-- Analytics: what people read (as reservoir_reader). Views run with their owner's rights, so
-- the reader needs no right on the tables. Naming: an entity's id is `<entity>_id`, its own
-- attributes have bare names, columns about another entity carry its name (`task_prompt`); a
-- policy version is `policy_version` for the one that generated an experience and
-- `<role>_version` otherwise; a train step is `step`. The columns are an interface
-- (tests/view_columns.json): a renamed column keeps its old name as an alias for a release.
-- ============================================================================================

CREATE SCHEMA analytics;

-- Decoders of the bytea columns.
CREATE FUNCTION analytics.uint32_at(b bytea, i integer) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT get_byte(b, 4 * i)::bigint
       + get_byte(b, 4 * i + 1)::bigint * 256
       + get_byte(b, 4 * i + 2)::bigint * 65536
       + get_byte(b, 4 * i + 3)::bigint * 16777216
$$;
COMMENT ON FUNCTION analytics.uint32_at(bytea, integer) IS
  'The i-th little-endian uint32 of a bytea (0-based).';

CREATE FUNCTION analytics.float32_from_bits(bits bigint) RETURNS real
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT CASE
    WHEN e = 255 AND m = 0 THEN (CASE WHEN s = 1 THEN '-Infinity' ELSE 'Infinity' END)::real
    WHEN e = 255 THEN 'NaN'::real
    WHEN e = 0 THEN ((1 - 2 * s)::float8 * m * (2.0::float8 ^ -149))::real
    ELSE ((1 - 2 * s)::float8 * (1 + m / 8388608.0::float8) * (2.0::float8 ^ (e - 127)))::real
  END
  FROM (SELECT (bits >> 31) & 1 AS s, (bits >> 23) & 255 AS e, bits & 8388607 AS m) AS parts
$$;
COMMENT ON FUNCTION analytics.float32_from_bits(bigint) IS
  'IEEE-754 binary32 value of a 32-bit pattern.';

CREATE FUNCTION analytics.int32s(b bytea) RETURNS integer[]
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(
           (u - CASE WHEN u >= 2147483648 THEN 4294967296 ELSE 0 END)::integer ORDER BY i),
         '{}')
  FROM generate_series(0, length(b) / 4 - 1) AS i,
       LATERAL analytics.uint32_at(b, i) AS u
$$;
COMMENT ON FUNCTION analytics.int32s(bytea) IS
  'Decode token ids (int32 little-endian bytea) to integer[].';

CREATE FUNCTION analytics.float32s(b bytea) RETURNS real[]
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(analytics.float32_from_bits(analytics.uint32_at(b, i)) ORDER BY i), '{}')
  FROM generate_series(0, length(b) / 4 - 1) AS i
$$;
COMMENT ON FUNCTION analytics.float32s(bytea) IS
  'Decode logprobs (float32 little-endian bytea) to real[].';

CREATE FUNCTION analytics.uint8s(b bytea) RETURNS smallint[]
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(get_byte(b, i)::smallint ORDER BY i), '{}')
  FROM generate_series(0, length(b) - 1) AS i
$$;
COMMENT ON FUNCTION analytics.uint8s(bytea) IS
  'Decode an action mask (one byte per response token).';


CREATE VIEW analytics.experiences AS
SELECT e.id AS experience_id, r.name AS run, e.task_id, e.group_id, e.group_row,
       e.policy_version, e.status, e.reward, e.shaped_reward, e.reward_components, e.priority,
       e.times_sampled, e.prompt_len, e.response_len, e.prompt_text AS prompt,
       e.response_text AS response, e.metadata, e.parent_id, e.leased_until,
       used.step AS last_step, e.created_at
FROM public.experiences e
JOIN public.runs r ON r.id = e.run_id
LEFT JOIN LATERAL (
  SELECT max(ts.step) AS step
  FROM public.batch_items bi JOIN public.train_steps ts ON ts.id = bi.train_step_id
  WHERE bi.experience_id = e.id
) used ON true;
COMMENT ON VIEW analytics.experiences IS
  'One row per experience: texts, reward as written and shaped, token lengths, status, the '
  'policy version that generated it, and the last train step that used it.';

CREATE VIEW analytics.experience_tokens AS
SELECT e.id AS experience_id, r.name AS run, analytics.int32s(e.prompt_ids) AS prompt_ids,
       analytics.int32s(e.response_ids) AS response_ids, analytics.float32s(e.logprobs) AS logprobs,
       analytics.uint8s(e.action_mask) AS action_mask
FROM public.experiences e JOIN public.runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.experience_tokens IS
  'Decoded token ids, logprobs and action mask of each experience (filter by experience_id: '
  'decoding is slow).';

CREATE VIEW analytics.run_steps AS
SELECT r.name AS run, ts.step, ts.stage, ts.policy_version AS trainer_version, ts.loss,
       ts.n_experiences,
       avg(e.reward) AS reward_mean, stddev_pop(e.reward) AS reward_std,
       min(e.reward) AS reward_min, max(e.reward) AS reward_max,
       avg(coalesce(e.shaped_reward, e.reward)) AS shaped_reward_mean,
       avg(e.response_len)::float8 AS response_len_mean,
       avg(ts.policy_version - e.policy_version)::float8 AS staleness_mean,
       max(ts.policy_version - e.policy_version) AS staleness_max,
       (ts.metrics ->> 'advantage/zero_variance_groups')::float8 AS zero_variance_share,
       (ts.metrics ->> 'eval/accuracy')::float8 AS eval_accuracy,
       ts.metrics, ts.created_at
FROM public.train_steps ts
JOIN public.runs r ON r.id = ts.run_id
LEFT JOIN public.batch_items bi ON bi.train_step_id = ts.id
LEFT JOIN public.experiences e ON e.id = bi.experience_id
GROUP BY r.name, ts.id;
COMMENT ON VIEW analytics.run_steps IS
  'Per run and train step (step 0 and evaluations included): its stage, the batch''s rewards, '
  'length and staleness, the share of groups with no reward variance, the loss, held-out '
  'accuracy where measured, all metrics.';

CREATE VIEW analytics.lineage AS
SELECT e.id AS experience_id, r.name AS run, e.task_id, t.prompt AS task_prompt,
       t.answer AS task_answer, e.group_id, e.policy_version, e.status, e.reward,
       e.shaped_reward, e.parent_id, ts.step, bi.policy_version AS trainer_version, bi.weight,
       ts.created_at AS trained_at, pv.version AS published_version,
       pv.location AS published_location
FROM public.experiences e
JOIN public.runs r ON r.id = e.run_id
LEFT JOIN public.tasks t ON t.id = e.task_id
LEFT JOIN public.batch_items bi ON bi.experience_id = e.id
LEFT JOIN public.train_steps ts ON ts.id = bi.train_step_id
LEFT JOIN LATERAL (
  SELECT p.version, p.location FROM public.policy_versions p
  WHERE p.run_id = ts.run_id AND p.train_step >= ts.step
  ORDER BY p.version LIMIT 1
) pv ON true;
COMMENT ON VIEW analytics.lineage IS
  'task -> experience -> train step -> first published policy version containing that step.';

CREATE VIEW analytics.runs AS
SELECT r.name AS run, r.status, r.model, r.group_size, c.raw, c.ready, c.leased, c.consumed,
       c.quarantined, c.retired, c.held, r.rows_inserted, r.rows_sampled,
       (SELECT max(step) FROM public.train_steps WHERE run_id = r.id) AS last_step,
       (SELECT max(version) FROM public.policy_versions WHERE run_id = r.id) AS latest_version,
       parent.name AS parent_run, r.parent_step,
       r.progress, r.config, r.created_at, r.updated_at
FROM public.runs r
LEFT JOIN public.runs parent ON parent.id = r.parent_run_id
LEFT JOIN LATERAL (
  SELECT count(*) FILTER (WHERE status = 'raw') AS raw,
         count(*) FILTER (WHERE status = 'ready') AS ready,
         count(*) FILTER (WHERE status = 'leased') AS leased,
         count(*) FILTER (WHERE status = 'consumed') AS consumed,
         count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
         count(*) FILTER (WHERE status = 'retired') AS retired,
         count(*) FILTER (WHERE status = 'held') AS held
  FROM public.experiences WHERE run_id = r.id
) c ON true;
COMMENT ON VIEW analytics.runs IS
  'One row per run: status, experiences per status, flow counters, the run it branched from, '
  'progress, config (passwords removed).';

CREATE VIEW analytics.tasks AS
SELECT t.id AS task_id, r.name AS run, t.split, t.prompt, t.answer, t.source, t.payload,
       t.difficulty, t.priority, t.times_explored, t.claimed_by, t.claimed_until, t.created_at,
       t.status, t.parent_id, t.metadata
FROM public.tasks t JOIN public.runs r ON r.id = t.run_id;
COMMENT ON VIEW analytics.tasks IS
  'One row per task: split, prompt and answer, difficulty and priority, times explored, claim, status and the task it was made from.';

CREATE VIEW analytics.policy_versions AS
SELECT r.name AS run, p.version AS policy_version, p.location, p.train_step AS step,
       p.created_at
FROM public.policy_versions p JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.policy_versions IS
  'Every published policy version: where its weights are and the train step it holds.';

CREATE VIEW analytics.pipeline_runs AS
SELECT p.id AS pipeline_run_id, p.pipeline, p.trigger, p.status, p.rows_in, p.rows_out,
       p.rows_dropped, p.duration_s, p.error, p.spec_hash, p.operators, s.name AS schedule,
       p.started_at, p.finished_at
FROM public.pipeline_runs p LEFT JOIN public.schedules s ON s.id = p.schedule_id;
COMMENT ON VIEW analytics.pipeline_runs IS
  'Every pipeline execution: status, rows in / out / dropped, per-operator counts, error.';

CREATE VIEW analytics.operator_events AS
SELECT o.id AS event_id, p.pipeline, o.pipeline_run_id, r.name AS run, o.experience_id,
       o.task_id, o.operator, o.kind, o.reason, o.stats, o.created_at
FROM public.operator_events o
JOIN public.pipeline_runs p ON p.id = o.pipeline_run_id
LEFT JOIN public.tasks t ON t.id = o.task_id AND o.experience_id IS NULL
LEFT JOIN public.runs r ON r.id = coalesce(o.run_id, t.run_id);
COMMENT ON VIEW analytics.operator_events IS
  'Every decision a pipeline stored about a row: which operator, what kind, why, its stats.';

CREATE VIEW analytics.validations AS
SELECT v.id AS validation_id, p.pipeline, v.pipeline_run_id, v.expectation, v.kwargs,
       v.success, v.element_count, v.unexpected_count, v.sample, v.on_failure, v.created_at
FROM public.validations v JOIN public.pipeline_runs p ON p.id = v.pipeline_run_id;
COMMENT ON VIEW analytics.validations IS 'Every great-expectations result of a pipeline run.';

CREATE VIEW analytics.reviews AS
SELECT v.id AS review_id, v.experience_id, r.name AS run, e.prompt_text AS prompt,
       e.response_text AS response, e.reward, e.shaped_reward, v.reason, v.status, v.verdict,
       v.label, v.reviewer, v.created_at, v.labelled_at
FROM public.reviews v JOIN public.experiences e ON e.id = v.experience_id
JOIN public.runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.reviews IS
  'Rows held for a person: the experience, why it was held, the verdict and who gave it.';

CREATE VIEW analytics.schedules AS
SELECT s.id AS schedule_id, s.name AS schedule, s.pipeline_file, s.cron, s.enabled,
       s.last_run_at, s.next_run_at, s.missed_runs, s.created_at
FROM public.schedules s;
COMMENT ON VIEW analytics.schedules IS 'Cron-scheduled pipelines: last and next run, missed runs.';

CREATE VIEW analytics.preferences AS
SELECT f.id AS preference_id, r.name AS run, f.task_id, f.status, f.margin, f.times_sampled,
       f.chosen_id AS chosen_experience_id, f.rejected_id AS rejected_experience_id,
       chosen.response_text AS chosen_response, rejected.response_text AS rejected_response,
       chosen.reward AS chosen_reward, rejected.reward AS rejected_reward,
       f.source, f.created_at
FROM public.preferences f
JOIN public.experiences chosen ON chosen.id = f.chosen_id
JOIN public.experiences rejected ON rejected.id = f.rejected_id
JOIN public.runs r ON r.id = f.run_id;
COMMENT ON VIEW analytics.preferences IS
  'Chosen / rejected response pairs (for DPO): the two experiences, their rewards and margin, '
  'where the pair came from, and its status in the run''s pool.';

CREATE VIEW analytics.episodes AS
SELECT p.key AS episode, r.name AS run, p.status, p.reward,
       CASE WHEN p.status = 'open'
            THEN (SELECT count(*) FROM public.episode_calls c WHERE c.episode_id = p.id)
            ELSE (SELECT count(*) FROM public.experiences e WHERE e.group_id = p.group_id)
       END AS responses,
       p.group_id, p.created_at, p.reported_at
FROM public.episodes p JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.episodes IS
  'Episodes of served agents: open (calls recorded, no reward yet) or reported (written as '
  'the experiences of group_id).';

CREATE VIEW analytics.episode_calls AS
SELECT p.key AS episode, r.name AS run, c.call_id, c.choice, c.policy_version, c.temperature,
       c.prompt_text AS prompt, c.response_text AS response, c.finish_reason,
       length(c.prompt_ids) / 4 AS prompt_len, length(c.response_ids) / 4 AS response_len,
       c.created_at
FROM public.episode_calls c
JOIN public.episodes p ON p.id = c.episode_id
JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.episode_calls IS
  'Responses of open episodes, awaiting their reward (reported ones are experiences).';

CREATE VIEW analytics.review_actions AS
SELECT a.id AS review_action_id, a.reviewer, a.action, a.source, a.review_id,
       a.experience_id, a.preference_id, a.detail, a.created_at
FROM public.review_actions a;
COMMENT ON VIEW analytics.review_actions IS
  'Every action of a person on a review or a pair: who, what, on which rows, when, from where.';

CREATE VIEW analytics.explorer_rounds AS
SELECT x.id AS explorer_round_id, r.name AS run, x.worker, x.policy_version, x.groups,
       x.experiences, x.response_tokens, x.generate_s, x.update_s, x.finished_at
FROM public.explorer_rounds x JOIN public.runs r ON r.id = x.run_id;
COMMENT ON VIEW analytics.explorer_rounds IS
  'Each explorer round: its run, worker, policy version, groups, experiences, response tokens, generation seconds and in-place update seconds.';

CREATE VIEW analytics.run_servers AS
SELECT run_name AS run, server, demand, placed_at FROM public.run_servers;
COMMENT ON VIEW analytics.run_servers IS
  'Which server each run lives on (store.urls; the first server''s rows are the ones read).';


CREATE VIEW analytics.run_gauges AS
SELECT r.name AS run, r.status, r.rows_inserted AS rows_written, r.rows_sampled,
       coalesce(rest.raw, 0) AS raw, coalesce(rest.ready, 0) AS ready,
       (SELECT count(*) FROM public.experience_state e
        WHERE e.run_id = r.id AND e.status = 'leased') AS leased,
       coalesce(rest.held, 0) AS held, coalesce(rest.quarantined, 0) AS quarantined,
       extract(epoch FROM now() - rest.oldest_ready_at)::float8 AS oldest_ready_age_s,
       extract(epoch FROM now() - rest.oldest_raw_at)::float8 AS oldest_raw_age_s,
       last.step AS last_step, extract(epoch FROM now() - last.created_at)::float8
         AS last_step_age_s,
       (last.metrics ->> 'staleness_mean')::float8 AS staleness_mean,
       (SELECT max(p.version) FROM public.policy_versions p WHERE p.run_id = r.id)
         AS latest_version,
       bounds.latency_bounds, latency.lease_bins AS lease_wait_bins,
       latency.lease_sum AS lease_wait_sum, latency.commit_bins, latency.commit_sum,
       r.updated_at
FROM public.runs r
CROSS JOIN (SELECT '{0.001,0.0025,0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60}'::float8[]
                   AS latency_bounds) bounds
LEFT JOIN LATERAL (
  SELECT count(*) FILTER (WHERE e.status = 'raw') AS raw,
         count(*) FILTER (WHERE e.status = 'ready') AS ready,
         count(*) FILTER (WHERE e.status = 'held') AS held,
         count(*) FILTER (WHERE e.status = 'quarantined') AS quarantined,
         min(e.created_at) FILTER (WHERE e.status = 'ready') AS oldest_ready_at,
         min(e.created_at) FILTER (WHERE e.status = 'raw') AS oldest_raw_at
  FROM public.experience_state e
  WHERE e.run_id = r.id AND e.status IN ('raw', 'ready', 'held', 'quarantined')
) rest ON true
LEFT JOIN LATERAL (
  SELECT ts.step, ts.created_at, ts.metrics FROM public.train_steps ts
  WHERE ts.run_id = r.id ORDER BY ts.step DESC LIMIT 1
) last ON true
LEFT JOIN LATERAL (
  SELECT jsonb_object_agg(bin, n) FILTER (WHERE key = 'wait_s') AS lease_bins,
         sum(total) FILTER (WHERE key = 'wait_s') AS lease_sum,
         jsonb_object_agg(bin, n) FILTER (WHERE key = 'commit_s') AS commit_bins,
         sum(total) FILTER (WHERE key = 'commit_s') AS commit_sum
  FROM (SELECT timed.key, width_bucket(timed.x, bounds.latency_bounds) AS bin, count(*) AS n,
               sum(timed.x) AS total
        FROM public.train_steps ts
        CROSS JOIN LATERAL (VALUES ('wait_s', (ts.metrics ->> 'wait_s')::float8),
                                   ('commit_s', (ts.metrics ->> 'commit_s')::float8))
          AS timed (key, x)
        WHERE ts.run_id = r.id AND timed.x IS NOT NULL
        GROUP BY 1, 2) binned
) latency ON true;
COMMENT ON VIEW analytics.run_gauges IS
  'Per run, what a metrics scrape reads cheaply: rows waiting by status and the oldest ready '
  'and raw row''s age, the flow counters, the last step and its staleness, the latest version, '
  'and the lease-wait and commit seconds of every step binned by latency_bounds '
  '(width_bucket: bin i holds latency_bounds[i] <= x < latency_bounds[i+1]).';

CREATE VIEW analytics.pipeline_gauges AS
WITH RECURSIVE names AS (
  (SELECT p.pipeline FROM public.pipeline_runs p ORDER BY p.pipeline LIMIT 1)
  UNION ALL
  SELECT (SELECT p.pipeline FROM public.pipeline_runs p WHERE p.pipeline > names.pipeline
          ORDER BY p.pipeline LIMIT 1)
  FROM names WHERE names.pipeline IS NOT NULL
)
SELECT names.pipeline, last.status AS last_status, last.trigger AS last_trigger,
       last.started_at AS last_started_at, last.finished_at AS last_finished_at,
       extract(epoch FROM now() - coalesce(last.finished_at, last.started_at))::float8
         AS last_run_age_s,
       success.finished_at AS last_success_at
FROM names
CROSS JOIN LATERAL (
  SELECT p.status, p.trigger, p.started_at, p.finished_at FROM public.pipeline_runs p
  WHERE p.pipeline = names.pipeline ORDER BY p.started_at DESC LIMIT 1
) last
LEFT JOIN LATERAL (
  SELECT p.finished_at FROM public.pipeline_runs p
  WHERE p.pipeline = names.pipeline AND p.status = 'succeeded'
  ORDER BY p.started_at DESC LIMIT 1
) success ON true
WHERE names.pipeline IS NOT NULL;
COMMENT ON VIEW analytics.pipeline_gauges IS
  'Per pipeline name, its last run (status, trigger, when, how long ago) and its last success.';

CREATE VIEW analytics.schedule_gauges AS
SELECT s.name AS schedule, s.pipeline_file, s.enabled, s.last_run_at, s.next_run_at,
       s.missed_runs,
       (SELECT max(p.finished_at) FROM public.pipeline_runs p
        WHERE p.schedule_id = s.id AND p.status = 'succeeded') AS last_success_at
FROM public.schedules s;
COMMENT ON VIEW analytics.schedule_gauges IS
  'Per schedule, its last run, next run, missed runs and last success.';

-- ============================================================================================
-- Grants: the reader sees the analytics schema and selects from its views; it has no right on
-- any table, function or sequence beyond what PUBLIC has. Everything else is the owner's.
-- ============================================================================================

GRANT USAGE ON SCHEMA analytics TO reservoir_reader;
GRANT SELECT ON analytics.experiences, analytics.experience_tokens, analytics.run_steps,
    analytics.lineage, analytics.runs, analytics.tasks, analytics.policy_versions,
    analytics.pipeline_runs, analytics.operator_events, analytics.validations,
    analytics.reviews, analytics.schedules, analytics.preferences, analytics.episodes,
    analytics.episode_calls, analytics.review_actions, analytics.run_gauges,
    analytics.pipeline_gauges, analytics.schedule_gauges, analytics.explorer_rounds,
    analytics.run_servers
    TO reservoir_reader;
