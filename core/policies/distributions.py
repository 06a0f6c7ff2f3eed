"""One action distribution head per action leaf kind, on plain tensors with any leading batch dims ``[*B]``.

A head turns the raw output of the actor (``params``, ``[*B, head.num_params]``) into actions. Every head
has the same four methods; log-probabilities and entropies are ``[*B, 1]``; actions are ``[*B, *leaf.shape]``
in the leaf's dtype (a discrete leaf's ``start`` offset included)::

    action, log_prob = head.sample(params, generator, mask)   # random, from the passed generator only
    head.log_prob(params, action, mask)   # differentiable in params
    head.entropy(params, mask)            # differentiable in params
    head.mode(params, mask)               # deterministic (argmax / mean)

Sampling is hand-written (notes/tensordict-hot-paths.md pattern 8: Gumbel-max is ~4x cheaper than
``torch.distributions.Categorical``); tests pin each head to its ``torch.distributions`` counterpart.

Action masks (categorical and multi-categorical heads): illegal logits are replaced by the most negative
finite float, so an illegal action has probability exactly 0, is never sampled and adds nothing to the
entropy, while a row with *no* legal action (a padded, absent agent) stays finite (uniform) instead of NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.layout import is_all_true
from core.specs import Leaf, leaf_bounds

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_TANH_EDGE = 1e-6  # squashed actions are read back inside (-1 + e, 1 - e) so atanh stays finite


def gumbel_argmax(logits: Tensor, generator: torch.Generator | None, mask: Tensor | None = None) -> Tensor:
    """Samples ``argmax(logits - log E)``, ``E ~ Exponential(1)`` (``-log E`` is Gumbel noise): a draw of
    ``Categorical(logits)`` in five tensor ops (``-log(-log U)`` from a uniform takes seven).

    Args:
        logits: ``[*B, n]`` unnormalised log-probabilities.
        generator: source of ``E`` (on the device of ``logits``).
        mask: ``[*B, n]`` bool legal actions, or None. Applied after the noise (``-inf`` where illegal), so
            an ``E`` of exactly 0 (infinite noise) can only ever pick a legal action.

    Returns:
        int64 indices ``[*B]``.
    """
    noisy = logits - torch.empty_like(logits).exponential_(generator=generator).log_()
    if mask is not None:
        noisy = torch.where(mask, noisy, -torch.inf)
    return noisy.argmax(-1)


_TRANSPOSED_MIN_NUMEL, _TRANSPOSED_MAX_WIDTH = 2048, 32


def log_softmax(x: Tensor) -> Tensor:
    """``x.log_softmax(-1)``; many rows of few actions go through a transposed copy.

    torch's CPU kernel for the last dim works row by row, slow for rows of 2-5 values; over dim 0 of the
    transposed ``[n, rows]`` copy it runs along contiguous rows (measured, 1 thread: 32 against 53 µs for
    1,024 x 2 logits, 107 against 391 µs for 3,072 x 5; below ~2,048 values the extra copy costs more).
    """
    t = _transposed_log_softmax(x)
    return x.log_softmax(-1) if t is None else t.t().reshape(x.shape)


def _transposed_log_softmax(x: Tensor) -> Tensor | None:
    """``log_softmax`` of ``x`` ``[*B, n]`` as a contiguous ``[n, prod(B)]``, or None where the direct kernel is
    the cheaper one (see :func:`log_softmax`)."""
    n = x.shape[-1]
    if x.numel() < _TRANSPOSED_MIN_NUMEL or n > _TRANSPOSED_MAX_WIDTH:
        return None
    return x.reshape(-1, n).t().contiguous().log_softmax(0)


def log_prob_at(logits: Tensor, index: Tensor) -> Tensor:
    """``logits.log_softmax(-1).gather(-1, index[..., None])``: ``[*B, 1]`` for int64 ``index`` ``[*B]``.

    Always torch's last-dim kernel, which computes each row from that row alone, so a row's bits do not depend
    on how many rows are computed with it. The log-probability of a sampled action must not: an actor records
    the logits of every step and computes a whole fragment's log-probabilities at once
    (:meth:`core.policies.GroupPolicy.log_prob_from_params`). The transposed path of :func:`log_softmax`
    vectorises across rows, and its bits change with the row count (they differ by up to ~2e-7 between one
    step and a fragment once either crosses its size threshold); training, which needs no such agreement,
    keeps it (:func:`log_prob_entropy_at`).
    """
    return logits.log_softmax(-1).gather(-1, index.unsqueeze(-1))


def log_prob_entropy_at(logits: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """``(log-probability of index, entropy)``, both ``[*B, 1]``, from one :func:`log_softmax` (the fast,
    transposed path for many rows of few actions: the training forward pass of every minibatch).

    On the transposed path the gather runs over the contiguous ``[n, rows]`` result (a gather from the
    strided transposed view back costs ~3x more: 16 µs at 1,024 x 2).
    """
    t = _transposed_log_softmax(logits)
    if t is None:
        logp = logits.log_softmax(-1)
        return logp.gather(-1, index.unsqueeze(-1)), -(logp.exp() * logp).sum(-1, keepdim=True)
    shape = (*index.shape, 1)
    return t.gather(0, index.reshape(1, -1)).reshape(shape), -(t.exp() * t).sum(0).reshape(shape)


def _masked(logits: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return logits
    if mask.shape != logits.shape or mask.dtype != torch.bool:
        raise ValueError(f"action mask {tuple(mask.shape)} {mask.dtype} must be bool {tuple(logits.shape)}")
    return torch.where(mask, logits, torch.finfo(logits.dtype).min)


def _live(mask: Tensor | None) -> Tensor | None:
    """``mask``, or None when it is a known all-True constant (:func:`core.layout.all_true`): nothing to mask."""
    return None if mask is None or is_all_true(mask) else mask


def _categorical_entropy(logits: Tensor) -> Tensor:
    logp = log_softmax(logits)
    return -(logp.exp() * logp).sum(-1)


class Head(nn.Module):
    """Base of the action heads: ``num_params`` actor outputs in, actions of one leaf out."""

    num_params: int
    """Size of the last dim of ``params``."""
    exact_log_prob: bool = False
    """Whether :meth:`log_prob` of a sampled action, given the ``params`` and mask it was sampled with, equals the
    log-probability :meth:`sample` returned bit for bit, at any batch size (row-local kernels only, see
    :func:`log_prob_at`). Then an actor may record the params and compute the log-probabilities of a whole
    fragment at once (:mod:`orchestration.actor`)."""

    def __init__(self, leaf: Leaf) -> None:
        super().__init__()
        self.leaf = leaf

    def _no_mask(self, mask: Tensor | None) -> None:
        if mask is not None:
            raise ValueError(f"a {self.leaf.kind} action leaf takes no action mask")

    def log_prob_entropy(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(log_prob, entropy)`` of one evaluation (heads override it to share work between the two)."""
        return self.log_prob(params, action, mask), self.entropy(params, mask)

    def sample_action(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None) -> Tensor:
        """The action of ``sample(params, generator, mask)`` (same draws), without its log-probability."""
        return self.sample(params, generator, mask)[0]


class CategoricalHead(Head):
    """``Discrete(n, start)``: logits ``[*B, n]``; optional bool mask ``[*B, n]`` (True = legal)."""

    exact_log_prob = True  # sample and log_prob both take log_prob_at of the same masked logits

    def __init__(self, leaf: Leaf) -> None:
        super().__init__(leaf)
        self.num_params = leaf.n

    def sample(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None):
        mask = _live(mask)
        logits = _masked(params, mask)
        index = gumbel_argmax(logits, generator, mask)
        return self._action(index), log_prob_at(logits, index)

    def sample_action(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None) -> Tensor:
        mask = _live(mask)
        return self._action(gumbel_argmax(_masked(params, mask), generator, mask))

    def _action(self, index: Tensor) -> Tensor:
        if self.leaf.start:
            index = index + self.leaf.start
        # argmax gives int64, the usual leaf dtype: skipping the no-op .to() saves a dispatch per acting step
        return index if index.dtype == self.leaf.dtype else index.to(self.leaf.dtype)

    def log_prob(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> Tensor:
        index = action.long() - self.leaf.start if self.leaf.start else action.long()
        return log_prob_at(_masked(params, _live(mask)), index)

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        return _categorical_entropy(_masked(params, _live(mask))).unsqueeze(-1)

    def log_prob_entropy(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One masked ``log_softmax`` serves both (the training forward pass of every minibatch)."""
        index = action.long() - self.leaf.start if self.leaf.start else action.long()
        return log_prob_entropy_at(_masked(params, _live(mask)), index)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        return self._action(_masked(params, _live(mask)).argmax(-1))


class MultiCategoricalHead(Head):
    """``MultiDiscrete(nvec)``: independent categoricals; logits and mask ``[*B, sum(nvec)]``, concatenated.

    Components of different sizes are padded to ``max(nvec)`` with impossible logits, so all ``K``
    components are sampled in one Gumbel-max over ``[*B, K, max(nvec)]``.
    """

    exact_log_prob = True

    def __init__(self, leaf: Leaf) -> None:
        super().__init__(leaf)
        nvec, width = leaf.nvec, max(leaf.nvec)
        self.num_params, self.k, self.width = sum(nvec), len(nvec), width
        self.uniform = len(set(nvec)) == 1
        index = [i * width + j for i, n in enumerate(nvec) for j in range(n)]
        self.register_buffer("index", torch.tensor(index, dtype=torch.long), persistent=False)

    def _pad(self, x: Tensor, fill) -> Tensor:
        if not self.uniform:
            out = x.new_full((*x.shape[:-1], self.k * self.width), fill)
            x = out.index_copy(-1, self.index, x)
        return x.unflatten(-1, (self.k, self.width))

    def _logits(self, params: Tensor, mask: Tensor | None) -> Tensor:
        mask = _live(mask)
        logits = self._pad(params, torch.finfo(params.dtype).min)
        if mask is not None:
            if mask.shape != params.shape or mask.dtype != torch.bool:
                raise ValueError(f"action mask {tuple(mask.shape)} must be bool {tuple(params.shape)}")
            logits = _masked(logits, self._pad(mask, False))
        return logits

    def sample(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None):
        logits = self._logits(params, mask)
        # padded and masked entries sit at the dtype's minimum: excluded after the noise as well
        index = gumbel_argmax(logits, generator, logits > torch.finfo(logits.dtype).min)
        # row-local log_softmax (see log_prob_at): the same bits at any batch size
        log_prob = logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).sum(-2)
        return index.to(self.leaf.dtype), log_prob

    def sample_action(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None) -> Tensor:
        logits = self._logits(params, mask)
        return gumbel_argmax(logits, generator, logits > torch.finfo(logits.dtype).min).to(self.leaf.dtype)

    def log_prob(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> Tensor:
        logp = self._logits(params, mask).log_softmax(-1)  # row-local, as in sample
        return logp.gather(-1, action.long().unsqueeze(-1)).sum(-2)

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        return _categorical_entropy(self._logits(params, mask)).sum(-1, keepdim=True)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        return self._logits(params, mask).argmax(-1).to(self.leaf.dtype)


class BernoulliHead(Head):
    """``MultiBinary(n)``: independent Bernoulli bits, logits ``[*B, n]``."""

    exact_log_prob = True  # sample returns log_prob(params, bits) itself

    def __init__(self, leaf: Leaf) -> None:
        super().__init__(leaf)
        self.num_params = leaf.n

    def sample(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None):
        self._no_mask(mask)
        u = torch.rand(params.shape, generator=generator, dtype=params.dtype, device=params.device)
        bits = u < torch.sigmoid(params)
        return bits.to(self.leaf.dtype), self.log_prob(params, bits)

    def log_prob(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        target = action.to(params.dtype)
        return -F.binary_cross_entropy_with_logits(params, target, reduction="none").sum(-1, keepdim=True)

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        p = torch.sigmoid(params)
        return F.binary_cross_entropy_with_logits(params, p, reduction="none").sum(-1, keepdim=True)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        return (params > 0).to(self.leaf.dtype)


class GaussianHead(Head):
    """Float box: diagonal Gaussian, means ``[*B, D]`` (``D = prod(shape)``), state-independent ``log_std``.

    The parameter ``log_std`` ``[D]`` lives in the head (CleanRL's ``actor_logstd``), so ``params`` holds
    only the means.
    """

    def __init__(self, leaf: Leaf, log_std_init: float = 0.0) -> None:
        super().__init__(leaf)
        if not leaf.dtype.is_floating_point:
            raise ValueError(f"a box action leaf needs a float dtype for a Gaussian head, got {leaf.dtype}; make it "
                             f"a float box, or discrete / multi-discrete for integer actions")
        self.num_params = math.prod(leaf.shape)
        self.log_std = nn.Parameter(torch.full((self.num_params,), float(log_std_init)))

    def _flat(self, x: Tensor) -> Tensor:
        nd = len(self.leaf.shape)
        return x.flatten(-nd) if nd else x.unsqueeze(-1)

    def _unflat(self, x: Tensor) -> Tensor:
        nd = len(self.leaf.shape)
        return x.unflatten(-1, self.leaf.shape) if nd else x.squeeze(-1)

    def _normal_log_prob(self, mean: Tensor, u: Tensor) -> Tensor:
        z = (u - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.square() - self.log_std - _HALF_LOG_2PI).sum(-1, keepdim=True)

    def _draw(self, params: Tensor, generator: torch.Generator | None) -> Tensor:
        eps = torch.randn(params.shape, generator=generator, dtype=params.dtype, device=params.device)
        return params + self.log_std.exp() * eps

    def sample(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None):
        self._no_mask(mask)
        u = self._draw(params, generator)
        return self._unflat(u).to(self.leaf.dtype), self._normal_log_prob(params, u)

    def log_prob(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        return self._normal_log_prob(params, self._flat(action).to(params.dtype))

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        h = (self.log_std + 0.5 + _HALF_LOG_2PI).sum()
        return h.expand(*params.shape[:-1], 1)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        return self._unflat(params).to(self.leaf.dtype)


class TanhGaussianHead(GaussianHead):
    """Bounded float box: ``a = loc + scale * tanh(u)``, ``u ~ N(mean, exp(log_std))``, inside ``[low, high]``.

    ``log_prob`` is the change-of-variables density ``log N(u) - sum log(scale * (1 - tanh(u)^2))``, with
    ``u = atanh`` of the action clamped to ``(-1 + 1e-6, 1 - 1e-6)``; ``sample`` computes its log-probability
    through the same path, so ``log_prob(params, sampled_action)`` reproduces it exactly.
    ``entropy`` is the entropy of the pre-squash Gaussian ``u``: the squashed entropy has no closed form
    (``H(a) = H(u) + E[log|da/du|] <= H(u) + sum log(scale)``); it serves as the regulariser of the bonus.
    """

    def __init__(self, leaf: Leaf, log_std_init: float = 0.0) -> None:
        super().__init__(leaf, log_std_init)
        low, high = leaf_bounds(leaf)
        if not bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise ValueError("a tanh-Gaussian head needs finite bounds on every element")
        self.register_buffer("loc", ((high + low) / 2).flatten().float(), persistent=False)
        self.register_buffer("scale", ((high - low) / 2).flatten().float(), persistent=False)

    def sample(self, params: Tensor, generator: torch.Generator | None, mask: Tensor | None = None):
        self._no_mask(mask)
        action = self._unflat(self.loc + self.scale * torch.tanh(self._draw(params, generator)))
        action = action.to(self.leaf.dtype)
        return action, self.log_prob(params, action)

    def log_prob(self, params: Tensor, action: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        y = ((self._flat(action).to(params.dtype) - self.loc) / self.scale).clamp(-1 + _TANH_EDGE, 1 - _TANH_EDGE)
        log_det = (torch.log(self.scale) + torch.log1p(-y.square())).sum(-1, keepdim=True)
        return self._normal_log_prob(params, torch.atanh(y)) - log_det

    def mode(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        self._no_mask(mask)
        return self._unflat(self.loc + self.scale * torch.tanh(params)).to(self.leaf.dtype)


def make_head(leaf: Leaf, *, log_std_init: float = 0.0, squash_bounded: bool = True) -> Head:
    """The head of one action leaf.

    Box leaves with finite bounds on every element get a :class:`TanhGaussianHead` when ``squash_bounded``,
    any other float box a :class:`GaussianHead` (unbounded sampling; the env clips).

    Raises:
        ValueError: an integer box action (no head for it).
    """
    if leaf.kind == "discrete":
        return CategoricalHead(leaf)
    if leaf.kind == "multi_discrete":
        return MultiCategoricalHead(leaf)
    if leaf.kind == "binary":
        return BernoulliHead(leaf)
    low, high = leaf_bounds(leaf)
    if squash_bounded and bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
        return TanhGaussianHead(leaf, log_std_init)
    return GaussianHead(leaf, log_std_init)


__all__ = [
    "BernoulliHead", "CategoricalHead", "GaussianHead", "Head", "MultiCategoricalHead", "TanhGaussianHead",
    "gumbel_argmax", "make_head",
]
