"""Packed micro-batches (trainer.packing): rows back to back without padding give the padded
path's logprobs, loss and gradients, whatever the micro-batches' token budget."""

import copy
import dataclasses

import pytest
import torch

import reservoir.trainer.batch as batch_module
from reservoir.models import build_tiny_model, load_model
from reservoir.trainer.batch import TrainBatch, full_logprobs, packed_logprobs
from reservoir.trainer.step import PRESETS, Precision, token_slices, train_step

pytestmark = pytest.mark.store_agnostic  # no store: CI runs it once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = load_model(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0))
    return model


def mixed_batch(vocab: int, rows: int = 12, seed: int = 0) -> TrainBatch:
    """Groups of 4; prompts of 5-14 tokens, responses of 1-60 (one row 60 long, one 1 long):
    right-padded to the longest, with engine logprobs near the policy's."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, 15, (rows,), generator=generator)
    responses = torch.randint(1, 61, (rows,), generator=generator)
    responses[0], responses[1] = 60, 1
    lengths = prompts + responses
    width = int(lengths.max())
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(6, vocab, (rows, width), generator=generator) * attention
    mask = torch.zeros(rows, width - 1)
    for i in range(rows):
        mask[i, int(prompts[i]) - 1:int(lengths[i]) - 1] = 1
    old = torch.where(mask.bool(), -torch.rand(rows, width - 1, generator=generator) * 3,
                      torch.tensor(float("nan")))
    return TrainBatch(ids, attention, mask, old, torch.rand(rows, generator=generator),
                      torch.arange(rows) // 4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunked", [False, True])
def test_packed_logprobs_and_entropy_equal_the_padded_ones(tiny, temperature, chunked,
                                                           monkeypatch):
    if chunked:  # the output layer chunk by chunk, as for logits past CHUNK_ABOVE_BYTES
        monkeypatch.setattr(batch_module, "CHUNK_ABOVE_BYTES", 0)
    batch = mixed_batch(tiny.config.vocab_size)
    padded, padded_entropy = full_logprobs(tiny, batch, temperature, entropy=True)
    packed, packed_entropy = packed_logprobs(tiny, batch, temperature, chunk=17, entropy=True)
    real = batch.attention_mask[:, 1:].bool()  # positions whose next token is the row's
    torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy[real], padded_entropy[real], atol=1e-5, rtol=0)
    assert (packed[~real] == 0).all() and packed.shape == padded.shape


def test_a_packed_sequence_does_not_see_the_row_before_it(tiny):
    """A row's logprobs are the same alone as after any other row in the pack."""
    batch = mixed_batch(tiny.config.vocab_size)
    alone = packed_logprobs(tiny, batch.rows(slice(3, 4)))
    after = packed_logprobs(tiny, batch.rows(slice(0, 4)))[3:4, :alone.shape[1]]
    torch.testing.assert_close(after, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["grpo", "grpo-entropy", "dr-grpo"])
@pytest.mark.parametrize("tokens", [1, 90, 250, 100_000])
def test_a_packed_step_gives_the_padded_step_s_loss_and_gradients(tiny, preset, tokens):
    """Mixed lengths, micro-batches cut by tokens (1: a row each; 100 000: all in one):
    the loss, metrics and every gradient equal the padded step's to 1e-5."""
    algorithm = (dataclasses.replace(PRESETS["grpo"], entropy_coef=0.01)
                 if preset == "grpo-entropy" else PRESETS[preset])
    batch = mixed_batch(tiny.config.vocab_size)
    results = {}
    for name, precision, micro in (("padded", Precision(), 5),
                                   ("packed", Precision(packed_tokens=tokens), 5)):
        model = copy.deepcopy(tiny)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients stay readable
        metrics = train_step(model, optimizer, batch, algorithm, micro_batch=micro,
                             precision=precision, max_grad_norm=None)
        results[name] = metrics, {n: p.grad.clone() for n, p in model.named_parameters()}
    (padded, padded_grads), (packed, packed_grads) = results["padded"], results["packed"]
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    for name in ("policy/clip_fraction", "entropy"):  # token means: the same for any cut
        if name in padded and algorithm.aggregation == "token-mean":
            assert packed[name] == pytest.approx(padded[name], abs=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_token_slices_fill_each_micro_batch_up_to_its_budget():
    lengths = [5, 5, 5, 20, 3, 3]
    assert token_slices(lengths, slice(0, 6), 10) == [slice(0, 2), slice(2, 3), slice(3, 4),
                                                      slice(4, 6)]
    assert token_slices(lengths, slice(1, 4), 100) == [slice(1, 4)]
    assert token_slices(lengths, slice(2, 2), 10) == []


@pytest.mark.parametrize("packed", [None, 4096])
def test_rows_without_signal_skip_the_model_and_change_nothing(tiny, packed):
    """Groups whose rewards are all equal have advantage 0: their rows are not run through
    the model, and the loss and the step (SGD, so the weights move by the gradient itself)
    equal a plain torch step over every row (the token-mean divides by every row's tokens)."""
    batch = mixed_batch(tiny.config.vocab_size)
    batch.rewards[:4], batch.rewards[8:] = 1.0, 0.0  # groups 0 and 2 flat, group 1 not
    model, plain = copy.deepcopy(tiny), copy.deepcopy(tiny)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=5,
                         precision=Precision(packed_tokens=packed))
    assert metrics["rows_without_signal"] == 8
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1.0)
    logprobs = full_logprobs(plain, batch)
    rewards = batch.rewards.view(-1, 4)
    advantages = ((rewards - rewards.mean(1, keepdim=True))
                  / (rewards.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1, 1)
    ratio = torch.exp(logprobs - torch.where(batch.mask.bool(), batch.old_logprobs, logprobs
                                             ).detach())
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    loss = -(surrogate * batch.mask).sum() / batch.mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    plain_optimizer.step()
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    for (name, mine), (_, theirs) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)


def test_a_batch_without_signal_changes_neither_weights_nor_optimizer_state(tiny):
    """`flat_updates: skip` (the default): AdamW's moments from an earlier update would keep
    moving the weights on zero gradients; a batch whose groups are all flat moves nothing."""
    batch = mixed_batch(tiny.config.vocab_size)
    model = copy.deepcopy(tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.5)
    train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=5)  # moments set
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    batch.rewards[:] = 1.0
    metrics = train_step(model, optimizer, batch, PRESETS["grpo"], micro_batch=5)
    assert {name: metrics[name] for name in ("loss", "rows_without_signal", "skipped_update",
                                             "grad_norm")} == {
        "loss": 0.0, "rows_without_signal": len(batch), "skipped_update": 1.0, "grad_norm": 0.0}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[0][name]), name
    for key, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, before[1]["state"][key][name]), (key, name)


def test_flat_updates_step_takes_adamw_s_step_on_zero_gradients(tiny):
    batch = mixed_batch(tiny.config.vocab_size)
    batch.rewards[:] = 1.0
    model = copy.deepcopy(tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.5)
    metrics = train_step(model, optimizer, batch, PRESETS["grpo"].replace(flat_updates="step"),
                         micro_batch=5)
    assert metrics["rows_without_signal"] == len(batch) and metrics["loss"] == 0.0
    assert "skipped_update" not in metrics
    decayed = [name for (name, p), (_, q) in zip(model.named_parameters(), tiny.named_parameters())
               if not torch.equal(p, q)]
    assert decayed  # weight decay moved them, as a full pass with zero gradients would


def test_a_sliding_window_layer_keeps_its_band_when_packed(tiny):
    """A model whose first layer attends to the last 8 positions only: packed rows longer
    than that give the padded path's logprobs."""
    config = copy.deepcopy(tiny.config)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 2
    config.layer_types = ["sliding_attention", "full_attention"]
    windowed = type(tiny)(config)
    windowed.load_state_dict(tiny.state_dict())
    batch = mixed_batch(tiny.config.vocab_size)
    padded = full_logprobs(windowed, batch)
    packed = packed_logprobs(windowed, batch)
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=0)
    unwindowed = full_logprobs(tiny, batch)
    assert not torch.allclose(unwindowed[real], padded[real], atol=1e-3)  # the band mattered
