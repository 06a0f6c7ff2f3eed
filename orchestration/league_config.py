"""The league's settings (``shoal league --league.*``): kept apart from :mod:`orchestration.config` so that a
league's flags parse without importing torch, like every other config."""

from __future__ import annotations

from dataclasses import dataclass

from orchestration.config_kinds import check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class LeagueConfig:
    """An AlphaStar-style league in small (:mod:`orchestration.league_roles`; matchmaking in
    :mod:`core.matchmaking`)."""

    main_agents: int = 1
    """Main agents: play current main agents (self-play) and PFSP over every historical player; never reset."""
    main_exploiters: int = 1
    """Main exploiters: play the current main agents (or their past selves while they cannot beat them)."""
    league_exploiters: int = 1
    """League exploiters: PFSP over every historical player, to find what the whole league cannot handle."""
    snapshot_every: int = 5
    """Iterations between two snapshots of every active player added to the league as historical players."""
    self_play: float = 0.35
    """Probability that a main agent plays a current main agent rather than a historical player."""
    exploiter_threshold: float = 0.7
    """An exploiter whose win rate over its targets reaches this (with ``exploiter_min_games`` games) is
    snapshotted at once and starts over (a main exploiter always, a league exploiter with ``league_reset``)."""
    exploiter_min_games: int = 32
    """Games an exploiter must have played against its targets before its win rate counts."""
    league_reset: float = 0.25
    """Probability that a league exploiter starts over from its initial weights when it is snapshotted for
    beating the league (AlphaStar's 25%)."""
    seat: int = 0
    """The seat (agent index in the two-player group) every active player takes; the opponent takes the other."""
    parallel: bool = True
    """Train the active players at the same time (Ray backend: each has its own learner and rollout workers;
    the local backend always trains them one after the other in this process)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.main_agents < 1:
            raise ValueError(f"--league.main-agents must be >= 1 (got {self.main_agents}): exploiters exploit "
                             f"main agents")
        for name, least in (("main_exploiters", 0), ("league_exploiters", 0), ("snapshot_every", 1),
                            ("exploiter_min_games", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"--league.{name.replace('_', '-')} must be >= {least}, got {getattr(self, name)}")
        for name in ("self_play", "exploiter_threshold", "league_reset"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--league.{name.replace('_', '-')} is a probability in [0, 1], got "
                                 f"{getattr(self, name)}")
        if self.seat not in (0, 1):
            raise ValueError(f"--league.seat is 0 or 1 (a two-player game), got {self.seat}")

    @property
    def roles(self) -> tuple[str, ...]:
        """The active players' roles, main agents first (:data:`core.matchmaking.ROLES` names)."""
        return (("main",) * self.main_agents + ("main_exploiter",) * self.main_exploiters
                + ("league_exploiter",) * self.league_exploiters)


__all__ = ["LeagueConfig"]
