"""Elo ratings (core.ratings): the update against a per-game reference loop, and what it must do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.ratings import INITIAL, elo_update, expected_score, score_from_return


def _reference(ratings: list[float], games: list[tuple[int, int, float]], k: float) -> list[float]:
    """One rating period by hand: expectations from the period's start, changes summed per player."""
    change = [0.0] * len(ratings)
    for a, b, s in games:
        e = 1.0 / (1.0 + 10 ** ((ratings[b] - ratings[a]) / 400.0))
        change[a] += k * (s - e)
        change[b] -= k * (s - e)
    return [r + c for r, c in zip(ratings, change)]


@given(ratings=st.lists(st.floats(600, 1400), min_size=2, max_size=5),
       games=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0])),
                      min_size=1, max_size=20))
def test_the_update_equals_a_per_game_loop_and_conserves_points(ratings, games):
    games = [(a % len(ratings), b % len(ratings), s) for a, b, s in games if a % len(ratings) != b % len(ratings)]
    if not games:
        return
    a, b, s = (torch.tensor(x) for x in zip(*games))
    got = elo_update(torch.tensor(ratings, dtype=torch.float64), a, b, s.double(), k=16.0)
    torch.testing.assert_close(got, torch.tensor(_reference(ratings, games, 16.0), dtype=torch.float64))
    assert float(got.sum()) == pytest.approx(sum(ratings))


def test_a_winner_climbs_an_even_score_keeps_equals_equal():
    start = torch.full((2,), INITIAL, dtype=torch.float64)
    ones, zeros = torch.ones(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)
    won = elo_update(start, zeros, ones, torch.ones(10, dtype=torch.float64))
    assert won[0] > INITIAL > won[1]
    drawn = elo_update(start, zeros, ones, torch.full((10,), 0.5, dtype=torch.float64))
    assert torch.equal(drawn, start)
    assert float(expected_score(torch.tensor(1400.0), torch.tensor(1000.0))) == pytest.approx(10 / 11)
    assert score_from_return(torch.tensor([1.0, 0.0, -1.0])).tolist() == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="scores are in"):
        elo_update(start, zeros[:1], ones[:1], torch.tensor([2.0], dtype=torch.float64))
