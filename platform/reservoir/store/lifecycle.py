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

from sqlalchemy import (BigInteger, Connection, Float, Interval, LargeBinary, Text, bindparam, case,
                        cast, func, literal_column, null, select, update)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from reservoir.store import arrays, leasing
from reservoir.store.schema import experience_data as d
from reservoir.store.schema import experience_state as e
from reservoir.store.schema import experiences, runs


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
    return leasing.taken(e, *where)


def given_back(where):
    """Update: rows matching `where` leave their lease (never trained -> ready, else
    consumed); returns their run ids."""
    back = case((e.c.times_sampled == 0, "ready"), else_="consumed")
    return leasing.given_back(e, where, back).returning(e.c.run_id)


def retired(*where):
    """Update: rows matching `where` are retired; returns their ids."""
    return update(e).where(*where).values(status="retired").returning(e.c.id)


def set_aside(where):
    """Update: leased rows matching `where` leave their lease retired (dynamic sampling: a group
    whose rewards are all equal); returns their ids and runs."""
    return leasing.given_back(e, where, literal_column("'retired'")).returning(e.c.id, e.c.run_id)


# -- the ledger's: a step consumes its lease -----------------------------------------------

def consumed(*where):
    """Update: the lease's rows matching `where` become consumed; returns their ids and runs."""
    return leasing.consumed(e, *where).returning(e.c.id, e.c.run_id)


# -- a person's verdict --------------------------------------------------------------------

def settle_held(conn: Connection, experience_id: int, status: str) -> None:
    """A held row takes its reviewer's verdict (ready or quarantined)."""
    conn.execute(update(e).where(e.c.id == experience_id, e.c.status == "held")
                 .values(status=status))


# -- a pipeline's decisions ----------------------------------------------------------------

# What a pipeline may change of a row (a null keeps the row's own value).
CHANGEABLE = dict(status=Text, priority=Float, shaped_reward=Float, response_text=Text,
                  reward_components=Text, metadata=Text, response_ids=LargeBinary,
                  action_mask=LargeBinary)


def _pipeline_changes():
    """Update: each row of the unnested arrays (arrays.bound(id=..., status=..., ...)) changes
    its experience. A row whose response was re-encoded (new response_ids) takes the new action
    mask and loses its logprobs: they belonged to the old tokens."""
    x, v = experiences, arrays.unnested("v", id=BigInteger, **CHANGEABLE)
    kept = {name: func.coalesce(v.c[name], x.c[name])
            for name in ("status", "priority", "shaped_reward", "response_text", "response_ids")}
    re_encoded = v.c.response_ids.is_not(None)
    return update(x).where(x.c.id == v.c.id).values(
        **kept,
        reward_components=func.coalesce(cast(v.c.reward_components, JSONB),
                                        x.c.reward_components),
        metadata=func.coalesce(cast(v.c.metadata, JSONB), x.c.metadata),
        action_mask=case((re_encoded, v.c.action_mask), else_=x.c.action_mask),
        logprobs=case((re_encoded, null()), else_=x.c.logprobs))


PIPELINE_CHANGES = _pipeline_changes()


def _quarantine_partners():
    """Update: the rows of the groups in :groups (each broken for its reason in :reasons) that
    could still train and that the pipeline did not decide (:decided) are quarantined; returns
    each row's id, group and reason."""
    g = func.unnest(bindparam("groups", type_=ARRAY(UUID)),
                    bindparam("reasons", type_=ARRAY(Text))
                    ).table_valued("group_id", "reason").render_derived("g")
    return (update(e).where(
        d.c.group_id == g.c.group_id, e.c.run_id == d.c.run_id, e.c.id == d.c.id,
        e.c.status.in_([literal_column("'raw'"), literal_column("'ready'")]),
        e.c.id != func.all(bindparam("decided", type_=ARRAY(BigInteger))))
        .values(status=literal_column("'quarantined'"))
        .returning(e.c.id, d.c.group_id, g.c.reason))


QUARANTINE_PARTNERS = _quarantine_partners()


# -- retention -----------------------------------------------------------------------------

# Rows not yet trained of the runs that ended (status in :ended) older than :age retire.
RETIRE_AGED = (update(experiences).where(
    experiences.c.status.in_([literal_column("'ready'"), literal_column("'raw'")]),
    experiences.c.created_at < func.now() - bindparam("age", type_=Interval),
    experiences.c.run_id.in_(select(runs.c.id).where(
        runs.c.status == func.any(bindparam("ended", type_=ARRAY(Text)))))
).values(status="retired"))
