"""An AlphaStar league in small (seed 002): main agents, main exploiters and league exploiters, each its own
learner, trained side by side; opponents matched by win rate.

Every *active* player is a :class:`orchestration.trainer.Trainer` of its own (any backend; on Ray each has its
learner actor and rollout workers, and with ``LeagueConfig.parallel`` their iterations run at the same time)
over the same two-player zero-sum env: the player's policy takes seat ``LeagueConfig.seat``, a frozen
``opponent`` policy the other seat. Before each iteration every active player picks its opponent by its role
(:func:`core.matchmaking.choose_opponent`): a current main agent (whose weights are frozen into the opponent
slot for that iteration) or a *historical* player (a snapshot of some active player). Its games of the
iteration then update the payoff table and both players' Elo ratings (:mod:`core.ratings`; the iteration's games
against one opponent count as one match scored by their mean).

Snapshots: every ``snapshot_every`` iterations each active player joins the league as a historical player.
An exploiter that beats its targets (``exploiter_threshold`` over at least ``exploiter_min_games`` games) is
snapshotted at once (the snapshot keeps its rating), its record in the payoff table starts over (its row and
column: being done again takes new games; :meth:`table`'s ``games`` still counts every game played), and it starts
over from its initial weights and the initial rating (a main exploiter always; a league exploiter with
probability ``league_reset``) through :meth:`Trainer.reset_learner`, so its counters and inbox go on.
The league starts with the main agents' initial weights as its first historical players.

Usage (what ``shoal league`` does)::

    league = RoleLeague(TrainConfig(env="pettingzoo:classic.connect_four_v3", backend="ray"),
                        LeagueConfig(main_agents=1, main_exploiters=1, league_exploiters=1))
    while league.iteration < 50:
        metrics = league.train()          # rating/<player>, win_rate/<player>, opponent/<player>, ...
    league.close()

Metrics per active player ``P``: ``rating/P`` (Elo), ``win_rate/P`` (this iteration, draws count a half),
``games/P``, ``opponent/P`` (the opponent's player index), ``episode_return_mean/P`` and the player's fragment
accounting (``fragments_produced/P`` = accepted + stale + lost + in flight, ``env_steps_trained/P``); ``league/size``,
``league/resets``, ``time_iteration`` (wall seconds); ``rating/<historical>`` for every snapshot.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from tensordict import TensorDictBase

from core.matchmaking import ROLES, Roster, choose_opponent, exploiter_done, grow, record_games
from core.ratings import INITIAL, MATCH_K, elo_update, score_from_return
from core.specs import groups, to_json
from orchestration.config import PastSelvesConfig, TrainConfig
from orchestration.league_config import LeagueConfig
from orchestration.signals import deferred_interrupts

OPPONENT = "opponent"


@dataclass
class Player:
    """One player of the league: active (it learns; ``weights`` None) or historical (frozen ``weights``)."""

    name: str
    role: str
    parent: int
    weights: TensorDictBase | None = None

    @property
    def historical(self) -> bool:
        return self.weights is not None


def two_player_group(tree, env: str) -> tuple[str, tuple[str, str]]:
    """The tree's zero-sum group of two agents and their names; a named error for any other env."""
    found = [(name, spec.agent_names) for name, spec in groups(tree).items()
             if spec.payoff == "zero_sum" and len(spec.agent_names) == 2]
    if len(groups(tree)) != 1 or not found:
        shapes = {name: (spec.payoff, len(spec.agent_names)) for name, spec in groups(tree).items()}
        raise ValueError(f"a league needs a two-player zero-sum game with one group of two agents (e.g. "
                         f"pettingzoo:classic.connect_four_v3); env {env!r} has groups {shapes} (payoff, agents)")
    return found[0][0], tuple(found[0][1])


class RoleLeague:
    """The league: active players (their trainers), historical players, payoff table and ratings.

    Args:
        config: the run, as for one trainer (env, backend, rollout, PPO, policy); each active player trains
            with it, seeded ``config.seed + 1000 * index``.
        league: roles, snapshot and reset rules.
        tree: the env's tree when the caller has it already (else probed from one env).
        build: builds a trainer from a config (default :func:`orchestration.builder.build_trainer`).
    """

    def __init__(self, config: TrainConfig, league: LeagueConfig, *, tree=None,
                 build: Callable[[TrainConfig], Any] | None = None) -> None:
        from orchestration.builder import build_trainer

        if config.collection is not None or config.env == "external":
            raise ValueError("a league trains on one env (--env); environment collections and external "
                             "simulators are not supported by shoal league")
        if config.policy_mapping or config.fixed_policies:
            raise ValueError("shoal league sets the policy mapping itself (each player against a frozen "
                             "opponent); drop --policy-mapping and --fixed-policies")
        if tree is None:
            from orchestration.envs import make_run_env

            probe = make_run_env(config, 1)
            tree = probe.tree
            probe.close()
        self.group, agents = two_player_group(tree, config.env)
        self.config, self.league = config, league
        self.parallel = league.parallel and config.backend == "ray"
        build = build or build_trainer
        mapping = ((agents[1 - league.seat], OPPONENT),)
        self.trainers: list[Any] = []
        self._shutdown, each = None, config
        if config.backend == "ray":  # room for every player's actors at once, or they would wait for ever
            from orchestration.ray_session import init_ray_for

            self._shutdown, each = init_ray_for(config, len(league.roles))
        try:
            for i, role in enumerate(league.roles):
                self.trainers.append(build(dataclasses.replace(  # its opponents are the league's players: no
                    each, seed=config.seed + 1000 * i, policy_mapping=mapping, fixed_policies=(OPPONENT,),
                    eval_every=0, run_dir="", past_selves=PastSelvesConfig())))  # past selves (never used here)
        except BaseException:
            self.close()
            raise
        counts: dict[str, int] = {}
        self.players: list[Player] = []
        for i, role in enumerate(league.roles):
            self.players.append(Player(f"{role}_{counts.get(role, 0)}", role, i))
            counts[role] = counts.get(role, 0) + 1
        self._initial = [copy.deepcopy(t.learners[self.group].state()) for t in self.trainers]
        """Each active player's first learner state (a copy: a local learner's state shares its tensors' memory):
        what an exploiter starts over from."""
        size = len(self.players)
        self.wins = torch.zeros(size, size, dtype=torch.float64)
        self.games = torch.zeros(size, size, dtype=torch.float64)
        self.ratings = torch.full((size,), INITIAL, dtype=torch.float64)
        self.played = torch.zeros(size, dtype=torch.float64)
        """Every game each player played (the payoff table starts an exploiter's record over when it is done)."""
        self.iteration = 0
        for i, role in enumerate(league.roles):
            if role == "main":
                self._add_snapshot(i)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.resets = 0
        self.mid_iteration = False
        """Whether opponents were drawn for an iteration that has not ended (a checkpoint taken then resumes it
        with new draws: not bit for bit)."""
        self.finished: dict[int, dict[str, Any]] = {}
        """The players that finished the current iteration, by index: ``{"opponent", "scores", "metrics"}``,
        recorded in the table when the iteration's bookkeeping runs (non-empty only after an interrupt)."""

    # -- the roster ------------------------------------------------------------------------------------
    @property
    def roster(self) -> Roster:
        return Roster(role=torch.tensor([ROLES.index(p.role) for p in self.players]),
                      historical=torch.tensor([p.historical for p in self.players]),
                      parent=torch.tensor([p.parent for p in self.players]))

    def weights_of(self, index: int) -> TensorDictBase:
        """A player's weights: a historical player's frozen ones, an active player's newest."""
        player = self.players[index]
        return player.weights if player.historical else self.trainers[index].learners[self.group].weights()[1]

    def _add_snapshot(self, index: int) -> int:
        """Freezes player ``index``'s weights as a historical player ``<name>@<league iteration>`` (not its weights'
        version: a reset moves that past the iteration); returns its index."""
        weights = self.trainers[index].learners[self.group].weights()[1]
        name, taken, again = f"{self.players[index].name}@{self.iteration}", {p.name for p in self.players}, 1
        while name in taken:  # a league saved when names were versions (a reset moved those past the iteration)
            again += 1
            name = f"{self.players[index].name}@{self.iteration}.{again}"
        self.players.append(Player(name, self.players[index].role, index, weights.detach().clone()))
        size = len(self.players)
        self.wins, self.games = grow(self.wins, size), grow(self.games, size)
        self.ratings = torch.cat([self.ratings, self.ratings[index:index + 1]])  # starts at its parent's rating
        self.played = torch.cat([self.played, self.played.new_zeros(1)])
        return size - 1

    # -- one iteration ---------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Matchmaking, one iteration of every active player against its opponent, then the bookkeeping.

        Each player's games are kept as its iteration ends (:attr:`finished`), so an interrupt loses none: a
        player that finished an interrupted iteration is saved so, sits the resumed one out, and its games,
        rating change and metrics count in that iteration's bookkeeping with the others'."""
        start = time.perf_counter()
        active = [i for i, t in enumerate(self.trainers) if t.iteration <= self.iteration]
        roster = self.roster
        picks = {i: choose_opponent(i, roster, self.wins, self.games, self.generator, self.league.self_play)
                 for i in active}
        self.mid_iteration = True
        for i, (opponent, _) in picks.items():  # frozen now, whatever the opponent learns meanwhile
            self.trainers[i].set_weights(OPPONENT, self.weights_of(opponent).detach().clone())
        if self.parallel:  # each trainer waits on its own Ray actors: the threads only wait
            futures: dict[int, Future] = {}
            try:
                with ThreadPoolExecutor(max_workers=max(1, len(active))) as pool:
                    for i in active:
                        futures[i] = pool.submit(self.trainers[i].train)
            finally:  # an interrupt: the players still training finish their iteration, and all that did count
                running = [self.players[i].name for i, future in futures.items() if not future.done()]
                if running:
                    print(f"shoal league: interrupted; finishing the iteration of {', '.join(running)} first (their "
                          f"games are kept)", file=sys.stderr, flush=True)
                    with deferred_interrupts():  # a second Ctrl-C would save them mid-iteration
                        wait(futures.values())
                for i, future in futures.items():
                    if not future.cancelled() and future.exception() is None:
                        self._finish(i, picks[i], future.result())
            for future in futures.values():
                future.result()  # a player's error, raised once every finished player is kept
        else:
            for i in active:
                self._finish(i, picks[i], self.trainers[i].train())
        self.iteration += 1
        self.mid_iteration = False
        metrics: dict[str, float] = {"iteration": float(self.iteration)}
        before = self.ratings.clone()
        a, b, scores = [], [], []
        for i, done in sorted(self.finished.items()):
            got = torch.tensor(done["scores"], dtype=torch.float64)
            self.wins, self.games = record_games(self.wins, self.games, i, done["opponent"], got)
            self.played[list({i, done["opponent"]})] += got.numel()
            if done["opponent"] != i and got.numel():  # games against a frozen copy of itself move no rating
                a.append(i)
                b.append(done["opponent"])
                scores.append(float(got.mean()))
            metrics.update(done["metrics"])
        self.finished = {}
        if a:  # one rating period: each player's games of the iteration count as one match scored by their mean
            # (per-game updates summed over a period of ~100 games against one opponent overshoot and oscillate)
            self.ratings = elo_update(before, torch.tensor(a), torch.tensor(b),
                                      torch.tensor(scores, dtype=torch.float64), k=MATCH_K)
        for i in range(len(self.trainers)):
            self._checkpoint_rules(i)
        metrics.update({f"rating/{p.name}": float(r) for p, r in zip(self.players, self.ratings)})
        metrics.update({"league/size": float(len(self.players)), "league/resets": float(self.resets),
                        "env_steps": float(sum(t.env_steps for t in self.trainers)),
                        "time_iteration": time.perf_counter() - start})
        return metrics

    def _finish(self, i: int, pick: tuple[int, str], result: Mapping[str, float]) -> None:
        """Keeps player ``i``'s iteration as it ends: its opponent, game scores and metrics (plain data, so a
        checkpoint taken before the others finish holds them)."""
        opponent, why = pick
        trainer, name = self.trainers[i], self.players[i].name
        got = score_from_return(torch.tensor(trainer.last_episodes.get(f"return/{self.group}", []),
                                             dtype=torch.float64))
        metrics = {f"win_rate/{name}": float(got.mean()) if got.numel() else float("nan"),
                   f"games/{name}": float(got.numel()), f"opponent/{name}": float(opponent),
                   f"episode_return_mean/{name}": float(result.get(f"episode_return_mean/{self.group}",  # its seat's
                                                                   float("nan"))),  # (both seats' sum to 0)
                   f"env_steps/{name}": float(trainer.env_steps), f"matched/{name}/{why}": 1.0}
        metrics.update({f"{key.rsplit('/', 1)[-1]}/{name}": float(value) for key, value in result.items()
                        if key.startswith(("fragments_", f"{self.group}/fragments_", f"{self.group}/env_steps_t"))})
        self.finished[i] = {"opponent": int(opponent), "scores": got.tolist(), "metrics": metrics}

    def _checkpoint_rules(self, i: int) -> None:
        """Snapshots on the schedule; an exploiter that beat its targets is snapshotted and may start over."""
        role = self.players[i].role
        done = exploiter_done(i, self.roster, self.wins, self.games, threshold=self.league.exploiter_threshold,
                              min_games=self.league.exploiter_min_games)
        if done or self.iteration % self.league.snapshot_every == 0:
            self._add_snapshot(i)
        if not done:
            return
        for table in (self.wins, self.games):  # its record starts over: being done again takes new games
            table[i].zero_()
            table[:, i].zero_()
        coin = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        if role == "main_exploiter" or coin < self.league.league_reset:
            self.trainers[i].reset_learner(self.group, self._initial[i])
            self.ratings[i] = INITIAL  # its initial weights again: a new player (its snapshot keeps the rating)
            self.resets += 1

    # -- state, snapshots ----------------------------------------------------------------------------------
    def table(self) -> dict[str, Any]:
        """The league as plain data: players (name, role, historical, rating, ``games``: every game played,
        ``games_in_table``: those in the payoff table, since the player's or its opponents' records last started
        over) and the win-rate table (the payoff table's)."""
        from core.matchmaking import win_rates

        rates = win_rates(self.wins, self.games)
        return {"players": [{"name": p.name, "role": p.role, "historical": p.historical, "rating": float(r),
                             "games": float(self.played[i]), "games_in_table": float(self.games[i].sum())}
                            for i, (p, r) in enumerate(zip(self.players, self.ratings))],
                "win_rates": rates.tolist()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """``(weights, tensors, json)`` of the league itself, in :func:`orchestration.checkpoint.save_checkpoint`'s
        format (each active player's trainer is checkpointed on its own): historical players' weights
        ``pool/<index>/<key>``, the payoff table, ratings and generator, the roster and both configs."""
        from orchestration.run_state import config_to_dict

        tensors = {f"pool/{i}/{'/'.join(k) if isinstance(k, tuple) else k}": v
                   for i, p in enumerate(self.players) if p.historical for k, v in p.weights.items(True, True)}
        tensors.update(wins=self.wins, games=self.games, ratings=self.ratings, played=self.played,
                       rng=self.generator.get_state())
        state = {"config": config_to_dict(self.config), "tree": to_json(self.trainers[0].tree),
                 "iteration": self.iteration, "env_steps": sum(t.env_steps for t in self.trainers),
                 "learners": {p.name: {"version": int(t.learners[self.group].published()[0])}
                              for p, t in zip(self.players, self.trainers)},
                 "finished": {str(i): done for i, done in self.finished.items()}, "mid_iteration": self.mid_iteration,
                 "league": {"config": dataclasses.asdict(self.league), "resets": self.resets,
                            "players": [{"name": p.name, "role": p.role, "parent": p.parent, "historical": p.historical}
                                        for p in self.players]}}
        return {}, tensors, state

    def load_state_(self, weights: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                    state: Mapping[str, Any]) -> None:
        """Restores :meth:`state` into a league built with the same configs (its players' trainers are restored
        from their own checkpoints). Raises ValueError naming the players when the rosters differ."""
        saved = state["league"]["players"]
        active = [(p["name"], p["role"]) for p in saved if not p["historical"]]
        if active != [(p.name, p.role) for p in self.players[:len(self.trainers)]]:
            raise ValueError(f"the checkpoint's league has active players {active}; this league has "
                             f"{[(p.name, p.role) for p in self.players[:len(self.trainers)]]} (same --league.* "
                             f"flags as the run being resumed)")
        template = self.weights_of(0).detach()
        self.players = []
        for i, p in enumerate(saved):
            frozen = None
            if p["historical"]:
                frozen = template.clone()
                for key in frozen.keys(True, True):
                    frozen.set(key, tensors[f"pool/{i}/{'/'.join(key) if isinstance(key, tuple) else key}"].clone())
            self.players.append(Player(p["name"], p["role"], int(p["parent"]), frozen))
        self.wins, self.games = tensors["wins"].clone(), tensors["games"].clone()
        self.ratings = tensors["ratings"].clone()
        self.played = tensors["played"].clone() if "played" in tensors else self.games.sum(1)  # older checkpoints
        n = len(self.players)  # tables of another roster fail later, mid-training: refused here, by name
        for name, table, shape in (("wins", self.wins, (n, n)), ("games", self.games, (n, n)),
                                   ("ratings", self.ratings, (n,)), ("played", self.played, (n,))):
            if tuple(table.shape) != shape:
                raise ValueError(f"its {name!r} table is {tuple(table.shape)}, and its {n} players need {shape}")
        self.generator.set_state(tensors["rng"])
        self.iteration, self.resets = int(state["iteration"]), int(state["league"]["resets"])
        active = [p.name for p in self.players[:len(self.trainers)]]
        self.finished = finished_from_json(state.get("finished", {}), active, len(self.players))
        self.mid_iteration = bool(state.get("mid_iteration", True))  # older checkpoints: assume the worse

    def close(self) -> None:
        """Closes every player's trainer, then the Ray instance if the league started it."""
        try:
            for trainer in reversed(self.trainers):
                trainer.close()
        finally:
            if self._shutdown is not None:
                self._shutdown()
                self._shutdown = None


def finished_from_json(data: Any, names: list[str], size: int) -> dict[int, dict[str, Any]]:
    """:attr:`RoleLeague.finished` read back from a checkpoint's JSON, its types checked (a checkpoint is data:
    a wrong one is refused with the entry at fault, never trusted). ``names``: the active players', by index;
    ``size``: the number of players (active and historical)."""
    def bad(where: str) -> ValueError:
        return ValueError(f"the league checkpoint's 'finished' {where} is not an interrupted iteration's record "
                          f"(an active player's index, its opponent's index, game scores in [0, 1] and that "
                          f"player's numeric metrics)")

    if not isinstance(data, dict):
        raise bad("table")
    out = {}
    for key, done in data.items():
        if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,6}", key) and int(key) < len(names)
                and isinstance(done, dict)):
            raise bad(f"entry {key!r}")
        opponent, scores, metrics = done.get("opponent"), done.get("scores"), done.get("metrics")
        mine = f"/{names[int(key)]}"
        if not (type(opponent) is int and 0 <= opponent < size and isinstance(scores, list)
                and all(type(x) in (int, float) and 0.0 <= x <= 1.0 for x in scores) and isinstance(metrics, dict)
                and all(isinstance(k, str) and (k.endswith(mine) or f"{mine}/" in k) and type(v) in (int, float)
                        for k, v in metrics.items())):
            raise bad(f"entry {key!r}")
        out[int(key)] = {"opponent": opponent, "scores": [float(x) for x in scores],
                         "metrics": {k: float(v) for k, v in metrics.items()}}
    return out


def progress_line(metrics: Mapping[str, float]) -> str:
    """A one-line summary of an iteration's ratings and win rates (the CLI's progress line)."""
    rating = {k.split("/", 1)[1]: round(v) for k, v in metrics.items() if k.startswith("rating/") and "@" not in k}
    wins = {k.split("/", 1)[1]: round(v, 2) for k, v in metrics.items() if k.startswith("win_rate/")}
    return f"iteration {int(metrics['iteration'])}: rating {rating} win rate {wins} size {int(metrics['league/size'])}"


__all__ = ["LeagueConfig", "OPPONENT", "Player", "RoleLeague", "progress_line", "two_player_group"]
