"""Reward scaling by the running standard deviation of the discounted return (``PolicyConfig.scale_rewards``).

What SB3's ``VecNormalize(norm_reward=True)`` and CleanRL's ``NormalizeReward`` wrapper do (the "Reward
Scaling" and "Reward Clipping" details of the continuous-action section of "The 37 Implementation Details of
PPO", https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/; Engstrom et al. 2020,
arXiv:2005.12729)::

    G_t   = gamma * c_t + r_t                        discounted return of the trajectory so far
    c_t+1 = G_t * (1 - done_t)                       the accumulator restarts after a trajectory end
    var   = running variance of every G_t seen       (Chan et al.'s parallel merge, float64)
    r'_t  = clip(r_t / sqrt(var + eps), -10, 10)      what GAE and the value targets see

The rewards are divided, never centred: a shifted reward would change which episodes are better. The
statistics are the policy's state: :class:`RewardScaler` keeps them in persistent buffers, so they travel with
the weights (actors receive them and never change them), checkpoints keep them bit for bit, and evaluation,
which never trains, leaves them as they are. Who holds the accumulators ``c`` (one per env row and agent) is
the caller's business: it must feed every stream's rewards in order (:mod:`orchestration.reward_scaling`).

Shapes: rewards and flags ``[E, T, A, 1]`` (a fragment's ``("next", group, ...)`` entries), accumulators
``[E, A]`` float64, returns ``[E, T, A]`` float64.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from core.layout import NEXT, REWARD

#: Added to the variance before the square root (SB3's ``epsilon``).
EPS = 1e-8
#: Scaled rewards are clipped to ``[-CLIP, CLIP]`` (SB3's ``clip_reward``).
CLIP = 10.0


def merge_moments(mean: Tensor, var: Tensor, count: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Running ``(mean, var, count)`` merged with the samples ``x`` ``[N, *shape]`` (Chan et al. 1979's
    parallel update; ``var`` is the population variance, ``count`` a 0-d float). Pure: returns new tensors,
    the inputs when ``N == 0``. ``x`` is cast to ``mean``'s dtype and device."""
    x = x.to(mean)
    n = x.shape[0]
    if n == 0:
        return mean, var, count
    return _merge(mean, var, count, n, x.mean(0), x.var(0, unbiased=False))


def sums_of(x: Tensor) -> Tensor:
    """``[1 + 2 * size]`` float64: the number of rows of ``x`` ``[N, *shape]``, their sum and their sum of
    squares (flattened). Copies that train together on shards of one batch (data-parallel ranks) add these
    up and merge the sum with :func:`merge_sums`: the moments of the whole batch."""
    x = x.to(torch.float64)
    count = torch.full((1,), float(x.shape[0]), dtype=torch.float64, device=x.device)
    return torch.cat([count, x.sum(0).reshape(-1), x.square().sum(0).reshape(-1)])


def merge_sums(mean: Tensor, var: Tensor, count: Tensor, sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`merge_moments` from :func:`sums_of` (possibly added up over copies) instead of the samples."""
    n = float(sums[0])
    if n == 0:
        return mean, var, count
    size = mean.numel()
    batch_mean = (sums[1:1 + size] / n).reshape(mean.shape).to(mean)
    batch_var = ((sums[1 + size:] / n).reshape(mean.shape).to(mean) - batch_mean.square()).clamp(min=0.0)
    return _merge(mean, var, count, n, batch_mean, batch_var)


def _merge(mean: Tensor, var: Tensor, count: Tensor, n: float, batch_mean: Tensor, batch_var: Tensor):
    total = count + n
    delta = batch_mean - mean
    m2 = var * count + batch_var * n + delta.square() * count * n / total
    return mean + delta * n / total, m2 / total, total


def discounted_returns(reward: Tensor, done: Tensor, gamma: float, carry: Tensor) -> tuple[Tensor, Tensor]:
    """The running discounted return at every step of a fragment, and the accumulator for the next fragment.

    ``G_t = gamma * c_t + r_t``, ``c_{t+1} = G_t * (1 - done_t)`` (module docstring), along the time axis.
    Non-finite rewards (absent agents may carry NaN) count as 0.

    Args:
        reward: ``[E, T, A, 1]`` (or ``[E, T, A]``).
        done: bool, same shape: the agent's trajectory ended at ``t`` (terminated or truncated).
        gamma: the discount of the returns (``PPOConfig.gamma``).
        carry: ``[E, A]`` accumulator entering the fragment's first step (zeros for new streams).

    Returns:
        ``(returns [E, T, A] float64, carry [E, A] float64)``; the inputs are not modified.
    """
    if reward.dim() == 4:
        reward, done = reward.squeeze(-1), done.squeeze(-1)
    if reward.dim() != 3 or done.shape != reward.shape or carry.shape != (reward.shape[0], reward.shape[2]):
        raise ValueError(f"discounted_returns: reward {tuple(reward.shape)} and done {tuple(done.shape)} must be "
                         f"[E, T, A(, 1)] and carry {tuple(carry.shape)} [E, A]")
    r = reward.to(torch.float64)
    r = torch.where(r.isfinite(), r, torch.zeros((), dtype=r.dtype, device=r.device))
    keep = (~done).to(torch.float64)
    c = carry.to(torch.float64)
    steps = []
    for t in range(r.shape[1]):  # T small vector ops: a fragment, not a step, pays for this
        g = gamma * c + r[:, t]
        steps.append(g)
        c = g * keep[:, t]
    return torch.stack(steps, 1), c


def scaled(reward: Tensor, var: Tensor, eps: float = EPS, clip: float = CLIP) -> Tensor:
    """``clip(reward / sqrt(var + eps), -clip, clip)`` in ``reward``'s dtype (``var`` a 0-d tensor). Pure."""
    scale = torch.sqrt(var + eps).to(reward)
    return (reward / scale).clamp(-clip, clip)


class RewardScaler(nn.Module):
    """The running statistics of the discounted return of one policy's agents, as persistent buffers
    (``return_mean``, ``return_var``, ``return_count``: 0-d float64; no data yet: mean 0, variance 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("return_mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("return_var", torch.ones((), dtype=torch.float64))
        self.register_buffer("return_count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def observe_(self, returns: Tensor, mask: Tensor | None = None, reduce=None) -> None:
        """Merges the returns ``[*B]`` where ``mask`` ``[*B]`` (bool) is True. Mutates the buffers. ``reduce``:
        adds :func:`sums_of` up over copies training on shards of one batch (data-parallel ranks)."""
        x = returns.reshape(-1).to(self.return_mean.device)  # fragments may live elsewhere (an env on CUDA)
        if mask is not None:
            x = x[mask.reshape(-1).to(x.device)]
        stats = (self.return_mean, self.return_var, self.return_count)
        mean, var, count = merge_moments(*stats, x) if reduce is None else merge_sums(*stats, reduce(sums_of(x)))
        self.return_mean.copy_(mean)
        self.return_var.copy_(var)
        self.return_count.copy_(count)

    def scale(self) -> float:
        """``sqrt(var + eps)``: what rewards are divided by now (a diagnostic)."""
        return float(torch.sqrt(self.return_var + EPS))

    def forward(self, reward: Tensor) -> Tensor:
        """:func:`scaled` with the current variance."""
        return scaled(reward, self.return_var)


def with_scaled_rewards(rollout: TensorDictBase, group: str, scaler: RewardScaler) -> TensorDictBase:
    """A shallow copy of ``rollout`` whose ``("next", group, "reward")`` ``[E, T, A, 1]`` is scaled by
    ``scaler`` (every other entry shared with the input)."""
    g_next = rollout.get((NEXT, group)).copy()
    g_next.set(REWARD, scaler(g_next.get(REWARD)))
    nxt = rollout.get(NEXT).copy()
    nxt.set(group, g_next)
    out = rollout.copy()
    out.set(NEXT, nxt)
    return out


__all__ = ["CLIP", "EPS", "RewardScaler", "discounted_returns", "merge_moments", "scaled", "with_scaled_rewards"]
