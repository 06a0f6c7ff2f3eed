"""The PPO configuration record: every hyper-parameter of the loss, the estimator and the update, once."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    """Clipped-surrogate PPO (Schulman et al. 2017, arXiv:1707.06347) with GAE (arXiv:1506.02438).

    Defaults follow CleanRL's ``ppo.py`` and "The 37 Implementation Details of PPO"
    (https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/), except ``value_clip_eps``
    (off: Andrychowicz et al. 2021, arXiv:2006.05990, found value clipping does not help) and
    ``entropy_coef`` (0, as in MAPPO/BenchMARL). The learning rate and Adam's ``eps`` belong to the
    optimizer, not here (detail 3: ``torch.optim.Adam(params, lr, eps=1e-5, fused=True)``).
    """

    clip_eps: float = 0.2
    """Ratio clip range epsilon of L^CLIP: the ratio is clipped to [1 - eps, 1 + eps] (detail 8)."""
    value_clip_eps: float | None = None
    """PPO2 value clipping around the behaviour value (detail 9); None disables it."""
    value_coef: float = 0.5
    """Weight of the value loss ``0.5 * (V - V_target)^2`` in the summed loss (detail 10)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; the loss term is ``-entropy_coef * mean(entropy)`` (detail 10)."""
    gamma: float = 0.99
    """Discount factor of returns and of the GAE/V-trace recursions."""
    gae_lambda: float = 0.95
    """GAE lambda: 0 gives one-step TD advantages, 1 Monte-Carlo returns minus the baseline (detail 5)."""
    advantage: Literal["gae", "vtrace"] = "gae"
    """The estimator of advantages and value targets: ``gae``, or ``vtrace`` (IMPALA, Espeholt et al. 2018,
    arXiv:1802.01561; truncation thresholds rho and c of 1): corrects for data that older weights acted with
    (asynchronous mode, uploads of local policies) by the truncated importance ratios of the policy being
    trained, and PPO's ratio is then taken against that policy as the update starts, not the behaviour's
    (decoupled PPO, Hilton et al. 2021: the correction counts once); feed-forward policies."""
    normalize_advantage: bool = True
    """Standardise advantages per minibatch over valid (unmasked) entries (detail 7)."""
    advantage_eps: float = 1e-8
    """Added to the advantage standard deviation before dividing (CleanRL's 1e-8)."""
    num_epochs: int = 4
    """Passes over the batch per update; each epoch draws a fresh permutation (detail 6)."""
    minibatch_size: int = 128
    """Transitions per minibatch (each with all its agents); the last minibatch of an epoch may be smaller."""
    max_grad_norm: float | None = 0.5
    """Global gradient-norm clip over all trained parameters (detail 11); None disables clipping."""
    target_kl: float | None = None
    """Stop the update after an epoch whose mean ``approx_kl`` exceeds this (CleanRL); None never stops."""
    sequence_length: int | None = None
    """Recurrent policies: steps per training sequence (truncated BPTT; each starts from the state stored with
    its first step); None: whole fragments. Minibatches then hold ``minibatch_size // sequence_length`` whole
    sequences (at least one)."""
    burn_in: int = 0
    """Recurrent policies: steps before each sequence that only warm its state up (no gradient, no loss; from
    the state stored ``burn_in`` steps earlier, as R2D2); a fragment's first sequence has none before it."""

    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the update's forward and backward passes compute in. ``bfloat16`` runs the policy's evaluation
    under ``torch.autocast`` (mixed precision): matmuls and convolutions in bfloat16, while parameters,
    gradients, the optimiser's state and the loss stay float32. It pays on GPUs and on CPUs with bfloat16
    instructions (AVX-512 BF16, AMX; ``benchmarks/vmas_mappo.py --compute-dtype bfloat16``) at bfloat16's
    precision (3 significant digits) in the hidden layers; the output layers (action-head parameters, values)
    stay float32. CPUs without those instructions emulate it, slower. It applies to PPO updates and the team
    critic; behaviour-cloning pretraining and the curiosity predictor train in float32."""

    def __post_init__(self) -> None:
        for name, kind in (("clip_eps", "float"), ("value_clip_eps", "float | None"), ("value_coef", "float"),
                           ("entropy_coef", "float"), ("gamma", "float"), ("gae_lambda", "float"),
                           ("normalize_advantage", "bool"), ("advantage_eps", "float"),
                           ("max_grad_norm", "float | None"), ("target_kl", "float | None")):
            if not _of_kind(value := getattr(self, name), kind):  # before any comparison: '0.2' < 1.0 is a TypeError
                raise TypeError(f"PPOConfig.{name} takes a {kind.replace(' | ', ' or ')}, got {value!r}")
        _check(0.0 < self.clip_eps < 1.0, "clip_eps", "in (0, 1)", self.clip_eps)
        _check(self.value_clip_eps is None or self.value_clip_eps > 0.0, "value_clip_eps", "> 0 or None",
               self.value_clip_eps)
        _check(self.value_coef >= 0.0, "value_coef", ">= 0", self.value_coef)
        _check(self.entropy_coef >= 0.0, "entropy_coef", ">= 0", self.entropy_coef)
        _check(0.0 <= self.gamma <= 1.0, "gamma", "in [0, 1]", self.gamma)
        _check(0.0 <= self.gae_lambda <= 1.0, "gae_lambda", "in [0, 1]", self.gae_lambda)
        _check(self.advantage in ADVANTAGES, "advantage", f"one of {ADVANTAGES}", self.advantage)
        _check(self.advantage_eps > 0.0, "advantage_eps", "> 0", self.advantage_eps)
        _check(_is_int(self.num_epochs) and self.num_epochs >= 1, "num_epochs", "an int >= 1", self.num_epochs)
        _check(_is_int(self.minibatch_size) and self.minibatch_size >= 1, "minibatch_size", "an int >= 1",
               self.minibatch_size)
        _check(self.max_grad_norm is None or self.max_grad_norm > 0.0, "max_grad_norm", "> 0 or None",
               self.max_grad_norm)
        _check(self.target_kl is None or self.target_kl > 0.0, "target_kl", "> 0 or None", self.target_kl)
        _check(self.sequence_length is None or (_is_int(self.sequence_length) and self.sequence_length >= 1),
               "sequence_length", "an int >= 1 or None", self.sequence_length)
        _check(_is_int(self.burn_in) and self.burn_in >= 0, "burn_in", "an int >= 0", self.burn_in)
        _check(self.compute_dtype in COMPUTE_DTYPES, "compute_dtype", f"one of {COMPUTE_DTYPES}", self.compute_dtype)
        for name in ("clip_eps", "value_coef", "entropy_coef", "gamma", "gae_lambda", "advantage_eps"):
            _check(math.isfinite(getattr(self, name)), name, "finite", getattr(self, name))


ADVANTAGES = ("gae", "vtrace")
COMPUTE_DTYPES = ("float32", "bfloat16")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _of_kind(value: object, kind: str) -> bool:
    """Whether ``value`` is a ``kind`` (``"float"``, ``"bool"``, with ``" | None"``): a real number that is no
    bool for a float (numpy's too), a bool (or numpy's) for a bool."""
    if value is None:
        return kind.endswith("| None")
    if kind.startswith("bool"):
        return type(value).__name__ in ("bool", "bool_")
    return isinstance(value, numbers.Real) and type(value).__name__ not in ("bool", "bool_")


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"PPOConfig.{name} must be {expected}, got {got!r}")
