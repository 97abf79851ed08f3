"""run_servers: which PostgreSQL server each run's rows live on (store.urls)

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-07

With `store.urls` naming several servers, the first one's run_servers says where each run
lives: chosen when the run is created (the server with the least declared demand of the runs
placed on it, or the one `run.store` names) and read by every command that reaches the run.
A server is written as host:port/database, never with a login or password. Every server has
the table (one schema everywhere); only the first one's rows are read.
"""

from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

TABLE = """
CREATE TABLE run_servers (
    run_name text PRIMARY KEY,
    server text NOT NULL,
    demand double precision NOT NULL,
    placed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT run_servers_demand_valid CHECK (demand >= 0 AND demand < 'Infinity')
);
CREATE INDEX run_servers_server ON run_servers (server);
COMMENT ON TABLE run_servers IS
  'Which server each run lives on when store.urls names several (read on the first): host:port/database, the demand the run declared, when it was placed.';
"""

VIEW = """
CREATE VIEW analytics.run_servers AS
SELECT run_name AS run, server, demand, placed_at FROM public.run_servers;
COMMENT ON VIEW analytics.run_servers IS
  'Which server each run lives on (store.urls; the first server''s rows are the ones read).';
GRANT SELECT ON analytics.run_servers TO reservoir_reader;
"""


def upgrade() -> None:
    op.execute(TABLE)
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW analytics.run_servers")
    op.execute("DROP TABLE run_servers")
