"""Reservoir's RFT operators, registered with Data-Juicer's operator registry.

Importing this package registers them, so they work in a Reservoir pipeline and in a plain
Data-Juicer recipe alike (list `reservoir.operators` in the recipe's `custom_operator_paths`, or
import it before `load_ops`). Every operator reads the fields Reservoir gives a row: `id`,
`run_id`, `task_id`, `group_id`, `policy_version`, `prompt_text`, `response_text`, `reward`,
`reward_components` and `metadata` (JSON text), `priority`, `response_len`, `created_at`.
`reservoir pipeline ops` lists them with their arguments.
"""

from reservoir.operators import (groups, preferences, priority, review, rewards,  # noqa: F401
                                 store_ops)
