"""Algorithms: named presets of registered pieces and their options (no torch here, so the
config can name them without loading the trainer).

An `Algorithm` names an advantage estimator, a policy loss (or, for pair data, a preference
loss) and a KL estimator from the registries of `trainer.algorithms`, with every option those
pieces read; each piece takes the options it declares. A preset is the combination users know
by name; `trainer.algorithm` picks one and may override any field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


STEP_OPTIONS = ("epochs", "mini_batches", "old_logprobs", "flat_updates")


@dataclass(frozen=True)
class Algorithm:
    advantage: str = "grpo"
    policy_loss: str = "ppo"
    preference_loss: str | None = None   # set: the algorithm trains on chosen/rejected pairs
    aggregation: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None       # PPO's dual clip c > 1 (bounds negative advantages)
    kl_coef: float = 0.0                 # > 0: a frozen reference model is loaded
    kl_estimator: str = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    entropy_coef: float = 0.0
    gamma: float = 1.0                   # discount (reinforce++, gae)
    lam: float = 0.95                    # GAE's lambda
    tau: float = 1.0                     # OPMD's temperature
    opmd_baseline: Literal["mean", "logavgexp"] = "mean"
    beta: float = 0.1                    # DPO's beta
    value_clip: float | None = 0.2       # the critic's value clipping
    tis_cap: float | None = None         # truncated importance sampling of the engine's samples
    epochs: int = 1                      # passes over a step's batch (PPO epochs)
    mini_batches: int = 1                # optimizer updates per pass (PPO mini-batches)
    old_logprobs: Literal["engine", "recompute"] = "engine"  # what ratios are taken against
    flat_updates: Literal["skip", "step"] = "skip"  # an update no row gives signal to

    @property
    def updates(self) -> int:
        """Optimizer updates in one step."""
        return self.epochs * self.mini_batches

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.preference_loss is not None

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def reads_experiences(self) -> bool:
        """False for algorithms that train on preference pairs."""
        return self.preference_loss is None

    def options(self) -> dict:
        """The options a piece may take (the step's own, how many updates and against what,
        are the step's)."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if name not in STEP_OPTIONS}

    def replace(self, **changes) -> "Algorithm":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, Algorithm] = {
    # PPO with a learned critic: GAE advantages, clipped and dual-clipped surrogate
    "ppo": Algorithm(advantage="gae", dual_clip=3.0),
    # GRPO with token-mean aggregation (DAPO's) and no KL
    "grpo": Algorithm(),
    # GRPO with a k3 KL penalty to the frozen start policy in the loss (DeepSeekMath)
    "grpo-kl": Algorithm(kl_coef=0.04, kl_estimator="k3", kl_in="loss"),
    # Dr. GRPO: mean-centred advantages, sequence-mean of token sums
    "dr-grpo": Algorithm(advantage="dr-grpo", aggregation="seq-mean-token-sum"),
    # RLOO: leave-one-out baseline
    "rloo": Algorithm(advantage="rloo"),
    # REINFORCE++: k1 KL folded into the token reward, batch-normalised returns
    "reinforce++": Algorithm(advantage="reinforce++", kl_coef=0.01, kl_estimator="k1",
                             kl_in="reward"),
    # GSPO: the sequence-level ratio, clipped tightly
    "gspo": Algorithm(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
                      aggregation="seq-mean-token-mean"),
    # CISPO: clipped, stop-gradient importance weights
    "cispo": Algorithm(policy_loss="cispo", clip_low=1.0, clip_high=4.0),
    # OPMD: online policy mirror descent (off-policy tolerant)
    "opmd": Algorithm(advantage="opmd", policy_loss="opmd"),
    # supervised fine-tuning on the rows' responses
    "sft": Algorithm(advantage="none", policy_loss="sft"),
    # DPO on chosen/rejected pairs against the frozen start policy
    "dpo": Algorithm(advantage="none", policy_loss="sft", preference_loss="dpo"),
}
