"""The one exception hierarchy of Reservoir.

Every error a user can cause names what was wrong (file, key, row, field, value), the rule it
broke and what happened as a consequence (for example: "nothing of this group was written").
"""


class ReservoirError(Exception):
    """Base class of every error Reservoir raises on purpose."""


class Abandoned(KeyboardInterrupt):
    """A second Ctrl-C: the work stops where it is, nothing more is written (no checkpoint of
    weights a step may have changed without committing)."""


class ConfigError(ReservoirError):
    """A config file or value is invalid; the message names the file and the key path."""


class StoreError(ReservoirError):
    """The experience store could not do what was asked (connection, schema, SQL)."""


class UserSQLError(StoreError):
    """The SQL text or its parameters were refused before or by the server; nothing changed."""


class SchemaOutOfDate(StoreError):
    """The database schema is behind the code: run `reservoir db upgrade`."""


class ExperienceInvalid(StoreError):
    """An experience failed validation before writing; its whole group was rejected."""

    def __init__(self, message: str, *, group_index: int, row_index: int | None, field: str):
        super().__init__(message)
        self.group_index = group_index
        self.row_index = row_index
        self.field = field


class LeaseLost(StoreError):
    """Leased rows expired and were reclaimed before the step committed; nothing was consumed."""


class ClaimLost(StoreError):
    """An explorer's claims on tasks expired and went to another worker before its groups were
    written; nothing of that write stayed."""


class FlowControlTimeout(StoreError):
    """A lease or a write waited longer than its timeout for the flow-control limits to allow it."""


class StepNotFinite(ReservoirError):
    """A train step's loss or gradients were not finite: the optimizer took no step, and
    nothing of the step is committed."""


class RankLost(ReservoirError):
    """A collective of the trainer pool failed: another rank ended or broke its connection."""


class WorkflowError(ReservoirError):
    """A workflow raised, or returned something that is not its task's group; the message
    names the workflow and the task."""


class RowUnknown(StoreError):
    """A row named by its id does not exist where it was looked for (another run's row, one
    already decided)."""


class EpisodeUnknown(StoreError):
    """A reward was reported for an episode the run has no calls of."""


class EpisodeForbidden(StoreError):
    """A call or a reward named a served episode without the secret its first call returned:
    it belongs to the client that opened it."""


class EpisodeClosed(StoreError):
    """A served episode's reward was reported already (or is being reported): it takes no
    more calls and no second reward."""
