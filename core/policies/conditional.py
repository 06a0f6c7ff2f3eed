"""The head of a discrete action leaf conditioned on an earlier discrete leaf (an autoregressive head).

For ``DictNode({"node": Discrete(n_A), "transform": Discrete(n_B)}, conditional={"transform": "node"})`` the
actor outputs a logits *table* for ``transform``, ``params`` ``[*B, n_A * n_B]`` (row-major ``[n_A, n_B]``):
row ``a`` is the categorical of ``transform`` once ``node`` chose ``a``, so any joint distribution over
``(node, transform)`` pairs can be represented. The env's mask for it is a table as well, ``[*B, n_A, n_B]``
bool (row ``a``: the transformations legal for node ``a``; :mod:`core.specs.structure`).

Sampling, log-probability and mode select row ``a`` of both tables (one ``gather``, row-local) and then run
a plain :class:`~core.policies.distributions.CategoricalHead` on it, so the log-probability of a sampled action
is recomputed bit for bit (``exact_log_prob``). The entropy is the expected conditional entropy
``sum_a p(a) H(B | a)`` ``[*B, 1]``, given the probabilities ``p`` ``[*B, n_A]`` of the conditioning leaf (added
to ``H(A)`` it is the exact joint entropy ``H(A, B)``; see :class:`core.policies.composite.ActionHeads`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.layout import is_all_true
from core.specs import Leaf

from .distributions import CategoricalHead, Head, _categorical_entropy, _masked


class ConditionalCategoricalHead(Head):
    """``Discrete(n_B)`` given ``Discrete(n_A)``: logits table ``[*B, n_A * n_B]``, mask table ``[*B, n_A, n_B]``.

    It has no unconditioned ``sample``/``log_prob``: the ``*_given`` methods take the conditioning leaf's
    action ``[*B]`` (its dtype and ``start`` offset included).
    """

    exact_log_prob = True  # the row gather is exact; the inner categorical head is exact

    def __init__(self, leaf: Leaf, given: Leaf) -> None:
        super().__init__(leaf)
        self.inner = CategoricalHead(leaf)
        self.n_given, self.given_start = given.n, given.start
        self.num_params = given.n * leaf.n

    def _index(self, given_action: Tensor) -> Tensor:
        """``[*B, 1, n_B]`` int64: where row ``a`` sits in ``[*B, n_A, n_B]``."""
        idx = given_action.long()
        if self.given_start:
            idx = idx - self.given_start
        return idx.unsqueeze(-1).unsqueeze(-1).expand(*idx.shape, 1, self.leaf.n)

    def check_table(self, table: Tensor, batch: torch.Size) -> None:
        """Raises ValueError unless ``table`` is bool ``[*batch, n_A, n_B]``."""
        if table.dtype != torch.bool or table.shape != (*batch, self.n_given, self.leaf.n):
            raise ValueError(f"conditional action mask {tuple(table.shape)} {table.dtype} must be bool "
                             f"{(*batch, self.n_given, self.leaf.n)}")

    def rows(self, params: Tensor, given_action: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(logits [*B, n_B], mask [*B, n_B] or None)``: row ``given_action`` of both tables."""
        at = self._index(given_action)
        logits = params.unflatten(-1, (self.n_given, self.leaf.n)).gather(-2, at).squeeze(-2)
        if table is None or is_all_true(table):
            return logits, None
        self.check_table(table, params.shape[:-1])
        return logits, table.gather(-2, at).squeeze(-2)

    def sample_given(self, params: Tensor, given_action: Tensor, generator: torch.Generator | None,
                     table: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(action [*B], log_prob [*B, 1])`` drawn from row ``given_action``."""
        logits, mask = self.rows(params, given_action, table)
        return self.inner.sample(logits, generator, mask)

    def sample_action_given(self, params: Tensor, given_action: Tensor, generator: torch.Generator | None,
                            table: Tensor | None = None) -> Tensor:
        """The action of :meth:`sample_given` (same draws), without its log-probability."""
        logits, mask = self.rows(params, given_action, table)
        return self.inner.sample_action(logits, generator, mask)

    def log_prob_given(self, params: Tensor, given_action: Tensor, action: Tensor,
                       table: Tensor | None = None) -> Tensor:
        """``[*B, 1]`` log-probability of ``action`` under row ``given_action`` (the bits of :meth:`sample_given`)."""
        logits, mask = self.rows(params, given_action, table)
        return self.inner.log_prob(logits, action, mask)

    def entropy_given(self, params: Tensor, given_probs: Tensor, table: Tensor | None = None) -> Tensor:
        """``sum_a p(a) H(B | a)`` ``[*B, 1]``, ``given_probs`` ``[*B, n_A]`` the conditioning leaf's probabilities."""
        logits = params.unflatten(-1, (self.n_given, self.leaf.n))
        if table is not None and not is_all_true(table):
            self.check_table(table, params.shape[:-1])
            logits = _masked(logits, table)
        return (given_probs * _categorical_entropy(logits)).sum(-1, keepdim=True)

    def mode_given(self, params: Tensor, given_action: Tensor, table: Tensor | None = None) -> Tensor:
        """The most likely action of row ``given_action`` (masked argmax) ``[*B]``."""
        logits, mask = self.rows(params, given_action, table)
        return self.inner.mode(logits, mask)

    def _unconditioned(self, *_args, **_kwargs):
        raise TypeError(f"a conditional {self.leaf.kind} head needs the action it is conditioned on: "
                        "use ActionHeads, or the *_given methods")

    sample = log_prob = entropy = mode = _unconditioned


__all__ = ["ConditionalCategoricalHead"]
