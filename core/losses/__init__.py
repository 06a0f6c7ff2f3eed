"""PPO losses, advantage estimators and the update step (pure functions plus one effectful ``ppo_update_``)."""

from core.losses.advantages import gae, vtrace, with_gae, with_vtrace
from core.losses.config import PPOConfig
from core.losses.ppo import ENTROPY, ppo_loss
from core.losses.turns import credit_absent_steps
from core.losses.update import Evaluate, ppo_update_

__all__ = [
    "ENTROPY",
    "Evaluate",
    "PPOConfig",
    "credit_absent_steps",
    "gae",
    "ppo_loss",
    "ppo_update_",
    "vtrace",
    "with_gae",
    "with_vtrace",
]
