"""group ids added once a statement, not once a group

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02

0015's row trigger ran a PL/pgSQL insert (and its key check) for every group's row 0: 4-6 us a
written row, ~6 % of a 512-row write. A statement trigger with a transition table adds every
group id a statement wrote in one insert. Statement triggers fire only on the table a statement
names, so there is one on `experience_state` (the `experiences` view, a COPY of several runs'
rows) and one on each run's state partition (the writer's COPY into it, a restore);
`experience_partitions_add` gives each new state partition its own. What 0015 holds stays: a
second group with a taken id fails its insert on experience_groups' primary key.
"""

import importlib

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_0014 = importlib.import_module("reservoir.migrations.versions.0014_keys_between_partitions")
_0015 = importlib.import_module("reservoir.migrations.versions.0015_group_ids_across_runs")

FUNCTION = """
CREATE FUNCTION experience_groups_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO experience_groups (group_id, run_id)
    SELECT group_id, run_id FROM added WHERE group_row = 0;
    RETURN NULL;
END $$;
"""
TRIGGER = ("CREATE TRIGGER experience_groups_add AFTER INSERT ON {table} REFERENCING NEW TABLE "
           "AS added FOR EACH STATEMENT EXECUTE FUNCTION experience_groups_add()")
# experience_partitions_add as 0014 made it, giving the state partition it creates its trigger.
_KEYED = """            END IF;
        END IF;
    END LOOP;"""
PARTITIONS = _0014.PARTITIONS.replace(_KEYED, """            END IF;
            IF part.parent = 'experience_state' THEN
                EXECUTE format('""" + TRIGGER.format(table="%I").replace("'", "''") + """',
                               part.parent || '_r' || run);
            END IF;
        END IF;
    END LOOP;""")
assert PARTITIONS != _0014.PARTITIONS, "0014's experience_partitions_add changed"


def _state_partitions() -> list[str]:
    """The state partitions there are (an archived run has none)."""
    return op.get_bind().exec_driver_sql(
        "SELECT inhrelid::regclass::text FROM pg_inherits "
        "WHERE inhparent = 'experience_state'::regclass ORDER BY 1").scalars().all()


def upgrade() -> None:
    op.execute("DROP TRIGGER experience_group_add ON experience_state; "
               "DROP FUNCTION experience_group_add();")
    op.execute(FUNCTION)
    op.execute(TRIGGER.format(table="experience_state"))
    for partition in _state_partitions():
        op.execute(TRIGGER.format(table=partition))
    op.execute(PARTITIONS)


def downgrade() -> None:
    op.execute(_0014.PARTITIONS)
    for partition in _state_partitions():
        op.execute(f"DROP TRIGGER experience_groups_add ON {partition}")
    op.execute("DROP TRIGGER experience_groups_add ON experience_state; "
               "DROP FUNCTION experience_groups_add();")
    op.execute(_0015.ROW_TRIGGER)
