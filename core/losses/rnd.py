"""Random network distillation (RND): a curiosity bonus from the error of predicting a fixed random network.

Burda, Edwards, Storkey and Klimov 2018, "Exploration by Random Network Distillation" (arXiv:1810.12894); the
reference implementation we read is CleanRL's ``ppo_rnd_envpool.py``. A target network ``f`` is initialised at
random and never trained; a predictor ``f_hat`` learns to match it on the observations the agents visit, so
its error is small on familiar observations and large on new ones::

    x       = clip((s_{t+1} - mu) / sqrt(var + eps), -5, 5)     running observation statistics (paper, 2.4)
    e_t     = mean_k (f_hat(x)_k - f(x)_k)^2                   per-sample prediction error  (paper, eq. 1)
    r_i,t   = e_t / sqrt(var(R_i) + eps)                       scaled by a running std of intrinsic returns
    R_i,t   = gamma_i * R_i,t-1 + r_t                          non-episodic: never reset at episode ends
    loss    = sum_n keep_n e_n / max(1, sum_n keep_n)          keep_n ~ Bernoulli(p) (the paper's
                                                               "proportion of experience used for training")

Notation: the paper's squared norm is a mean over the ``K`` features here (CleanRL's ``F.mse_loss(...).mean(-1)``
for the loss; its reward uses a half sum, a constant factor the return scaling removes). Observation
statistics are per feature (``[D]``), return statistics a scalar, both merged with Chan et al.'s parallel update
(:func:`core.policies.reward_scaling.merge_moments`). Everything here is pure: tensors in, tensors out;
the networks' forward passes are the caller's, and randomness comes from a passed ``torch.Generator``.

Shapes: observations ``[*B, D]``, features ``[*B, K]``, per-sample scalars ``[*B, 1]``, ``mask`` ``[*B]`` bool.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from core.policies.reward_scaling import discounted_returns, merge_moments

#: Normalised RND inputs are clipped to ``[-OBS_CLIP, OBS_CLIP]`` (the paper's and CleanRL's 5).
OBS_CLIP = 5.0
#: Added to variances before the square root.
EPS = 1e-8


def normalized_observation(obs: Tensor, mean: Tensor, var: Tensor, clip: float = OBS_CLIP) -> Tensor:
    """``clip((obs - mean) / sqrt(var + eps), -clip, clip)`` as float32.

    Args:
        obs: ``[*B, D]`` observations (any real dtype).
        mean: ``[D]`` running mean.
        var: ``[D]`` running (population) variance.
        clip: the bound of the result.

    Returns:
        ``[*B, D]`` float32.
    """
    if obs.shape[-1:] != mean.shape or mean.shape != var.shape:
        raise ValueError(f"normalized_observation: obs {tuple(obs.shape)} must end with the statistics' "
                         f"shape {tuple(mean.shape)} (var {tuple(var.shape)})")
    x = (obs.to(mean.dtype) - mean) / torch.sqrt(var + EPS)
    return x.clamp(-clip, clip).to(torch.float32)


def merged_observation_moments(mean: Tensor, var: Tensor, count: Tensor, obs: Tensor,
                               mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Running per-feature ``(mean [D], var [D], count [])`` merged with ``obs`` ``[*B, D]`` where ``mask``
    ``[*B]`` (bool; None: every row). Pure: new tensors."""
    x = obs.reshape(-1, obs.shape[-1])
    if mask is not None:
        x = x[mask.reshape(-1)]
    return merge_moments(mean, var, count, x)


def prediction_error(predicted: Tensor, target: Tensor) -> Tensor:
    """Per-sample squared error, averaged over features: ``[*B, K]`` twice -> ``[*B, 1]``. The target is
    detached (it is never trained); gradients reach ``predicted`` only."""
    if predicted.shape != target.shape:
        raise ValueError(f"prediction_error: predicted {tuple(predicted.shape)} vs target {tuple(target.shape)}")
    return (predicted - target.detach()).square().mean(-1, keepdim=True)


def rnd_loss(predicted: Tensor, target: Tensor, mask: Tensor | None, proportion: float,
             generator: torch.Generator) -> TensorDict:
    """The predictor's distillation loss on a random ``proportion`` of the present samples.

    Args:
        predicted: ``[N, K]`` predictor features (with gradients).
        target: ``[N, K]`` target features.
        mask: ``[N]`` bool: the samples that may train (present agents); None: all.
        proportion: probability that a present sample is kept (the paper's update proportion, in (0, 1]).
        generator: draws the ``[N]`` uniform numbers that pick the samples (on the CPU).

    Returns:
        ``loss_predictor`` (0-d, differentiable) and detached diagnostics: ``prediction_error`` (mean error of
        the present samples) and ``kept`` (samples that trained).
    """
    error = prediction_error(predicted, target).squeeze(-1)  # [N]
    present = torch.ones_like(error, dtype=torch.bool) if mask is None else mask.reshape(-1).to(error.device)
    if present.shape != error.shape:
        raise ValueError(f"rnd_loss: mask {tuple(present.shape)} vs {error.shape[0]} samples")
    draw = torch.rand(error.shape[0], generator=generator).to(error.device)
    keep = (present & (draw < proportion)).to(error.dtype)
    loss = (error * keep).sum() / keep.sum().clamp(min=1.0)
    with torch.no_grad():
        shown = present.to(error.dtype)
        mean_error = (error * shown).sum() / shown.sum().clamp(min=1.0)
    return TensorDict(loss_predictor=loss, prediction_error=mean_error.detach(), kept=keep.sum().detach())


def intrinsic_returns(reward: Tensor, gamma: float, carry: Tensor) -> tuple[Tensor, Tensor]:
    """Non-episodic discounted intrinsic returns ``R_t = gamma * R_{t-1} + r_t`` along time (episode ends do
    not reset them: the paper's intrinsic stream is non-episodic).

    Args:
        reward: ``[E, T, A, 1]`` intrinsic rewards (absent agents: 0).
        gamma: the intrinsic discount (the paper's 0.99).
        carry: ``[E, A]`` float64 returns entering the first step.

    Returns:
        ``(returns [E, T, A] float64, carry [E, A] float64)``.
    """
    return discounted_returns(reward, torch.zeros_like(reward, dtype=torch.bool), gamma, carry)


def scaled_intrinsic_reward(reward: Tensor, return_var: Tensor) -> Tensor:
    """``reward / sqrt(return_var + eps)`` in ``reward``'s dtype (divided, never centred: the bonus stays
    non-negative). ``reward`` ``[*B, 1]``, ``return_var`` 0-d."""
    return reward / torch.sqrt(return_var + EPS).to(reward)


__all__ = ["EPS", "OBS_CLIP", "intrinsic_returns", "merged_observation_moments", "normalized_observation",
           "prediction_error", "rnd_loss", "scaled_intrinsic_reward"]
