"""Devices and precision on the CPU: chunked logprobs, bf16 autocast, gradient checkpointing,
truncated importance sampling, RNG states in checkpoints, and the GPUs Ray actors declare.

CUDA-only lines (a cuda device, CUDA RNG states, NCCL) run in bench/gpu_check.py.
"""

import copy
import dataclasses

import pytest
import torch

from reservoir.config import parse_config
from reservoir.devices import gpus_wanted, resolve_device, rng_state, set_rng_state
from reservoir.errors import ConfigError
from reservoir.models import build_tiny_model, load_model
from reservoir.pool import gpu_shares
import reservoir.trainer.batch as batch_module
from reservoir.trainer.batch import TrainBatch, full_logprobs, token_logprobs
from reservoir.trainer.checkpoint import load_checkpoint, save_checkpoint
from reservoir.trainer.step import PRESETS, Precision, train_step

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = load_model(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0))
    return model


def synthetic_batch(vocab: int, rows: int = 8, width: int = 40, prompt: int = 12,
                    seed: int = 0) -> TrainBatch:
    """Groups of 4 with a spread of rewards; a ragged right padding; engine logprobs unset."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (rows, width), generator=generator)
    lengths = torch.randint(prompt + 4, width + 1, (rows,), generator=generator)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    mask = torch.zeros(rows, width - 1)
    for i, length in enumerate(lengths.tolist()):
        mask[i, prompt - 1:length - 1] = 1
    rewards = torch.rand(rows, generator=generator)
    return TrainBatch(ids * attention, attention, mask, torch.full_like(mask, float("nan")),
                      rewards, torch.arange(rows) // 4)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_log_softmax(tiny, chunk, temperature, monkeypatch):
    """Chunks (recomputed in the backward pass) as for logits past CHUNK_ABOVE_BYTES."""
    monkeypatch.setattr(batch_module, "CHUNK_ABOVE_BYTES", 0)
    batch = synthetic_batch(tiny.config.vocab_size)
    full_model, chunked_model = copy.deepcopy(tiny), copy.deepcopy(tiny)
    full = full_logprobs(full_model, batch, temperature)
    chunked = token_logprobs(chunked_model, batch, temperature, chunk=chunk)
    real = batch.attention_mask[:, 1:].bool()  # where the next token is the row's own
    torch.testing.assert_close(chunked[real], full[real], atol=1e-5, rtol=0)
    with torch.no_grad():
        again = token_logprobs(chunked_model, batch, temperature, chunk=chunk)
        torch.testing.assert_close(again[real], full.detach()[real], atol=1e-5, rtol=0)
    (full * batch.mask).sum().backward()
    (chunked * batch.mask).sum().backward()
    for (name, a), (_, b) in zip(full_model.named_parameters(), chunked_model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def step_once(model, batch, **options):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = train_step(model, optimizer, batch, options.pop("algorithm", PRESETS["grpo"]),
                         micro_batch=3, **options)
    return model, optimizer, metrics


def max_difference(a, b) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def test_bf16_computes_in_bf16_and_keeps_float32_weights_and_optimizer_state(tiny):
    batch = synthetic_batch(tiny.config.vocab_size)
    exact, _, exact_metrics = step_once(tiny, batch)
    mixed, optimizer, metrics = step_once(tiny, batch, precision=Precision(dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.dtype == torch.float32 for t in states)
    assert metrics["loss"] == pytest.approx(exact_metrics["loss"], abs=0.05)
    assert 0 < max_difference(mixed, exact) < 1e-2  # a bf16 step: near, not equal
    assert max_difference(mixed, tiny) > 1e-4


def test_gradient_checkpointing_gives_the_same_step(tiny):
    batch = synthetic_batch(tiny.config.vocab_size)
    plain, _, _ = step_once(tiny, batch)
    checkpointed = copy.deepcopy(tiny)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    stepped, _, _ = step_once(checkpointed, batch)
    assert max_difference(plain, stepped) < 1e-6


def test_truncated_importance_sampling_weights_each_token_by_the_capped_ratio(tiny):
    """The engine found every token 10x less likely than the trainer does: the weight
    min(p_train / p_engine, C) is C, so the gradient is C times the unweighted one."""
    batch = synthetic_batch(tiny.config.vocab_size)
    with torch.no_grad():
        current = token_logprobs(tiny, batch)
    engine = dataclasses.replace(batch, old_logprobs=current - torch.log(torch.tensor(10.0)))
    on_policy = dataclasses.replace(batch, old_logprobs=current)
    grads = {}
    for name, algorithm, rows in (("plain", PRESETS["grpo"], on_policy),
                                  ("tis", dataclasses.replace(PRESETS["grpo"], tis_cap=2.0),
                                   engine)):
        model = copy.deepcopy(tiny)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        metrics = train_step(model, optimizer, rows, algorithm, micro_batch=8,
                             max_grad_norm=None)
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert metrics["tis/truncated"] == pytest.approx(1.0)
    assert metrics["tis/weight_mean"] == pytest.approx(2.0)
    torch.testing.assert_close(grads["tis"], 2.0 * grads["plain"], atol=1e-6, rtol=1e-4)


def test_checkpoints_keep_the_generators_and_move_between_devices(tiny, tmp_path):
    model = copy.deepcopy(tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 4, 2, model, optimizer)
    expected = torch.rand(5)
    torch.manual_seed(99)
    resumed = load_checkpoint(path, model, optimizer)
    assert (resumed.step, resumed.version) == (4, 2)
    torch.testing.assert_close(torch.rand(5), expected, atol=0, rtol=0)
    saved = torch.load(path / "trainer.pt", weights_only=True)
    assert ("cuda_rng" in saved) == (torch.cuda.is_available() and torch.cuda.is_initialized())
    # a checkpoint written on a GPU resumes on a machine without one: the CPU state alone
    state = rng_state() | {"cuda_rng": [torch.zeros(16, dtype=torch.uint8)]}
    expected = torch.rand(3)
    set_rng_state(state)
    if not torch.cuda.is_available():
        torch.testing.assert_close(torch.rand(3), expected, atol=0, rtol=0)


def test_devices_resolve_or_refuse_in_one_line():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^trainer.device: cuda:1 but torch sees no CUDA"):
            resolve_device("cuda:1", key="trainer.device")
        assert gpus_wanted("auto") == 0
    assert gpus_wanted("cpu", 4) == 0 and gpus_wanted("cuda:1", 2) == 2


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:0 ", "mps"])
def test_config_refuses_unknown_devices(value):
    with pytest.raises(ConfigError, match="trainer.device.*auto, cpu, cuda or cuda:N"):
        parse_config({"trainer": {"device": value}})


def test_config_refuses_more_ranks_than_groups():
    with pytest.raises(ConfigError, match=r"trainer.workers \(3\) exceeds trainer.batch_groups"):
        parse_config({"trainer": {"workers": 3, "batch_groups": 2}})


def gpu_config(trainer: str, explorer: str, ranks: int = 1, explorers: int = 1):
    return parse_config({"trainer": {"device": trainer, "workers": ranks, "batch_groups": 8},
                         "explorer": {"device": explorer, "workers": explorers}})


def test_ray_actors_declare_their_gpus_and_share_when_there_are_too_few():
    assert gpu_shares(gpu_config("cpu", "cpu"), 0) == {"trainer": 0, "explorer": 0}
    assert gpu_shares(gpu_config("cuda", "cuda", ranks=2, explorers=2), 4) == \
        {"trainer": 2, "explorer": 1}
    # one GPU, a trainer and an explorer taking turns on it (sync mode)
    assert gpu_shares(gpu_config("cuda", "cuda:0"), 1) == {"trainer": 0.5, "explorer": 0.5}
    # two GPUs, three actors: two per device, so every actor fits
    assert gpu_shares(gpu_config("cuda", "cuda", explorers=2), 2) == \
        {"trainer": 0.5, "explorer": 0.5}
    assert gpu_shares(gpu_config("cpu", "cuda"), 1, trainer=False) == \
        {"trainer": 0, "explorer": 1}
    with pytest.raises(ConfigError, match="need 3 GPUs together and the Ray cluster has 2"):
        gpu_shares(gpu_config("cuda", "cuda", ranks=2), 2)
