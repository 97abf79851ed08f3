"""What a trainer rank holds and how it steps: the policy, its optimizer, and the models the
current stage's algorithm needs (a frozen reference, a critic).

Entering a stage (`begin`) resets the optimizer at the stage's learning rate, builds a new
critic when the algorithm is PPO's, and freezes a copy of the policy as the reference; the
trainer then saves that state as the checkpoint of the step before the stage's first, so the
reference of a stage is always that checkpoint's weights. `load` restores a checkpoint and the
stage state that goes with it, the same way on every rank and on resume.

With `trainer.sharding: fsdp2` the pool calls `shard` on every rank once the ranks are joined;
from then on saving, loading, publishing and evaluating are collectives every rank enters
together (the pool's commands), and the reference is a sharded copy (trainer/sharding.py).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from reservoir.config import ReservoirConfig
from reservoir.devices import resolve_device
from reservoir.models import load_model, save_state, save_weights
from reservoir.trainer.adapters import AdaptersOff, merged_state, with_adapters
from reservoir.trainer.batch import TrainBatch
from reservoir.trainer.checkpoint import Resumed, load_checkpoint, load_weights_of, save_checkpoint
from reservoir.trainer.critic import Critic, build_critic
from reservoir.trainer.optimizer import adamw
from reservoir.trainer.pairs import preference_step
from reservoir.plan.stages import step_seed
from reservoir.trainer.sharding import (base_of, frozen_copy, full_state, is_sharded, shard,
                                        whole)
from reservoir.plan.stages import Stage, plan, stage_at
from reservoir.trainer.step import ONE, Precision, Ranks, train_step


class Learner:
    def __init__(self, config: ReservoirConfig, rank: int = 0) -> None:
        self.config, self.rank = config, rank
        self.device = resolve_device(config.trainer.device, key="trainer.device", rank=rank)
        model, self.tokenizer = load_model(config.model.path)
        model.to(self.device)
        lora = config.trainer.lora
        if config.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if lora is not None:  # the frozen embedding's output must carry gradients through
                model.enable_input_require_grads()
        self.model = model if lora is None else with_adapters(model, lora, seed=config.run.seed)
        self.model.train()  # no dropout in the models we build; checkpointing needs it
        self.plan = plan(config)
        self.stage: Stage | None = None
        self.optimizer = self._optimizer(config.trainer.lr)
        self.reference = None
        self.critic: Critic | None = None

    @property
    def adapters(self) -> bool:
        """Whether the policy trains LoRA adapters (trainer.lora) rather than every weight."""
        return self.config.trainer.lora is not None

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    def shard(self) -> None:
        """Shard the policy over the pool's ranks (fsdp2), before any stage begins: every
        rank keeps 1/N of the weights, and the optimizer holds those shards."""
        self.model = shard(self.model, self.config.trainer.dtype)
        self.optimizer = self._optimizer(self.config.trainer.lr)

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        """AdamW over what trains: every weight, or the adapters only."""
        return adamw(self.model, lr, self.config.trainer.weight_decay)

    # -- stages and checkpoints -------------------------------------------------------------

    def begin(self, stage: Stage) -> None:
        """Enter `stage` from the current weights: fresh optimizer, critic and reference."""
        self.stage = stage
        self.optimizer = self._optimizer(stage.lr)
        self.critic = self._new_critic(stage)
        self.reference = self._reference() if stage.algorithm.needs_reference else None

    def start_from(self, checkpoint: Path) -> None:
        """Take another run's weights (or adapters) at a checkpoint (a branch); its optimizer
        is not taken: every stage begins with a fresh one."""
        load_weights_of(checkpoint, self.model)

    def publish(self, path: Path) -> Path:
        """The policy's weights as one safetensors file engines load in place: a LoRA
        policy's merged with its adapters. A sharded policy's ranks all call it: the whole
        weights gather once on rank 0's CPU, which writes them (the others write nothing)."""
        if not self.sharded and not self.adapters:
            return save_weights(self.model, path)
        state = full_state(self.model) if self.sharded else self.model.state_dict()
        if not state:
            return path
        if self.adapters:
            state = merged_state(state, self.config.trainer.lora)
        return save_state(_tied_once(state, self.model), path)

    def evaluate(self, evaluate, *args):
        """`evaluate(model, tokenizer, *args)` on rank 0's policy in eval mode (every rank of
        a sharded policy enters it: its layers stay gathered while rank 0 generates)."""
        with self.generating() as model:
            return evaluate(model, self.tokenizer, *args) if evaluate else None

    @contextmanager
    def generating(self):
        """The policy ready to generate until the block ends: in eval mode (the KV cache, not
        checkpointed layers) and, when sharded, with every layer gathered."""
        self.model.eval()
        try:
            with whole(self.model) if self.sharded else nullcontext():
                yield self.model
        finally:
            self.model.train()

    def save(self, root: Path, step: int, version: int) -> Path:
        folder = save_checkpoint(root, step, version, self.model, self.optimizer)
        if self.critic is not None and self.rank == 0:  # the same on every rank
            self.critic.save(folder)
        return folder

    def load(self, checkpoint: Path) -> Resumed:
        """Restore a checkpoint of step c and the state of the stage that trains step c + 1
        (its reference from the checkpoint before the stage's first step, its critic)."""
        resumed_step = _step_of(checkpoint)
        stage = stage_at(self.plan, resumed_step + 1)
        self.stage = stage
        lr = stage.lr if stage is not None else self.config.trainer.lr
        self.optimizer = self._optimizer(lr)
        self.critic = self._new_critic(stage) if stage is not None else None
        resumed = load_checkpoint(checkpoint, self.model, self.optimizer)
        if self.critic is not None and (checkpoint / "critic.pt").is_file():
            self.critic.load(checkpoint)
        self.reference = None
        if stage is not None and stage.algorithm.needs_reference:
            start = checkpoint.with_name(f"step-{stage.first_step - 1:06d}")
            self.reference = self._reference(start)
        return resumed

    def _reference(self, start: Path | None = None):
        """The frozen model of a stage that measures KL or preferences: a LoRA policy's base
        (the adapters off), else a copy of the weights the stage started from (now, or the
        checkpoint `start`)."""
        if self.adapters:
            return AdaptersOff(self.model)
        if self.sharded:
            reference = frozen_copy(self.model, self.config.trainer.dtype)
            if start is not None:
                load_weights_of(start, reference)
            return reference
        if start is None:
            return self._frozen(self.model)
        return self._frozen(type(self.model).from_pretrained(
            start, local_files_only=True).to(self.device))

    def _new_critic(self, stage: Stage | None) -> Critic | None:
        if stage is None or not stage.algorithm.needs_critic:
            return None
        critic = self.config.trainer.critic
        torch.manual_seed(self.config.run.seed)  # the same critic on every rank and resume
        return build_critic(critic.path or self.config.model.path, self.device, lr=critic.lr,
                            value_clip=stage.algorithm.value_clip,
                            weight_decay=self.config.trainer.weight_decay)

    @staticmethod
    def _frozen(model):
        reference = copy.deepcopy(model).eval()
        for param in reference.parameters():
            param.requires_grad_(False)
        return reference

    # -- a step ----------------------------------------------------------------------------

    def train(self, step: int, batch: TrainBatch, ranks: Ranks = ONE) -> dict[str, float]:
        """One optimizer step of the stage that trains `step` on `batch` (for preference
        stages: the chosen rows, then the rejected rows in the same order)."""
        stage = stage_at(self.plan, step)
        if stage != self.stage:
            raise RuntimeError(f"step {step} is in stage {stage.name!r}, the learner is in "
                               f"{getattr(self.stage, 'name', None)!r}")
        trainer, algorithm = self.config.trainer, stage.algorithm
        precision = Precision(dtype=trainer.dtype, chunk=trainer.logprob_chunk,
                              packed_tokens=trainer.micro_batch_tokens if trainer.packing
                              else None)
        if algorithm.preference_loss is not None:
            return preference_step(self.model, self.optimizer, batch, algorithm,
                                   reference=self.reference, micro_batch=trainer.micro_batch,
                                   precision=precision, ranks=ranks)
        # the engine's temperature shaped the sampled logprobs; likelihoods of given answers
        # (sft) are the model's own
        sampled = algorithm.policy_loss != "sft"
        metrics = train_step(self.model, self.optimizer, batch, algorithm,
                             micro_batch=trainer.micro_batch,
                             temperature=self.config.explorer.temperature if sampled else 1.0,
                             reference=self.reference, critic=self.critic,
                             precision=precision, ranks=ranks,
                             seed=step_seed(self.config.run.seed, step))
        if stage.data.kind == "tasks":  # demonstrations carry no reward to report
            metrics.pop("reward_mean", None)
        return metrics


def _tied_once(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Tied weights (the embedding and output layer) kept once, under the first of their
    names in sorted order, as `save_weights` (safetensors' `save_model`) keeps them."""
    names: dict[int, list[str]] = {}
    for name, param in base_of(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name.replace(".base_layer.", "."))
    dropped = {name for group in names.values() for name in sorted(group)[1:]}
    return {name: tensor.detach().contiguous() for name, tensor in state.items()
            if name not in dropped}


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))
