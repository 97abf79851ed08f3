from tests.factories import fill


def test_write_lease_commit_roundtrip(store):
    store.create_run("r", group_size=4)
    fill(store, "r", 3)
    lease = store.lease("r", groups=2)
    assert len(lease.groups()) == 2 and len(lease.rows) == 8
    step_id = store.commit_step(lease, step=1, policy_version=0)
    assert step_id > 0
