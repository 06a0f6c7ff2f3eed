"""PPO losses, advantage estimators and the update step (pure functions plus one effectful ``ppo_update_``).

The config record is imported at once and the rest on first use (PEP 562 ``__getattr__``): ``PPOConfig`` is
torch-free, so ``orchestration.config`` (and ``shoal --help``) import it without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from core.losses.config import PPOConfig

if TYPE_CHECKING:
    from core.losses.advantages import gae, vtrace, with_gae, with_vtrace
    from core.losses.ppo import ENTROPY, ppo_loss
    from core.losses.rnd import (intrinsic_returns, merged_observation_moments, normalized_observation,
                                 prediction_error, rnd_loss, scaled_intrinsic_reward)
    from core.losses.turns import credit_absent_steps
    from core.losses.update import Evaluate, mixed_precision, ppo_update_
    from core.losses.value import value_loss

_LAZY = {"gae": "advantages", "vtrace": "advantages", "with_gae": "advantages", "with_vtrace": "advantages",
         "ENTROPY": "ppo", "ppo_loss": "ppo", "credit_absent_steps": "turns", "Evaluate": "update",
         "ppo_update_": "update", "mixed_precision": "update"}
_LAZY.update(BCConfig="bc", bc_loss="bc")  # behaviour cloning (core/losses/bc.py)
_LAZY.update(value_loss="value")  # a critic trained on its own (orchestration/team_critic.py)
_LAZY.update(dict.fromkeys(("intrinsic_returns", "merged_observation_moments", "normalized_observation",
                            "prediction_error", "rnd_loss", "scaled_intrinsic_reward"), "rnd"))  # curiosity (RND)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BCConfig",
    "ENTROPY",
    "Evaluate",
    "PPOConfig",
    "bc_loss",
    "credit_absent_steps",
    "gae",
    "intrinsic_returns",
    "merged_observation_moments",
    "mixed_precision",
    "normalized_observation",
    "ppo_loss",
    "ppo_update_",
    "prediction_error",
    "rnd_loss",
    "scaled_intrinsic_reward",
    "value_loss",
    "vtrace",
    "with_gae",
    "with_vtrace",
]
