"""Responses a pipeline rewrote get new token ids from the tokenizer of their run's model.

The trainer learns from token ids, not text: a mapper that changes `response_text` (a
normaliser, a redactor) would otherwise leave ids that say something else. The new ids replace
the old, the action mask covers them all, and the logprobs go (they were the old tokens'); the
trainer treats a row without logprobs as on-policy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reservoir.errors import ReservoirError
from reservoir.store import MASK, TOKEN, Changes, Store, encode


def reencode(store: Store, changes: Changes, originals: dict[int, dict]) -> int:
    """Give every row (or augmented child) whose response_text changed new response_ids and
    an action mask over them all; returns how many."""
    rewritten = [(row_id, values) for row_id, values in changes.values.items()
                 if "response_text" in values]
    rewritten += [(child["parent"], child) for child in changes.children
                  if child["response_text"] != originals[child["parent"]]["response_text"]]
    if not rewritten:
        return 0
    models = store.pipelines.run_models({originals[row_id]["run_id"] for row_id, _ in rewritten})
    tokenizers = {run_id: _tokenizer(run_id, path) for run_id, path in models.items()}
    for row_id, values in rewritten:
        tokenizer = tokenizers[originals[row_id]["run_id"]]
        ids = np.asarray(tokenizer(values["response_text"], add_special_tokens=False)["input_ids"])
        values["response_ids"] = encode(ids, TOKEN)
        values["action_mask"] = encode(np.ones(len(ids)), MASK)
    return len(rewritten)


def _tokenizer(run_id: int, path: str | None):
    from transformers import AutoTokenizer

    if not path or not (Path(path) / "config.json").is_file():
        raise ReservoirError(
            f"the pipeline rewrote response_text of run id {run_id}, but the run's model folder "
            f"({path!r}, runs.model) is not here to re-encode it; nothing was changed")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
