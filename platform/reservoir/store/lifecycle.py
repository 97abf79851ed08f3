"""Every change of an experience's status, and only those: the lifecycle as code.

`TRANSITIONS` is the lifecycle (docs/reference/lifecycle.md is generated from it); each
statement below makes one of them, and no other module of the store writes
`experience_state.status` (tools/layout.py counts). The owners decide which rows and when (the
sampler picks a lease's rows, the ledger commits a step, a pipeline decides, a person
reviews, retention ages); the change itself is made here. A row's birth (the writer, a
pipeline's children) is not a change: it is written whole with its first status.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import (BigInteger, Connection, Float, Interval, LargeBinary, Text, bindparam,
                        case, func, text, update)
from sqlalchemy.dialects.postgresql import ARRAY, UUID

from reservoir.store.schema import experience_state as e


@dataclass(frozen=True)
class Transition:
    before: tuple[str, ...]
    after: tuple[str, ...]
    by: str        # the store call that makes it
    when: str


TRANSITIONS = (
    Transition(("raw", "ready", "quarantined"), ("ready", "quarantined", "retired", "held"),
               "store.pipelines.write_back", "an operator, a check or a filter decides; "
               "the rows of a group it broke that could still train are quarantined too"),
    Transition(("held",), ("ready", "quarantined"), "store.reviews.label",
               "a person accepts or rejects the row"),
    Transition(("ready", "consumed"), ("leased",), "store.lease",
               "a trainer leases whole groups (consumed rows while max_times_sampled allows)"),
    Transition(("leased",), ("ready", "consumed"), "store.release, expiry, release_runs",
               "the lease ends without a step: back to ready, or consumed if it trained before"),
    Transition(("leased",), ("consumed",), "store.commit_step",
               "the step, its batch_items and the change commit in one statement"),
    Transition(("leased",), ("retired",), "store.set_aside",
               "dynamic sampling sets aside a group whose rewards are all equal"),
    Transition(("ready", "consumed"), ("retired",), "store.retire",
               "on request (no worker calls it): rows older than max_staleness policy "
               "versions, which can no longer train"),
    Transition(("raw", "ready"), ("retired",), "apply_retention",
               "rows of a run that ended store.retention.retire_after_days ago"),
)


# -- the sampler's: lease, give back, retire, set aside ------------------------------------

def leased(*where):
    """Update: rows matching `where` become leased by :token until now() + :lease_for."""
    return update(e).where(*where).values(
        status="leased", lease_token=bindparam("token", type_=UUID(as_uuid=True)),
        leased_until=func.now() + bindparam("lease_for", type_=Interval))


def given_back(where):
    """Update: rows matching `where` leave their lease (never trained -> ready, else
    consumed); returns their run ids."""
    back = case((e.c.times_sampled == 0, "ready"), else_="consumed")
    return (update(e).where(where).values(status=back, lease_token=None, leased_until=None)
            .returning(e.c.run_id))


def retired(*where):
    """Update: rows matching `where` are retired; returns their ids."""
    return update(e).where(*where).values(status="retired").returning(e.c.id)


SET_ASIDE = text("""
WITH aside AS (
    UPDATE experience_state
    SET status = 'retired', lease_token = NULL, leased_until = NULL
    WHERE run_id = ANY(:run_ids) AND id = ANY(:ids) AND lease_token = :token
    RETURNING id, run_id
), noted AS (
    UPDATE experience_data d
    SET metadata = d.metadata || jsonb_build_object('set_aside', CAST(:reason AS text))
    FROM aside WHERE d.run_id = aside.run_id AND d.id = aside.id
    RETURNING d.id
), per_run AS (
    SELECT run_id, count(*) AS n FROM aside GROUP BY run_id
), counted AS (
    UPDATE runs SET rows_sampled = rows_sampled - per_run.n FROM per_run
    WHERE runs.id = per_run.run_id RETURNING runs.id
)
SELECT (SELECT count(*) FROM aside), (SELECT count(*) FROM noted), (SELECT count(*) FROM counted)
""").bindparams(bindparam("token", type_=UUID(as_uuid=True)),
                bindparam("ids", type_=ARRAY(BigInteger)))


# -- the ledger's: a step consumes its lease -----------------------------------------------

def consumed_cte(runs: str) -> str:
    """The `consumed` CTE of the ledger's commit statement: the lease's rows of the runs
    `runs` (their ids, written into the SQL) become consumed."""
    return f"""consumed AS (
    UPDATE experience_state
    SET status = 'consumed', times_sampled = times_sampled + 1,
        lease_token = NULL, leased_until = NULL
    WHERE run_id IN ({runs}) AND id = ANY(CAST(:ids AS bigint[])) AND lease_token = :token
    RETURNING id, run_id
)"""


# -- a person's verdict --------------------------------------------------------------------

def settle_held(conn: Connection, experience_id: int, status: str) -> None:
    """A held row takes its reviewer's verdict (ready or quarantined)."""
    conn.execute(update(e).where(e.c.id == experience_id, e.c.status == "held")
                 .values(status=status))


# -- a pipeline's decisions ----------------------------------------------------------------

PIPELINE_CHANGES = text("""
UPDATE experiences e SET
    status = coalesce(v.status, e.status),
    priority = coalesce(v.priority, e.priority),
    shaped_reward = coalesce(v.shaped_reward, e.shaped_reward),
    response_text = coalesce(v.response_text, e.response_text),
    reward_components = coalesce(v.reward_components::jsonb, e.reward_components),
    metadata = coalesce(v.metadata::jsonb, e.metadata),
    response_ids = coalesce(v.response_ids, e.response_ids),
    action_mask = CASE WHEN v.response_ids IS NULL THEN e.action_mask ELSE v.action_mask END,
    logprobs = CASE WHEN v.response_ids IS NULL THEN e.logprobs END
FROM unnest(:ids, :status, :priority, :shaped_reward, :response_text, :reward_components,
            :metadata, :response_ids, :action_mask)
    AS v (id, status, priority, shaped_reward, response_text, reward_components, metadata,
          response_ids, action_mask)
WHERE e.id = v.id
""").bindparams(
    bindparam("ids", type_=ARRAY(BigInteger)), bindparam("status", type_=ARRAY(Text)),
    bindparam("priority", type_=ARRAY(Float)), bindparam("shaped_reward", type_=ARRAY(Float)),
    bindparam("response_text", type_=ARRAY(Text)),
    bindparam("reward_components", type_=ARRAY(Text)), bindparam("metadata", type_=ARRAY(Text)),
    bindparam("response_ids", type_=ARRAY(LargeBinary)),
    bindparam("action_mask", type_=ARRAY(LargeBinary)))

QUARANTINE_PARTNERS = text("""
UPDATE experience_state e SET status = 'quarantined'
FROM unnest(:groups, :reasons) AS g (group_id, reason), experience_data d
WHERE d.group_id = g.group_id AND e.run_id = d.run_id AND e.id = d.id
  AND e.status IN ('raw', 'ready') AND e.id <> ALL(:decided)
RETURNING e.id, d.group_id, g.reason
""").bindparams(bindparam("groups", type_=ARRAY(UUID)), bindparam("reasons", type_=ARRAY(Text)),
                bindparam("decided", type_=ARRAY(BigInteger)))


# -- retention -----------------------------------------------------------------------------

RETIRE_AGED = text("""
UPDATE experiences SET status = 'retired'
WHERE status IN ('ready', 'raw') AND created_at < now() - make_interval(secs => :seconds)
  AND run_id IN (SELECT id FROM runs WHERE status = ANY(:ended))""")
