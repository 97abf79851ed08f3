"""A run on a Ray cluster of several nodes on this machine (Ray's own ray.cluster_utils.Cluster:
each node a raylet with its own resources and worker processes, one GCS): roles pinned to nodes
by `trainer.resources` / `explorer.resources`, and a node lost mid-run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from ray._private import ray_constants

from reservoir.models import build_tiny_model
from tests.commands import RESERVOIR, holding
from tests.test_recovery import finish, query, start, wait_for, write_config
from tests.test_run import ledger

pytestmark = [pytest.mark.slow, pytest.mark.process]
# The GCS takes a node for dead after 1 s without an answer to its health checks (Ray's
# default: 5 checks 3 s apart, after 5 s), so a lost node is noticed in seconds.
QUICK_NODE_DEATH = {"_system_config": {"health_check_initial_delay_ms": 0,
                                       "health_check_period_ms": 500,
                                       "health_check_failure_threshold": 2}}
HOLD_WRITES = 7_340_031  # the advisory lock key a test holds explorers' group writes on


@pytest.fixture
def cluster():
    """A head node offering `trainer_node` and three nodes offering `explorer_node` (1 each:
    two explorers go to two of them, the third is room for one started again)."""
    from ray.cluster_utils import Cluster

    ray_cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"trainer_node": 1}, **QUICK_NODE_DEATH})
    nodes = [ray_cluster.head_node] + [ray_cluster.add_node(
        num_cpus=1, resources={"explorer_node": 1}) for _ in range(3)]
    ray_cluster.wait_for_nodes()
    yield ray_cluster, nodes
    ray_cluster.shutdown()


def cluster_config(tmp_path, db_url, address: str, name: str, **explorer) -> dict:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    return {"run": {"name": name, "ray_address": address}, "model": {"path": str(model)},
            "tasks": {"generate": "reverse", "count": 200},
            "explorer": {"n": 4, "batch_tasks": 2, "max_tokens": 8, "workers": 2,
                         "claim_seconds": 3, "resources": {"explorer_node": 1}, **explorer},
            "trainer": {"steps": 6, "batch_groups": 2, "micro_batch": 8, "eval_interval": 100,
                        "resources": {"trainer_node": 1},
                        "checkpoint_dir": str(tmp_path / "checkpoints")},
            "store": {"url": db_url}}


def placements(output: str) -> list[tuple[str, str]]:
    """(worker, Ray node) in the order workers said where they run (`on Ray node ID ...`);
    an explorer started again says it again, with a new pid in its name."""
    return [(worker.split("@")[0], node) for worker, node in
            re.findall(r"\d\d:\d\d:\d\d (\S+): on Ray node ([0-9a-f]+) ", output)]


def nodes_of(output: str) -> dict[str, str]:
    """Each worker's Ray node, the first it said."""
    found: dict[str, str] = {}
    for worker, node in placements(output):
        found.setdefault(worker, node)
    return found


def node_of_actor(actor_class: str, nodes: list) -> int:
    """Which of `nodes` runs the Ray actor of `actor_class` (its worker's title, `ray::Class.method`,
    as Ray sets it): known at once, where a worker's `on Ray node` line reaches the driver's log
    when Ray's log monitor forwards it, seconds later under load."""
    pid = next(process.pid for process in psutil.process_iter(["cmdline"])
               if f"ray::{actor_class}" in " ".join(process.info["cmdline"] or ()))
    return node_of_process(pid, nodes)


def node_of_process(pid: int, nodes: list) -> int:
    """Which of `nodes` a worker process runs on: its parent is that node's raylet."""
    parent = psutil.Process(pid).ppid()
    return next(index for index, node in enumerate(nodes) if parent == node.all_processes[
        ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)


def assert_whole(db_url: str, steps: int) -> None:
    """Every step has its ledger, no row trained twice or left leased, no claim left."""
    found = ledger(db_url)
    assert found["steps"] == list(range(steps + 1)) and found["status"] == "finished", found
    assert (found["bad_steps"], found["trained_twice"], found["live_claims"]) == (0, 0, 0)
    assert query(db_url, "SELECT count(*) FROM experiences WHERE status = 'leased'")[0][0] == 0
    assert query(db_url, "SELECT count(*) FROM batch_items")[0][0] == query(
        db_url, "SELECT count(*) FROM experiences WHERE status = 'consumed'")[0][0]


def test_roles_run_where_their_resources_say_and_losing_an_explorer_node_loses_no_row(
        tmp_path, db_url, as_admin, cluster):
    """The trainer runs on the head (trainer_node), the two explorers on two other nodes
    (explorer_node), each as its first line says. Then the node of an explorer holding claims
    goes (its raylet and workers killed): Ray starts that explorer again on the node left free,
    its claims expire and are claimed again, and the run finishes whole.

    Claims live only while a round generates (~50 ms here), too short to catch by polling on a
    loaded machine: from step 2 on, a trigger holds each group's write (the update counting its
    tasks explored, in the write's transaction) on an advisory lock the test holds, so an
    explorer waits with its claims held until its node is gone."""
    ray_cluster, nodes = cluster
    raw = cluster_config(tmp_path, db_url, ray_cluster.address, "lose-a-node")
    raw["trainer"]["steps"] = 12
    config = write_config(tmp_path / "run.yaml", raw)
    condition = ("NEW.times_explored > OLD.times_explored AND (SELECT count(*) FROM "
                 "train_steps WHERE step > 0) >= 2")
    with holding(as_admin(db_url), HOLD_WRITES, before="UPDATE", table="tasks",
                 condition=condition) as waiting:
        run = start("run", str(config), cwd=tmp_path)

        def an_explorer_node_with_claims():
            if run.poll() is not None:
                raise AssertionError("the run ended before an explorer's write was held")
            claims = waiting() and query(db_url, "SELECT claimed_by FROM tasks WHERE "
                                                 "claim_token IS NOT NULL LIMIT 1")
            return claims and node_of_process(int(claims[0][0].rsplit(":", 1)[1]), nodes)

        try:
            lost = wait_for(an_explorer_node_with_claims, timeout=240)
        except AssertionError as timed_out:
            run.kill()
            raise AssertionError(f"{timed_out}; the run printed:\n{run.communicate()[0]}") \
                from None
        ray_cluster.remove_node(nodes[lost], allow_graceful=False)
    # the writes go on; the lost explorer's backend aborts its write
    output = finish(run, timeout=600)

    node_ids = [node.node_id for node in nodes]
    first = nodes_of(output)
    assert first["trainer"] == node_ids[0], output
    explorer_nodes = {first["explorer-0"], first["explorer-1"]}
    assert len(explorer_nodes) == 2 and node_ids[0] not in explorer_nodes, output
    assert node_ids[lost] in explorer_nodes
    spare = (set(node_ids[1:]) - explorer_nodes).pop()
    assert spare in {node for worker, node in placements(output) if worker != "trainer"}, output
    assert query(db_url, "SELECT max(step) FROM train_steps")[0][0] == 12
    assert_whole(db_url, 12)


@pytest.mark.timeout(600)
def test_losing_the_trainer_s_node_stops_the_run_and_resume_elsewhere_ends_as_uninterrupted(
        tmp_path, db_url, new_database, template_db):
    """The trainer's node goes mid-run: one line, the run is failed; `--resume` places the
    trainer on the other node offering `trainer_node` and ends with the weights of a run never
    interrupted (a supervised stage on the tasks' answers: its batches depend on the seed only).
    The head holds no role: removing it would take the cluster's GCS with it."""
    from ray.cluster_utils import Cluster

    from reservoir.models import load_model

    ray_cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                                **QUICK_NODE_DEATH})
    try:
        nodes = [ray_cluster.head_node,
                 ray_cluster.add_node(num_cpus=1, resources={"trainer_node": 1}),
                 ray_cluster.add_node(num_cpus=1, resources={"trainer_node": 1,
                                                             "explorer_node": 1})]
        ray_cluster.wait_for_nodes()
        raw = cluster_config(tmp_path, db_url, ray_cluster.address, "lose-the-trainer")
        raw["explorer"]["workers"] = 1
        # sft steps take ~0.1 s here: 60 leave the node's removal seconds to land mid-run
        raw["trainer"].update(checkpoint_interval=20, steps=60)
        raw["stages"] = [{"name": "sft", "algorithm": "sft", "steps": 60, "lr": 1e-3,
                          "batch": 8, "data": "tasks"}]
        config = write_config(tmp_path / "run.yaml", raw)
        log = tmp_path / "run.log"
        run = subprocess.Popen([str(RESERVOIR), "run", str(config)], cwd=tmp_path,
                               stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "COLUMNS": "200"})
        wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 6"),
                 timeout=240, every=0.05)
        trainer_node = node_of_actor("TrainerWorker", nodes)
        assert trainer_node in (1, 2)
        ray_cluster.remove_node(nodes[trainer_node], allow_graceful=False)
        run.wait(timeout=300)
        output = log.read_text()
        assert run.returncode == 1, output
        assert "the trainer's Ray actor is gone" in output and "--resume" in output, output
        assert ledger(db_url)["status"] == "failed"
        assert query(db_url, "SELECT max(step) FROM train_steps")[0][0] < 60
        if trainer_node == 2:  # a node like the lost one takes its place for the resume
            ray_cluster.add_node(num_cpus=1, resources={"trainer_node": 1, "explorer_node": 1})
            ray_cluster.wait_for_nodes()
        finish(start("run", str(config), "--resume", cwd=tmp_path), timeout=300)
        assert ledger(db_url)["status"] == "finished"
    finally:
        ray_cluster.shutdown()

    straight_url = new_database(template_db)  # the same run, never interrupted, on no cluster
    raw.update(store={"url": straight_url}, run={"name": "lose-the-trainer"})
    raw["trainer"]["checkpoint_dir"] = str(tmp_path / "straight")
    finish(start("train", str(write_config(tmp_path / "straight.yaml", raw)), cwd=tmp_path))
    weights = [load_model(Path(folder) / "lose-the-trainer" / "step-000060")[0].state_dict()
               for folder in (tmp_path / "checkpoints", tmp_path / "straight")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=1e-5, rtol=0, msg=name)
