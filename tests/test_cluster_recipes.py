"""The launch recipes in examples/cluster, checked without a cluster: the Slurm script runs with
stand-ins for Slurm's and Ray's commands that record what they were asked, and the KubeRay
manifests are parsed, their run config by Reservoir's own parser."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from reservoir.config import parse_config

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "cluster"
NODES = ("gpu-node-1", "gpu-node-2", "gpu-node-3")
STAND_IN = """#!/bin/bash
line="$(basename "$0")"
for arg in "$@"; do line+=" $arg"; done
echo "$line RAY_ADDRESS=${RAY_ADDRESS:-}" >> "$CALLS"  # one write: background calls race
# as on a cluster: `ray status` answers once the head has started, and by the end of the
# script's `sleep 10` the workers have (their sruns run in the background)
started() { for _ in $(seq 200); do [ "$(grep -c "$1" "$CALLS")" -ge "$2" ] && return; \
            /bin/sleep 0.05; done; }
case "$(basename "$0") $*" in
  "scontrol show hostnames"*) printf '%s\\n' gpu-node-1 gpu-node-2 gpu-node-3 ;;
  srun*hostname*) echo "10.1.2.3 fe80::1" ;;
  "ray status"*) started "ray start --head" 1 ;;
  "sleep 10") started "ray start --block --address" 2 ;;
  "reservoir run"*) exit "${RESERVOIR_EXIT:-0}" ;;
esac
"""


def run_sbatch(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                  list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for command in ("scontrol", "srun", "ray", "reservoir", "sleep"):
        (bin_dir / command).write_text(STAND_IN)
        (bin_dir / command).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    done = subprocess.run(
        ["bash", str(RECIPES / "slurm.sbatch"), *args], capture_output=True, text=True,
        timeout=60, cwd=tmp_path,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
             "SLURM_JOB_NODELIST": "gpu-node-[1-3]", "SLURM_JOB_ID": "77",
             "SLURM_CPUS_PER_TASK": "16", "SLURM_GPUS_PER_NODE": "1", **env})
    return done, [line for line in calls.read_text().splitlines() if line]


def test_the_slurm_script_starts_a_head_a_worker_per_node_then_the_run(tmp_path):
    done, calls = run_sbatch(tmp_path, "run.yaml", "--resume",
                             RESERVOIR_DB_URL="postgresql://u@db:5432/r")
    assert done.returncode == 0, done.stderr
    starts = [call for call in calls if call.startswith("srun") and "ray start" in call]
    head, *workers = starts
    assert "-w gpu-node-1" in head and "--head" in head and "--port=6379" in head
    assert "--node-ip-address=10.1.2.3" in head and '{"trainer_node": 1}' in head
    assert sorted(call.split("-w ")[1].split()[0] for call in workers) == list(NODES[1:])
    for call in workers:
        assert "--address=10.1.2.3:6379" in call and '{"explorer_node": 1}' in call
        assert "--num-gpus=1" in call and "--num-cpus=16" in call and "--block" in call
    run = next(call for call in calls if call.startswith("reservoir run"))
    assert run == ("reservoir run run.yaml --resume --log-file reservoir-77.log "
                   "RAY_ADDRESS=10.1.2.3:6379")
    assert calls.index(run) > max(calls.index(call) for call in starts)


def test_the_slurm_script_needs_a_store_url_and_passes_the_run_s_exit_code_on(tmp_path):
    done, calls = run_sbatch(tmp_path, "run.yaml")
    assert done.returncode != 0 and "RESERVOIR_DB_URL" in done.stderr
    assert not any("ray start" in call for call in calls)  # nothing started without a store
    done, calls = run_sbatch(tmp_path, "run.yaml", RESERVOIR_DB_URL="postgresql://u@db/r",
                             RESERVOIR_EXIT="3")
    assert done.returncode == 3
    assert any(call.startswith("ray stop") for call in calls)  # the cluster stopped anyway


def test_the_kuberay_manifests_run_reservoir_on_a_ray_cluster_with_pinned_roles(monkeypatch):
    documents = {document["kind"]: document
                 for document in yaml.safe_load_all((RECIPES / "kuberay.yaml").read_text())}
    assert set(documents) >= {"RayCluster", "RayJob", "ConfigMap", "PersistentVolumeClaim"}
    cluster, job = documents["RayCluster"], documents["RayJob"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    command = job["spec"]["entrypoint"].split()
    assert command[:2] == ["reservoir", "run"]

    monkeypatch.setenv("RESERVOIR_DB_URL", "postgresql://reservoir@postgres:5432/reservoir")
    config_map = documents["ConfigMap"]
    mount = next(m for m in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                 ["volumeMounts"] if m["name"] == "run")
    file_name = command[2].removeprefix(mount["mountPath"] + "/")
    config = parse_config(yaml.safe_load(config_map["data"][file_name]))

    head = cluster["spec"]["headGroupSpec"]
    groups = cluster["spec"]["workerGroupSpecs"]
    offered = lambda spec: json.loads(json.loads(spec["rayStartParams"]["resources"]))  # noqa: E731
    assert offered(head) == config.trainer.resources
    assert all(offered(group) == config.explorer.resources for group in groups)
    assert sum(group["replicas"] for group in groups) * 1 >= config.explorer.workers

    claim = documents["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for spec in (head, *groups):
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        assert any(v["name"] == "RESERVOIR_DB_URL" and v["valueFrom"]["secretKeyRef"]
                   for v in container["env"])
        shared = next(m["mountPath"] for m in container["volumeMounts"]
                      if next(v for v in pod["volumes"] if v["name"] == m["name"]).get(
                          "persistentVolumeClaim", {}).get("claimName")
                      == claim["metadata"]["name"])
        for path in (config.trainer.checkpoint_dir, config.model.path):
            assert Path(path).is_relative_to(shared), path  # every pod sees them
