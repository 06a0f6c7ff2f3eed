"""Elo ratings of players from game results (pure): what a league reports for zero-sum populations, where a
summed return is always 0 and a win rate depends on who was played.

Ratings move once per *rating period* (a batch of games, e.g. one training iteration): every player's change
is ``k * (actual score - expected score)`` summed over its games of the period, with expectations from the
ratings at the period's start (Glickman's rating periods; order-free, so a batch of games needs no Python
loop). Scores: win 1, draw 0.5, loss 0; the expected score of ``a`` against ``b`` is
``1 / (1 + 10 ** ((r_b - r_a) / 400))``.

Shapes: ``ratings`` ``[P]`` float64; ``a``, ``b`` ``[G]`` int64 player indices of each game; ``score_a``
``[G]`` float (``a``'s score).
"""

from __future__ import annotations

import torch

INITIAL = 1000.0
MATCH_K = 32.0
"""Elo K of a *match*: a player's games of one iteration against one opponent, scored by their mean (per-game
updates summed over a period of ~100 games against one opponent overshoot and oscillate). Both leagues use it."""


def expected_score(rating_a: torch.Tensor, rating_b: torch.Tensor) -> torch.Tensor:
    """``a``'s expected score against ``b`` (elementwise)."""
    return 1.0 / (1.0 + torch.pow(10.0, (rating_b - rating_a) / 400.0))


def elo_update(ratings: torch.Tensor, a: torch.Tensor, b: torch.Tensor, score_a: torch.Tensor,
               k: float = 16.0) -> torch.Tensor:
    """New ratings after one rating period of games ``a[i]`` vs ``b[i]`` where ``a`` scored ``score_a[i]``.

    Zero-sum in rating points: what ``a`` gains in a game, ``b`` loses. Returns a new tensor.
    """
    if not (a.shape == b.shape == score_a.shape and a.dim() == 1):
        raise ValueError(f"a, b and score_a must be [G], got {tuple(a.shape)}, {tuple(b.shape)}, {tuple(score_a.shape)}")
    if bool(((score_a < 0) | (score_a > 1)).any()):
        raise ValueError("scores are in [0, 1] (win 1, draw 0.5, loss 0)")
    delta = k * (score_a.double() - expected_score(ratings[a], ratings[b]))
    return ratings.index_add(0, a, delta).index_add(0, b, -delta)


def score_from_return(returns: torch.Tensor) -> torch.Tensor:
    """A zero-sum game's return in [-1, 1] (win +1, draw 0, loss -1) as a score in [0, 1]."""
    return ((returns.double().clamp(-1.0, 1.0) + 1.0) / 2.0)


__all__ = ["INITIAL", "MATCH_K", "elo_update", "expected_score", "score_from_return"]
