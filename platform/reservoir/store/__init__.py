"""The experience store: the hub every other part of Reservoir meets in."""

from reservoir.store.records import Experience
from reservoir.store.sampler import Lease, LeasedExperience
from reservoir.store.store import AsyncStore, Store
from reservoir.store.writer import WriteResult

__all__ = ["AsyncStore", "Experience", "Lease", "LeasedExperience", "Store", "WriteResult"]
