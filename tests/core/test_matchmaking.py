"""League matchmaking (core.matchmaking): PFSP weights, each role's choice of opponent, the payoff table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from core.matchmaking import (Roster, choose_opponent, exploiter_done, pfsp_weights, record_games, win_rates)

# players: 0 main, 1 main exploiter, 2 league exploiter (active); 3, 4 past mains; 5 past main exploiter
ROSTER = Roster(role=torch.tensor([0, 1, 2, 0, 0, 1]), historical=torch.tensor([False, False, False, True, True, True]),
                parent=torch.tensor([0, 1, 2, 0, 0, 1]))


def _table(rates: dict[tuple[int, int], float], games: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    wins, played = torch.zeros(6, 6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)
    for (a, b), rate in rates.items():
        wins, played = record_games(wins, played, a, b, torch.full((int(games),), rate))
    return wins, played


def _draws(me: int, wins, games, n: int = 2000, **kw) -> tuple[torch.Tensor, dict[str, int]]:
    g = torch.Generator().manual_seed(0)
    counts, why = torch.zeros(6), {}
    for _ in range(n):
        who, reason = choose_opponent(me, ROSTER, wins, games, g, **kw)
        counts[who] += 1
        why[reason] = why.get(reason, 0) + 1
    return counts / n, why


def test_pfsp_weightings_favour_the_opponents_they_are_meant_to():
    rates = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    assert torch.allclose(pfsp_weights(rates, "squared"), torch.tensor([0.81, 0.25, 0.01, 0.0], dtype=torch.float64))
    assert torch.allclose(pfsp_weights(rates, "variance"), torch.tensor([0.09, 0.25, 0.09, 0.0], dtype=torch.float64))
    assert torch.allclose(pfsp_weights(rates, "linear_capped"), torch.tensor([0.5, 0.5, 0.1, 0.0], dtype=torch.float64))
    assert torch.equal(pfsp_weights(torch.ones(3, dtype=torch.float64)), torch.ones(3, dtype=torch.float64))  # all beaten
    with pytest.raises(ValueError, match="squared"):
        pfsp_weights(rates, "sqared")


def test_a_main_agent_self_plays_at_its_rate_and_otherwise_prefers_the_past_players_it_loses_to():
    wins, games = _table({(0, 3): 0.9, (0, 4): 0.2, (0, 5): 0.5})
    freq, why = _draws(0, wins, games, self_play=0.35)
    assert abs(why["self_play"] / 2000 - 0.35) < 0.04 and abs(freq[0] - 0.35) < 0.04  # itself, the only main
    assert freq[1] == freq[2] == 0  # active exploiters are never a main agent's opponent
    pfsp = freq[3:] / freq[3:].sum()  # squared weights 0.01 : 0.64 : 0.25
    assert torch.allclose(pfsp, torch.tensor([0.01, 0.64, 0.25]) / 0.9, atol=0.04)


def test_a_main_agent_that_loses_to_itself_plays_its_past_selves_instead():
    wins, games = _table({(0, 0): 0.1, (0, 3): 0.5, (0, 4): 0.5})
    _, why = _draws(0, wins, games, n=400, self_play=1.0)
    assert why == {"past_selves": 400}


def test_a_main_exploiter_plays_the_main_agent_until_it_cannot_beat_it_then_its_past_selves():
    wins, games = _table({(1, 0): 0.3})
    freq, why = _draws(1, wins, games, n=300)
    assert freq[0] == 1.0 and why == {"exploit": 300}
    wins, games = _table({(1, 0): 0.05, (1, 3): 0.5, (1, 4): 0.95})
    freq, why = _draws(1, wins, games, n=2000)
    assert why == {"exploit_past": 2000} and freq[[0, 1, 2, 5]].sum() == 0
    assert abs(freq[3] - 0.25 / (0.25 + 0.0475)) < 0.04  # variance weights: even games first


def test_a_league_exploiter_draws_only_historical_players_by_capped_pfsp():
    wins, games = _table({(2, 3): 0.95, (2, 4): 0.2, (2, 5): 0.6})
    freq, why = _draws(2, wins, games)
    assert freq[:3].sum() == 0 and why == {"pfsp": 2000}
    assert torch.allclose(freq[3:], torch.tensor([0.05, 0.5, 0.4]) / 0.95, atol=0.04)


def test_exploiters_are_done_when_they_beat_their_targets_with_enough_games():
    wins, games = _table({(1, 0): 0.8}, games=10)
    assert not exploiter_done(1, ROSTER, wins, games, min_games=20)  # too few games
    assert exploiter_done(1, ROSTER, wins, games, min_games=10)
    wins, games = _table({(1, 0): 0.6}, games=50)
    assert not exploiter_done(1, ROSTER, wins, games, min_games=10)
    wins, games = _table({(2, 3): 0.9, (2, 4): 0.9, (2, 5): 0.5}, games=20)  # league exploiter: 46 of 60
    assert exploiter_done(2, ROSTER, wins, games, threshold=0.75, min_games=10)
    assert not exploiter_done(2, ROSTER, wins, games, threshold=0.8, min_games=10)
    assert not exploiter_done(0, ROSTER, *_table({(0, 3): 1.0}), min_games=1)  # a main agent never resets


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 8), st.integers(0, 8)),
                max_size=20))
def test_the_payoff_table_counts_every_game_once_from_both_sides(batches):
    wins, games = torch.zeros(6, 6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)
    total = 0
    for a, b, won, lost in batches:
        scores = torch.cat([torch.ones(won), torch.zeros(lost)])
        wins, games = record_games(wins, games, a, b, scores)
        total += won + lost
    off = ~torch.eye(6, dtype=torch.bool)
    assert torch.equal(games, games.T)
    assert torch.equal((wins + wins.T)[off], games[off])
    assert float(games[off].sum() / 2 + games.diagonal().sum()) == total
    rates = win_rates(wins, games)
    assert bool(((rates >= 0) & (rates <= 1)).all()) and bool((rates[games == 0] == 0.5).all())
