"""The experience store: the hub every other part of Reservoir meets in.

Names are imported on first use, so a quick command that needs only `store.inspect` does not
pay for NumPy and SQLAlchemy."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AsyncStore": "reservoir.store.store", "Store": "reservoir.store.store",
    "Experience": "reservoir.store.records", "Lease": "reservoir.store.sampler",
    "LeasedExperience": "reservoir.store.sampler", "WriteResult": "reservoir.store.writer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'reservoir.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
