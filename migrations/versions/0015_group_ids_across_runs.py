"""one table of group ids, unique across runs, kept by the server

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

A group id names one group of one run: a lease of several runs groups its rows by group id, so
an id taken twice would merge two groups' advantages. Since 0013 the unique group index is per
run (each partition has its own), and the writer checked the other runs itself, probing the
group index of every run's partition: on a store of 200 runs that check took 29 ms of a 512-row
write (1.2 ms on a store of one), and two writers of two runs could still take one id at once.

`experience_groups (group_id PRIMARY KEY, run_id)` holds every group's id. A row trigger on
`experience_state` (cloned to each partition, the ones to come included) adds a group's id when
its row 0 is inserted, however it is inserted (the writer's COPY, the `experiences` view, a
pipeline's children, a restore), so a second group with that id fails its insert on the primary
key. The writer looks ids up in this one index. Archiving a run's partitions deletes its ids
(a restore adds them again); deleting the run deletes them.

Existing groups are added; an id two runs already share (only the writer's check stood between
them) stays with the earlier run, and the other run's group keeps its rows.
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


# The trigger that adds a group's id (replaced by a statement trigger in 0016).
ROW_TRIGGER = """
CREATE FUNCTION experience_group_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO experience_groups (group_id, run_id) VALUES (NEW.group_id, NEW.run_id);
    RETURN NULL;
END $$;
CREATE TRIGGER experience_group_add AFTER INSERT ON experience_state FOR EACH ROW
    WHEN (NEW.group_row = 0) EXECUTE FUNCTION experience_group_add();
"""


def upgrade() -> None:
    op.execute("""
        CREATE TABLE experience_groups (
            group_id uuid PRIMARY KEY,
            run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE
        );
        CREATE INDEX experience_groups_run ON experience_groups (run_id);
        INSERT INTO experience_groups (group_id, run_id)
        SELECT DISTINCT ON (group_id) group_id, run_id FROM experience_state
        WHERE group_row = 0 ORDER BY group_id, run_id;
        """ + ROW_TRIGGER + """
        COMMENT ON TABLE experience_groups IS
          'Every group id, with its run: a group id names one group of one run.';""")


def downgrade() -> None:
    op.execute("""
        DROP TRIGGER experience_group_add ON experience_state;
        DROP FUNCTION experience_group_add();
        DROP TABLE experience_groups;""")
