"""Composite actions: one head per leaf of an action tree; joint log-probability and entropy are sums.

The leaves of the action node are independent given the actor output (a product distribution), so for a
dict action ``{"move": Discrete(5), "aim": Box(2)}`` the joint ``log_prob = log_prob(move) + log_prob(aim)``
and ``entropy = H(move) + H(aim)``. Actions travel as a list of leaf tensors in :func:`core.specs.iter_leaves`
order (``paths``); :mod:`core.policies.actor_critic` writes them back as the action tree.

An action mask (``[*B, n]`` bool, :mod:`core.layout`) applies to an action node that is a single discrete
(``n``) or multi-discrete (``n = sum(nvec)``) leaf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from core.specs import Leaf, Node, iter_leaves

from .distributions import make_head


class ActionHeads(nn.Module):
    """The heads of one action node; ``params`` ``[*B, num_params]`` is split among them in leaf order.

    Attributes:
        paths: key path of every action leaf (``[()]`` for a bare leaf).
        heads: one :class:`core.policies.distributions.Head` per path.
        num_params: width of the actor output the heads consume.
    """

    def __init__(self, node: Node, *, log_std_init: float = 0.0, squash_bounded: bool = True) -> None:
        super().__init__()
        items = list(iter_leaves(node))
        self.paths = [p for p, _ in items]
        self.heads = nn.ModuleList(make_head(leaf, log_std_init=log_std_init, squash_bounded=squash_bounded)
                                   for _, leaf in items)
        self.sizes = [h.num_params for h in self.heads]
        self.num_params = sum(self.sizes)
        self.maskable = isinstance(node, Leaf) and node.kind in ("discrete", "multi_discrete")
        #: every head recomputes a sampled action's log-probability exactly from its params (``Head.exact_log_prob``)
        self.exact_log_prob = all(h.exact_log_prob for h in self.heads)

    def _split(self, params: Tensor, mask: Tensor | None) -> Sequence[Tensor]:
        if mask is not None and not self.maskable:
            raise ValueError("an action mask needs a single discrete or multi_discrete action leaf")
        if params.shape[-1] != self.num_params:
            raise ValueError(f"params end with {params.shape[-1]}, the heads need {self.num_params}")
        return (params,) if len(self.heads) == 1 else params.split(self.sizes, -1)

    def sample(self, params: Tensor, generator: torch.Generator | None,
               mask: Tensor | None = None) -> tuple[list[Tensor], Tensor]:
        """Random actions (one tensor per leaf) and their joint log-probability ``[*B, 1]``."""
        actions, total = [], None
        for head, p in zip(self.heads, self._split(params, mask)):
            action, log_prob = head.sample(p, generator, mask)
            actions.append(action)
            total = log_prob if total is None else total + log_prob
        return actions, total

    def sample_actions(self, params: Tensor, generator: torch.Generator | None,
                       mask: Tensor | None = None) -> list[Tensor]:
        """The actions of :meth:`sample` (same random draws), without the log-probability."""
        return [head.sample_action(p, generator, mask) for head, p in zip(self.heads, self._split(params, mask))]

    def log_prob(self, params: Tensor, actions: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        """Joint log-probability ``[*B, 1]`` of ``actions`` (one tensor per leaf, ``paths`` order).

        Summed leaf by leaf in order, as :meth:`sample` does, so a sampled action's value is the same bits.
        """
        if len(actions) != len(self.heads):
            raise ValueError(f"{len(actions)} action tensors for {len(self.heads)} action leaves")
        total = None
        for h, p, a in zip(self.heads, self._split(params, mask), actions):
            part = h.log_prob(p, a, mask)
            total = part if total is None else total + part
        return total

    def log_prob_entropy(self, params: Tensor, actions: Sequence[Tensor],
                         mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(log_prob(params, actions, mask), entropy(params, mask))``, sharing each head's work."""
        if len(actions) != len(self.heads):
            raise ValueError(f"{len(actions)} action tensors for {len(self.heads)} action leaves")
        parts = [h.log_prob_entropy(p, a, mask) for h, p, a in zip(self.heads, self._split(params, mask), actions)]
        if len(parts) == 1:
            return parts[0]
        return torch.stack([lp for lp, _ in parts]).sum(0), torch.stack([h for _, h in parts]).sum(0)

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        """Joint entropy ``[*B, 1]`` (sum over leaves)."""
        parts = [h.entropy(p, mask) for h, p in zip(self.heads, self._split(params, mask))]
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> list[Tensor]:
        """Deterministic actions (masked argmax, Gaussian mean, squashed mean, ``logit > 0``), one per leaf."""
        return [h.mode(p, mask) for h, p in zip(self.heads, self._split(params, mask))]


__all__ = ["ActionHeads"]
