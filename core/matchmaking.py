"""Matchmaking of a league by win rate (pure): AlphaStar's roles and prioritized fictitious self-play.

A league (Vinyals et al. 2019, "Grandmaster level in StarCraft II", its pseudocode's ``league`` module) holds
*active* players that learn, each with a role, and *historical* players: frozen snapshots of them. Before a
game, an active player picks its opponent from the payoff table by its role:

- ``main`` (main agent): with ``self_play`` probability it plays a current main agent (itself included),
  unless it wins less than ``0.3`` against that one, in which case it plays its own past selves by PFSP with
  the ``variance`` weighting (the ones it is about even with); otherwise PFSP (``squared``) over every
  historical player.
- ``main_exploiter``: plays a current main agent, unless it wins less than ``0.1`` against it: then the past
  selves of that main agent by PFSP (``variance``), which are easier to learn to beat.
- ``league_exploiter``: PFSP (``linear_capped``) over every historical player: it hunts the weaknesses of the
  whole league.

PFSP weights of a candidate with win rate ``x`` (the chooser's expected score against it): ``squared``
``(1 - x)^2`` favours the hardest opponents; ``variance`` ``x (1 - x)`` the even ones; ``linear_capped``
``min(0.5, 1 - x)``; ``uniform`` 1.

The payoff table: ``wins[i, j]`` (draws count a half) and ``games[i, j]``, ``[P, P]`` float64, both symmetric
in the sense ``wins[i, j] + wins[j, i] == games[i, j] == games[j, i]`` for ``i != j`` (the diagonal counts a
player's games against a frozen copy of itself from its own seat). A pair that has not played has win
rate 0.5. Randomness comes from a ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("main", "main_exploiter", "league_exploiter")
WEIGHTINGS = ("squared", "variance", "linear_capped", "uniform")


def win_rates(wins: torch.Tensor, games: torch.Tensor) -> torch.Tensor:
    """``wins / games`` elementwise, 0.5 where no game was played. Shapes: any, equal."""
    return torch.where(games > 0, wins / games.clamp(min=1e-12), torch.full_like(wins, 0.5))


def pfsp_weights(rates: torch.Tensor, weighting: str = "squared") -> torch.Tensor:
    """PFSP weights ``[N]`` of candidates with the chooser's win rates ``rates`` ``[N]`` (not normalised).
    All-zero weights (every candidate always beaten) become uniform: the draw must still pick someone."""
    if weighting == "squared":
        w = (1.0 - rates) ** 2
    elif weighting == "variance":
        w = rates * (1.0 - rates)
    elif weighting == "linear_capped":
        w = torch.clamp(1.0 - rates, max=0.5)
    elif weighting == "uniform":
        w = torch.ones_like(rates)
    else:
        raise ValueError(f"unknown PFSP weighting {weighting!r}; choose one of {WEIGHTINGS}")
    return w if bool((w > 0).any()) else torch.ones_like(rates)


def pfsp_draw(candidates: torch.Tensor, rates: torch.Tensor, weighting: str, generator: torch.Generator) -> int:
    """One index of ``candidates`` ``[N]`` (player indices, N >= 1), drawn with ``pfsp_weights(rates[candidates])``."""
    if candidates.numel() == 0:
        raise ValueError("no candidate opponent to draw from")
    w = pfsp_weights(rates[candidates].double(), weighting)
    return int(candidates[torch.multinomial(w, 1, generator=generator)])


@dataclass(frozen=True)
class Roster:
    """Who is who in the league, as tensors over ``P`` players.

    Fields:
        role: ``[P]`` int64, the index into :data:`ROLES` of each player (a historical player keeps the role
            of the active player it was taken from).
        historical: ``[P]`` bool, True for frozen snapshots.
        parent: ``[P]`` int64, the active player a snapshot was taken from (an active player: itself).
    """

    role: torch.Tensor
    historical: torch.Tensor
    parent: torch.Tensor


def choose_opponent(me: int, roster: Roster, wins: torch.Tensor, games: torch.Tensor, generator: torch.Generator,
                    self_play: float = 0.35) -> tuple[int, str]:
    """The opponent of active player ``me`` for its next games, and why (``"self_play"``, ``"pfsp"``,
    ``"exploit"``, ``"past_selves"`` or ``"exploit_past"``), by its role (module docstring)."""
    rates = win_rates(wins[me], games[me])
    role = ROLES[int(roster.role[me])]
    mains = torch.nonzero(~roster.historical & (roster.role == 0)).flatten()
    past = torch.nonzero(roster.historical).flatten()
    if role == "league_exploiter" or (role == "main" and past.numel() and
                                      float(torch.rand((), generator=generator, dtype=torch.float64)) >= self_play):
        if past.numel():
            return pfsp_draw(past, rates, "linear_capped" if role == "league_exploiter" else "squared",
                             generator), "pfsp"
        return pfsp_draw(mains, rates, "uniform", generator), "self_play"
    target = int(mains[torch.randint(mains.numel(), (), generator=generator)])
    threshold = 0.3 if role == "main" else 0.1
    own_past = torch.nonzero(roster.historical & (roster.parent == target)).flatten()
    if float(rates[target]) < threshold and games[me, target] > 0 and own_past.numel():
        return pfsp_draw(own_past, rates, "variance", generator), "past_selves" if role == "main" else "exploit_past"
    return target, "self_play" if role == "main" else "exploit"


def exploiter_done(me: int, roster: Roster, wins: torch.Tensor, games: torch.Tensor, *, threshold: float = 0.7,
                   min_games: int = 20) -> bool:
    """Whether an exploiter has beaten its targets (AlphaStar's checkpoint rule): a main exploiter, the current
    main agents; a league exploiter, every historical player; win rate over them >= ``threshold`` with at
    least ``min_games`` games counted. Main agents never reset: False."""
    role = ROLES[int(roster.role[me])]
    if role == "main":
        return False
    targets = (~roster.historical & (roster.role == 0)) if role == "main_exploiter" else roster.historical
    played = games[me][targets].sum()
    return bool(played >= min_games) and float(wins[me][targets].sum() / played) >= threshold


def record_games(wins: torch.Tensor, games: torch.Tensor, a: int, b: int, scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The payoff table after ``scores`` ``[G]`` (``a``'s scores in [0, 1]: win 1, draw 0.5) of games
    ``a`` vs ``b``. Returns new tensors."""
    n, won = float(scores.numel()), float(scores.double().sum())
    wins, games = wins.clone(), games.clone()
    wins[a, b] += won
    games[a, b] += n
    if a != b:  # against itself (a frozen copy of its current weights) only its own seat's score counts
        wins[b, a] += n - won
        games[b, a] += n
    return wins, games


def grow(table: torch.Tensor, players: int) -> torch.Tensor:
    """``table`` ``[P, P]`` padded with zeros to ``[players, players]``."""
    out = table.new_zeros(players, players)
    out[:table.shape[0], :table.shape[1]] = table
    return out


__all__ = ["ROLES", "Roster", "WEIGHTINGS", "choose_opponent", "exploiter_done", "grow", "pfsp_draw", "pfsp_weights",
           "record_games", "win_rates"]
