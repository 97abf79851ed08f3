"""The binary layout of token ids, logprobs and action masks in the store.

| column        | layout                                  | SQL decoder            |
| ------------- | --------------------------------------- | ---------------------- |
| prompt_ids    | int32 little-endian, one per token      | analytics.int32s(b)    |
| response_ids  | int32 little-endian, one per token      | analytics.int32s(b)    |
| logprobs      | float32 little-endian, one per response | analytics.float32s(b)  |
|               | token                                   |                        |
| action_mask   | uint8 (0 or 1), one per response token  | analytics.uint8s(b)    |

`length(b) / 4` is a token count, which the experiences table keeps as generated columns.
"""

from __future__ import annotations

import numpy as np

TOKEN = np.dtype("<i4")
LOGPROB = np.dtype("<f4")
MASK = np.dtype("u1")


def encode(values: np.ndarray, dtype: np.dtype) -> bytes:
    if values.dtype == dtype:  # tobytes() copies in C order whatever the strides
        return values.tobytes()
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def decode(blob: bytes | None, dtype: np.dtype) -> np.ndarray | None:
    """A read-only array over the stored bytes (no copy); None stays None."""
    if blob is None:
        return None
    return np.frombuffer(blob, dtype=dtype)
