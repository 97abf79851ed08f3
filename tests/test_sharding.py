"""Sharded training (trainer.sharding: fsdp2): real spawned ranks, torch's fully_shard over
gloo. Each rank holds half the policy; two sharded ranks train the weights the unsharded pool
trains; a sharded checkpoint loads at another world size (2 -> 1, 1 -> 2) and unsharded; a
whole `reservoir train` run (sft, then grpo-kl against a sharded reference) ends where the
unsharded pool's run ends and exports as a model folder."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from reservoir.config import load_config, parse_config
from reservoir.errors import ConfigError
from reservoir.models import build_tiny_model, load_model
from reservoir.prepare import ensure_run
from reservoir.trainer.adapters import with_adapters
from reservoir.trainer.batch import make_batch
from reservoir.trainer.checkpoint import load_weights_of
from reservoir.trainer.learner import Learner
from reservoir.trainer.ranks import TrainerPool
from reservoir.trainer.sharding import is_sharded_checkpoint, local
from tests.test_recovery import offline_groups

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


def test_the_issues_config_validates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lora: {rank: 8}\n  sharding: fsdp2\n  workers: 2\n"
                    "  algorithm: {preset: ppo, epochs: 2, mini_batches: 4}\n")
    trainer = load_config(path).trainer
    assert (trainer.sharding, trainer.workers, trainer.lora.rank) == ("fsdp2", 2, 8)


@pytest.mark.parametrize("value", ["fsdp", "FSDP2", "1", "[fsdp2]", "null"])
def test_a_bad_sharding_is_one_line_naming_it(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"trainer:\n  sharding: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "\n" not in str(info.value)
    assert re.search(r"[:;] trainer\.sharding( \(line \d+\))?: ", str(info.value)), info.value


def sharded_config(tmp_path: Path, db_url: str, model: Path, *, workers=2, sharding="fsdp2",
                   lora=None, folder="ck", algorithm="grpo-kl", **trainer):
    trainer |= {"lora": lora} if lora else {}
    return parse_config({
        "run": {"name": "shards", "mode": "async", "seed": 3}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 20}, "explorer": {"n": 4},
        "trainer": {"batch_groups": 2, "micro_batch": 3, "lr": 1e-3, "workers": workers,
                    "sharding": sharding, "device": "cpu", "algorithm": algorithm,
                    "checkpoint_dir": str(tmp_path / folder), **trainer},
        "sampler": {"max_staleness": 100}, "store": {"url": db_url}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("shards") / "tiny", seed=11)


@pytest.fixture
def batches(store, tmp_path, db_url, tiny):
    ensure_run(store, sharded_config(tmp_path, db_url, tiny))
    store.write_groups(offline_groups("shards", 10))
    return [sorted(store.lease("shards", groups=2).rows, key=lambda row: row.id)
            for _ in range(5)]


def weights_of(checkpoint: Path, model_path: Path, lora=None) -> dict[str, torch.Tensor]:
    """A checkpoint's policy, read whole by this process alone."""
    model, _ = load_model(model_path)
    if lora:
        model = with_adapters(model, parse_config({"trainer": {"lora": lora}}).trainer.lora,
                              seed=0)
    load_weights_of(checkpoint, model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def pooled(config, checkpoint: Path, steps: list[tuple[int, list]], save_at: int | None = None):
    """A pool of `config` resumed from `checkpoint` trains `steps`; its last checkpoint (and
    the one after step `save_at`), each rank's share of the policy, the steps' metrics."""
    learner = Learner(config)
    pad = learner.tokenizer.pad_token_id
    saved = {}
    with TrainerPool(config, learner) as pool:
        pool.resume(checkpoint)
        held = sum(local(p).numel() for p in learner.model.parameters())
        metrics = []
        for step, rows in steps:
            metrics.append(pool.train(step, rows, make_batch(rows, pad)))
            if step == save_at:
                saved["at"] = pool.save(Path(config.trainer.checkpoint_dir), step, 0)
        saved["last"] = pool.save(Path(config.trainer.checkpoint_dir), steps[-1][0], 0)
    return saved, held, metrics


@pytest.mark.slow
@pytest.mark.parametrize("lora, algorithm", [
    (None, "grpo-kl"),                                    # a sharded frozen reference
    ({"rank": 4, "target_modules": ["q_proj", "up_proj"]}, "grpo-kl"),   # the base as one
    (None, {"preset": "ppo", "epochs": 2, "mini_batches": 2}),           # a critic, 4 updates
    (None, "dpo"),                                        # pairs, micro-batches of pairs
], ids=["full", "lora", "ppo-epochs", "dpo"])
def test_two_sharded_ranks_train_the_weights_the_unsharded_pool_trains(tmp_path, db_url, tiny,
                                                                        batches, lora,
                                                                        algorithm):
    start = Learner(sharded_config(tmp_path, db_url, tiny, workers=1, sharding="none",
                                   lora=lora, algorithm=algorithm))
    start.begin(start.plan[0])  # a stage's start: the checkpoint both pools resume
    checkpoint = start.save(tmp_path / "start", 0, 0)
    everything = sum(p.numel() for p in start.model.parameters())
    steps = list(enumerate(batches[:3], 1))
    sides = {}
    for sharding in ("none", "fsdp2"):
        config = sharded_config(tmp_path, db_url, tiny, sharding=sharding, lora=lora,
                                folder=sharding, algorithm=algorithm)
        sides[sharding] = pooled(config, checkpoint, steps)
    (plain, plain_held, plain_metrics), (shards, held, metrics) = sides["none"], sides["fsdp2"]
    assert is_sharded_checkpoint(shards["last"]) and not is_sharded_checkpoint(plain["last"])
    assert plain_held == everything and held <= 0.55 * everything  # rank 0's half
    one, two = weights_of(plain["last"], tiny, lora), weights_of(shards["last"], tiny, lora)
    moved = max(float((p - weights_of(checkpoint, tiny, lora)[n]).abs().max())
                for n, p in one.items())
    assert moved > 1e-4
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, atol=1e-5, rtol=0, msg=name)
    for a, b in zip(plain_metrics, metrics):
        assert a.keys() == b.keys()
        for name in a:
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-5), name


@pytest.mark.slow
def test_bf16_compute_and_gradient_checkpointing_keep_float32_shards(tmp_path, db_url, tiny,
                                                                    batches):
    """dtype bfloat16 (the layers gathered in bf16, gradients reduced in float32) with gradient
    checkpointing: float32 shards and optimizer state, and the steps' losses and gradient
    norms those of the unsharded pool in bf16 (bf16's own precision apart)."""
    extra = {"dtype": "bfloat16", "gradient_checkpointing": True}
    start = Learner(sharded_config(tmp_path, db_url, tiny, workers=1, sharding="none", **extra))
    start.begin(start.plan[0])
    checkpoint = start.save(tmp_path / "start", 0, 0)
    steps, sides = list(enumerate(batches[:2], 1)), {}
    for sharding in ("none", "fsdp2"):
        config = sharded_config(tmp_path, db_url, tiny, sharding=sharding, folder=sharding,
                                **extra)
        sides[sharding] = pooled(config, checkpoint, steps)
    saved, _, metrics = sides["fsdp2"]
    for a, b in zip(sides["none"][2], metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    weights = weights_of(saved["last"], tiny)
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(saved["last"] / "sharded").read_metadata().state_dict_metadata
    moments = [meta for name, meta in metadata.items() if name.endswith("exp_avg")]
    assert moments and all(meta.properties.dtype == torch.float32 for meta in moments)


@pytest.mark.slow
def test_a_sharded_checkpoint_loads_at_another_world_size(tmp_path, db_url, tiny, batches):
    """Two ranks (resuming an unsharded checkpoint) write a checkpoint one rank resumes, and
    one rank's a two-rank pool resumes: each ends with the weights of two ranks that were
    never stopped."""
    start = Learner(sharded_config(tmp_path, db_url, tiny, workers=1, sharding="none"))
    start.begin(start.plan[0])
    checkpoint = start.save(tmp_path / "straight", 0, 0)
    for folder in ("one", "two"):  # where each pool finds its stage's start (the reference)
        shutil.copytree(checkpoint, tmp_path / folder / checkpoint.name)
    steps = list(enumerate(batches, 1))
    two = sharded_config(tmp_path, db_url, tiny, folder="two")
    straight, _, _ = pooled(sharded_config(tmp_path, db_url, tiny, folder="straight"),
                            checkpoint, steps, save_at=2)
    one = sharded_config(tmp_path, db_url, tiny, workers=1, folder="one")
    from_two, held, _ = pooled(one, straight["at"], steps[2:], save_at=3)   # 2 -> 1
    assert held == sum(p.numel() for p in start.model.parameters())
    back, _, _ = pooled(two, from_two["at"], steps[3:])                      # 1 -> 2
    expected = weights_of(straight["last"], tiny)
    for found in (from_two["last"], back["last"]):
        for name, tensor in weights_of(found, tiny).items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_sharded_run_ends_where_the_unsharded_pools_run_ends(tmp_path, new_database,
                                                                template_db):
    """`reservoir train`: an sft warm-up, then grpo-kl against the stage's reference, with
    evaluations, checkpoints and published versions, at two ranks sharded and not; the same
    weights at the end (1e-5), the same published policy, and the sharded checkpoint exported
    gives the trainer's logits in transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from reservoir.export import export
    from tests.test_recovery import finish, offline_warm_up_run, start
    from tests.test_run import ledger

    model = build_tiny_model(tmp_path / "tiny", seed=4)
    runs = {}
    for sharding in ("none", "fsdp2"):
        db_url = new_database(template_db)
        path = offline_warm_up_run(tmp_path, sharding, db_url, model, 4, 4 * 2,
                                   checkpoint_dir=str(tmp_path / sharding), workers=2,
                                   sharding=sharding, algorithm="grpo-kl", lr=3e-4,
                                   warmup_lr=3e-4, steps=4)
        output = finish(start("train", str(path), cwd=tmp_path))
        assert ledger(db_url)["steps"] == list(range(9)), output
        runs[sharding] = load_config(path)
    last = {side: tmp_path / side / "offline" / "step-000008" for side in runs}
    assert is_sharded_checkpoint(last["fsdp2"]) and not is_sharded_checkpoint(last["none"])
    # the collectives sum in another order: Adam turns that float32 noise into weight
    # differences that grow with the learning rate (1.0e-5 after 9 steps at 1e-3, 1.9e-6 at 3e-4)
    expected = weights_of(last["none"], model)
    for name, tensor in weights_of(last["fsdp2"], model).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=name)
    published = {side: load_file(max((tmp_path / side / "offline" / "policy")
                                     .glob("v*.safetensors"))) for side in runs}
    assert published["fsdp2"].keys() == published["none"].keys()
    for name, tensor in published["none"].items():
        torch.testing.assert_close(published["fsdp2"][name], tensor, atol=1e-5, rtol=0)
    folder = export(runs["fsdp2"], last["fsdp2"], tmp_path / "exported")
    ids = torch.tensor([[5, 17, 40, 33, 8, 21]])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        reference = AutoModelForCausalLM.from_pretrained(last["none"]).eval()(ids).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
