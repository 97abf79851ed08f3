"""What the trackers read from the store at each poll stays within their run's partitions, so
its cost does not grow with the other runs a store holds (on a store of 32 finished runs a
step's samples read every run's batch_items, ~0.5 s a read, before this)."""

from __future__ import annotations

from reservoir.store import ledger
from tests.factories import planned_relations


def test_a_step_s_samples_are_read_from_its_run_s_partitions_only(store):
    runs = [store.create_run(name, group_size=4) for name in ("first", "second", "third")]
    read = planned_relations(store.engine, ledger.samples_statement(runs[1], 1, 4), {})
    assert {name for name in read if name.startswith("batch_items")} == \
        {f"batch_items_r{runs[1]}"}, read
    assert {name for name in read if name.startswith("experience_data")} == \
        {f"experience_data_r{runs[1]}"}, read
