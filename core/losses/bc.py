"""The behaviour-cloning loss on tensors: negative log-likelihood of recorded actions, detached diagnostics.

Behaviour cloning (Pomerleau 1991, "Efficient Training of Artificial Neural Networks for Autonomous
Navigation"; the maximum-likelihood form of Bain & Sammut 1995) fits a policy to a dataset of
(observation, action) pairs by maximising ``log pi(a|s)`` of the recorded actions. The loss never touches
a module or an optimizer: the caller evaluates the policy's action heads on the dataset's observations and
actions (``current``), with the recorded action masks applied by the heads (illegal actions get no
probability mass, so the likelihood is normalised over the legal actions only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from core.layout import ENTROPY, LOG_PROB

LOSS_KEYS = ("loss_bc", "loss_entropy")
DIAGNOSTIC_KEYS = ("perplexity", ENTROPY)


@dataclass(frozen=True, kw_only=True, slots=True)
class BCConfig:
    """Behaviour-cloning settings (the loss and the learner that steps it,
    :class:`orchestration.dataset_learner.BCLearner`)."""

    lr: float = 1e-3
    """Adam learning rate (Adam with ``eps=1e-5``, as PPO's detail 3)."""
    minibatch_size: int = 256
    """Transitions per gradient step (each agent of a transition counts once in the loss mean)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: no clipping)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (``loss_entropy = -entropy_coef * <H>``): keeps a cloned policy from
    collapsing on near-deterministic data, which helps PPO fine-tuning explore afterwards."""

    def __post_init__(self) -> None:
        for name in ("lr", "max_grad_norm", "entropy_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"BCConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"BCConfig.lr must be > 0, got {self.lr}")
        if not isinstance(self.minibatch_size, int) or self.minibatch_size < 1:
            raise ValueError(f"BCConfig.minibatch_size must be an int >= 1, got {self.minibatch_size!r}")


def bc_loss(current: Mapping[str, torch.Tensor], cfg: BCConfig, mask: torch.Tensor | None = None) -> TensorDict:
    """Loss terms and diagnostics of one minibatch; the caller sums the ``loss_*`` terms.

    With ``<.>`` the masked mean over valid entries (``sum(x * m) / max(sum(m), 1)``, so an all-masked
    minibatch gives zero losses)::

        loss_bc      = -< log pi(a|s) >                 (negative log-likelihood of the recorded actions)
        loss_entropy = -entropy_coef * < H[pi(.|s)] >   (zero, without a graph, when entropy_coef == 0)

    Diagnostics (detached): ``perplexity = exp(-<log pi(a|s)>)`` (1 when the policy puts all its mass on
    the recorded actions; the number of legal actions for a uniform policy) and ``entropy = <H>`` (NaN
    when ``current`` has no entropy). Masked entries, NaN and ``-inf`` included, change neither values nor
    gradients: padding of absent agents may hold any action.

    Args:
        current: the policy evaluated on the minibatch, with gradients: ``log_prob`` ``[N, A, 1]`` (or
            ``[N, 1]``) of the recorded actions under the recorded action masks, and ``entropy`` of the same
            shape (required when ``cfg.entropy_coef > 0``). A TensorDict or any mapping.
        cfg: ``entropy_coef`` is read.
        mask: bool ``[N, A]`` (the shape without the trailing 1), True where the agent is present and its
            action is to be cloned; None: all.

    Returns:
        A TensorDict with batch ``[]``: ``loss_bc``, ``loss_entropy`` (with gradients) and detached
        ``perplexity`` and ``entropy``.

    Raises:
        ValueError: ``log_prob`` is not ``[N, ..., 1]``, ``entropy`` or ``mask`` does not fit it, or the
            entropy is missing while ``cfg.entropy_coef > 0``.
    """
    log_prob = current[LOG_PROB]
    entropy = current.get(ENTROPY, None)
    shape = log_prob.shape
    if log_prob.dim() < 2 or shape[-1] != 1:
        raise ValueError(f"current[{LOG_PROB!r}] must be [N, ..., 1], got {list(shape)}")
    if entropy is not None and entropy.shape != shape:
        raise ValueError(f"current[{ENTROPY!r}]: expected shape {list(shape)}, got {list(entropy.shape)}")
    if entropy is None and cfg.entropy_coef > 0:
        raise ValueError(f"entropy_coef {cfg.entropy_coef} > 0 needs current[{ENTROPY!r}]")
    if mask is not None and (mask.shape != shape[:-1] or mask.dtype != torch.bool):
        raise ValueError(f"mask: expected bool {list(shape[:-1])}, got {mask.dtype} {list(mask.shape)}")
    mean = _masked_mean(mask)
    loss_bc = -mean(log_prob)
    if cfg.entropy_coef == 0.0 or entropy is None:  # config branch: no backward through an unused graph
        loss_entropy = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    else:
        loss_entropy = -cfg.entropy_coef * mean(entropy)
    with torch.no_grad():
        perplexity = loss_bc.detach().exp()
        mean_entropy = mean(entropy.detach()) if entropy is not None else torch.full((), torch.nan)
    return TensorDict(loss_bc=loss_bc, loss_entropy=loss_entropy, perplexity=perplexity, entropy=mean_entropy)


def _masked_mean(mask: torch.Tensor | None):
    """``x -> <x>`` over the valid entries of ``mask`` (all entries when None)."""
    if mask is None:
        return torch.mean
    valid = mask.unsqueeze(-1)
    count = valid.sum().clamp_min(1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, 0.0).sum() / count  # where(): padding's NaN stays out of values and grads

    return mean


__all__ = ["BCConfig", "DIAGNOSTIC_KEYS", "LOSS_KEYS", "bc_loss"]
