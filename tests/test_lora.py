"""LoRA adapters (trainer.lora), PPO epochs in the config: what trains, the reference, what a
checkpoint and a published version hold, branches and resumes of adapter runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from reservoir.config import load_config, parse_config
from reservoir.errors import ConfigError
from reservoir.models import build_tiny_model, load_model, load_weights
from reservoir.prepare import ensure_run
from reservoir.trainer.batch import make_batch, token_logprobs
from reservoir.trainer.learner import Learner
from tests.test_recovery import offline_groups

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", seed=5)


RANK_8 = {"rank": 8}


def lora_config(tmp_path: Path, db_url: str, model: Path, *, lora=RANK_8, algorithm="grpo-kl",
                **trainer):
    """A run's config; `lora=None`: full fine-tuning."""
    if lora is not None:
        trainer["lora"] = lora
    return parse_config({
        "run": {"name": "lora", "mode": "async", "seed": 3}, "model": {"path": str(model)},
        "tasks": {"generate": "reverse", "count": 20}, "explorer": {"n": 4},
        "trainer": {"batch_groups": 2, "micro_batch": 4, "lr": 1e-2, "device": "cpu",
                    "algorithm": algorithm, "checkpoint_dir": str(tmp_path / "ck"), **trainer},
        "sampler": {"max_staleness": 100}, "store": {"url": db_url}})


def test_the_issues_config_validates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lora: {rank: 8}\n  workers: 2\n"
                    "  algorithm: {preset: ppo, epochs: 2, mini_batches: 4}\n")
    trainer = load_config(path).trainer
    assert (trainer.lora.rank, trainer.lora.scale_alpha) == (8, 16.0)
    assert "down_proj" in trainer.lora.target_modules
    algorithm = trainer.algorithm.resolve()
    assert (algorithm.epochs, algorithm.mini_batches, algorithm.updates) == (2, 4, 8)


@pytest.mark.parametrize("body, key", [
    ("lora: {rank: 0}", "trainer.lora.rank"),
    ("lora: {rank: '8'}", "trainer.lora.rank"),
    ("lora: {rank: 8.5}", "trainer.lora.rank"),
    ("lora: {alpha: -1}", "trainer.lora.alpha"),
    ("lora: {alpha: .nan}", "trainer.lora.alpha"),
    ("lora: {dropout: 1}", "trainer.lora.dropout"),
    ("lora: {target_modules: []}", "trainer.lora.target_modules"),
    ("lora: {target_modules: ['q_proj; DROP']}", "trainer.lora.target_modules.0"),
    ("lora: {ranks: 8}", "trainer.lora.ranks"),
    ("lora: 8", "trainer.lora"),
    ("algorithm: {preset: ppo, epochs: 0}", "trainer.algorithm.epochs"),
    ("algorithm: {preset: ppo, epochs: 1001}", "trainer.algorithm.epochs"),
    ("algorithm: {preset: ppo, mini_batches: 0}", "trainer.algorithm.mini_batches"),
    ("algorithm: {preset: ppo, mini_batches: true}", "trainer.algorithm.mini_batches"),
    ("algorithm: {preset: ppo, old_logprobs: engine2}", "trainer.algorithm.old_logprobs"),
    ("algorithm: {preset: dpo, epochs: 2}", "trainer.algorithm"),
])
def test_each_bad_value_is_one_line_naming_its_key(tmp_path, body, key):
    path = tmp_path / "c.yaml"
    path.write_text(f"trainer:\n  {body}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert re.search(rf"[:;] {re.escape(key)}( \(line \d+\))?: ", message), message


def test_unknown_target_modules_are_one_line(tmp_path, db_url, tiny):
    config = lora_config(tmp_path, db_url, tiny, lora={"target_modules": ["nope_proj"]})
    with pytest.raises(ConfigError, match=r"^trainer.lora.target_modules: .*nope_proj"):
        Learner(config)


def begun(config) -> Learner:
    learner = Learner(config)
    learner.begin(learner.plan[0])
    return learner


@pytest.fixture
def rows(store, tmp_path, db_url, tiny):
    ensure_run(store, lora_config(tmp_path, db_url, tiny))
    store.write_groups(offline_groups("lora", 2))
    return sorted(store.lease("lora", groups=2).rows, key=lambda row: row.id)


def test_only_the_adapters_train_and_the_reference_is_the_base(tmp_path, db_url, tiny, rows):
    learner = begun(lora_config(tmp_path, db_url, tiny))
    trained = {name for name, p in learner.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    optimized = [p for group in learner.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(trained)
    base, _ = load_model(tiny)
    frozen = {name: p.detach().clone() for name, p in learner.model.named_parameters()
              if not p.requires_grad}
    batch = make_batch(rows, learner.tokenizer.pad_token_id)
    for step in (1, 2, 3):
        metrics = learner.train(step, batch)
    assert metrics["kl"] > 0  # the adapters moved the policy away from its base
    for name, p in learner.model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    from reservoir.trainer.adapters import running
    with torch.no_grad(), running(learner.reference) as reference:
        torch.testing.assert_close(token_logprobs(reference, batch), token_logprobs(base, batch),
                                   atol=1e-6, rtol=0)
    assert not any(isinstance(m, torch.nn.Module) and m is not learner.model
                   for m in vars(learner.reference).values())  # no second copy


def test_dpo_on_adapters_starts_at_log_2_against_the_base(tmp_path, db_url, tiny, rows):
    """A dpo stage on adapters: the reference is the base, so the first step's log-ratios are 0
    (B = 0) and its loss -log sigmoid(0); the steps after it move the adapters alone."""
    import math

    learner = begun(lora_config(tmp_path, db_url, tiny, algorithm="dpo"))
    batch = make_batch(rows, learner.tokenizer.pad_token_id)  # rows i and i + 4 are a pair
    first = learner.train(1, batch)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    later = [learner.train(step, batch)["loss"] for step in (2, 3)]
    assert later[-1] < first["loss"] - 1e-3


def test_a_published_version_is_the_merged_policy(tmp_path, db_url, tiny, rows):
    learner = begun(lora_config(tmp_path, db_url, tiny))
    batch = make_batch(rows, learner.tokenizer.pad_token_id)
    learner.train(1, batch)
    path = learner.publish(tmp_path / "v1.safetensors")
    engine_model, _ = load_model(tiny)
    load_weights(engine_model, path)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(engine_model, batch),
                                   token_logprobs(learner.model, batch), atol=1e-5, rtol=0)
    assert any(p.requires_grad for p in learner.model.parameters())  # the model is as it was


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path, db_url, tiny, rows):
    config = lora_config(tmp_path, db_url, tiny)
    learner = begun(config)
    pad = learner.tokenizer.pad_token_id
    batch = make_batch(rows, pad)
    learner.train(1, batch)
    folder = learner.save(tmp_path / "ck", 1, 0)
    adapters = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    files = {f.name: f.stat().st_size for f in folder.iterdir()}
    assert "model.safetensors" not in files
    # the adapters and AdamW's two moments of them, float32, and a few KB of RNG state and
    # configs (the size against a whole checkpoint is the example's, on a wider model)
    assert 3 * 4 * adapters < sum(files.values()) < 3 * 4 * adapters + 64_000, files
    after = learner.train(2, batch)

    resumed = Learner(config)
    resumed.load(folder)
    again = resumed.train(2, batch)
    assert again["loss"] == after["loss"]
    for (name, a), (_, b) in zip(learner.model.named_parameters(),
                                 resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_full_run_does_not_load_adapters_nor_a_lora_run_whole_weights(tmp_path, db_url,
                                                                         tiny, rows):
    lora = begun(lora_config(tmp_path, db_url, tiny))
    adapters = lora.save(tmp_path / "a", 1, 0)
    full = begun(lora_config(tmp_path, db_url, tiny, lora=None))
    whole = full.save(tmp_path / "w", 1, 0)
    with pytest.raises(ConfigError, match="holds LoRA adapters; this run trains every weight"):
        full.start_from(adapters)
    with pytest.raises(ConfigError, match="holds whole weights; this run trains adapters"):
        lora.start_from(whole)
    other = Learner(lora_config(tmp_path, db_url, tiny, lora={"rank": 4}))
    with pytest.raises(ConfigError, match=r"rank 8\) are not of trainer.lora's shape .*rank 4"):
        other.start_from(adapters)


@pytest.mark.slow
def test_a_lora_run_killed_mid_run_resumes_to_the_same_adapters(tmp_path, new_database,
                                                                template_db):
    """An sft warm-up and a grpo-kl stage, both on adapters, through `reservoir train`: killed
    in its second stage, the resumed run ends with the adapters of a run never killed, and
    published every version as merged weights an engine loads."""
    import signal

    from safetensors.torch import load_file

    from tests.test_recovery import finish, offline_warm_up_run, query, start, wait_for
    from tests.test_run import ledger

    model = build_tiny_model(tmp_path / "tiny", seed=4)
    paths = {}
    for side in ("straight", "killed"):
        db_url = new_database(template_db)
        paths[side] = (db_url, offline_warm_up_run(
            tmp_path, side, db_url, model, 6, 8 * 2, checkpoint_dir=str(tmp_path / side),
            checkpoint_interval=4, lora={"rank": 8}, algorithm="grpo-kl"))
    finish(start("train", str(paths["straight"][1]), cwd=tmp_path))
    db_url, config_path = paths["killed"]
    victim = start("train", str(config_path), cwd=tmp_path)
    wait_for(lambda: query(db_url, "SELECT 1 FROM train_steps WHERE step >= 9"))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    finish(start("train", str(config_path), "--resume", cwd=tmp_path))
    found = ledger(db_url)
    assert found["steps"] == list(range(6 + 8 + 1)) and found["status"] == "finished"
    adapters = [load_file(tmp_path / side / "offline" / "step-000014" / "adapter_model.safetensors")
                for side in ("straight", "killed")]
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(adapters[1][name], tensor, atol=1e-5, rtol=0, msg=name)
    published = sorted((tmp_path / "killed" / "offline" / "policy").glob("v*.safetensors"))
    engine_model, _ = load_model(model)
    load_weights(engine_model, published[-1])  # whole merged weights, as for a full run


def test_ppo_with_its_critic_epochs_and_mini_batches_trains_adapters(tmp_path, db_url, tiny,
                                                                     rows):
    config = lora_config(tmp_path, db_url, tiny,
                         algorithm={"preset": "ppo", "epochs": 2, "mini_batches": 4})
    learner = begun(config)
    metrics = learner.train(1, make_batch(rows, learner.tokenizer.pad_token_id))
    assert metrics["updates"] == 8 and "critic/loss" in metrics and "last/critic/loss" in metrics
    folder = learner.save(tmp_path / "ck", 1, 0)
    assert (folder / "critic.safetensors").is_file() and (folder / "adapter_model.safetensors"
                                                          ).is_file()


def test_a_step_of_ppo_epochs_resumes_exactly(tmp_path, db_url, tiny, rows):
    """A step of epochs x mini-batches replayed from the checkpoint before it: the same
    shuffles (the step's seed), the same weights, bit for bit (adapters and full)."""
    for lora in (RANK_8, None):
        config = lora_config(tmp_path, db_url, tiny, lora=lora,
                             algorithm={"preset": "ppo", "epochs": 2, "mini_batches": 2})
        straight = begun(config)
        batch = make_batch(rows, straight.tokenizer.pad_token_id)
        straight.train(1, batch)
        checkpoint = straight.save(tmp_path / f"ck-{lora is None}", 1, 0)
        expected = straight.train(2, batch)
        resumed = Learner(config)
        resumed.load(checkpoint)
        assert resumed.train(2, batch) == expected
        for (name, a), (_, b) in zip(straight.model.named_parameters(),
                                     resumed.model.named_parameters()):
            assert torch.equal(a, b), name


def test_the_examples_checkpoint_is_at_most_5_percent_of_a_full_one(tmp_path, rows):
    """examples/reverse_lora's adapters on its 512-wide model, after a step (AdamW's moments
    held): the checkpoint folder against a full one's weights and two moments."""
    from reservoir.models import TinySpec

    config = load_config(Path(__file__).parents[1] / "examples/reverse_lora/config.yaml")
    wide = build_tiny_model(tmp_path / "tiny-wide", spec=TinySpec(
        hidden_size=512, heads=8, intermediate_size=1536))
    config = config.model_copy(update={
        "model": config.model.model_copy(update={"path": wide}),
        "trainer": config.trainer.model_copy(update={"checkpoint_dir": tmp_path / "ck"})})
    learner = begun(config)
    learner.train(1, make_batch(rows, learner.tokenizer.pad_token_id))
    folder = learner.save(tmp_path / "ck", 1, 0)
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    full = 3 * (wide / "model.safetensors").stat().st_size
    assert size <= 0.05 * full, (size, full)
