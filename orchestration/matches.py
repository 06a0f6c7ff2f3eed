"""Matches: a checkpoint's policy against an opponent, seat by seat (``shoal evaluate CKPT --opponent ...``).

For each seat (an agent of the tree), the checkpoint's policy plays that seat and the opponent plays every
other agent: ``random`` (uniform over legal actions), a scripted player ``scripted:MODULE:FUNCTION``
(:mod:`orchestration.scripted`), another checkpoint of the same tree (its learning policy), or a league's
snapshot (a historical player of ``league/pool/``). Results per seat: win, draw and loss rates with Wilson
95% intervals (zero-sum returns: win > 0, draw 0, loss < 0), plus the mean return and its spread; a seat whose
population is cooperative (a shared reward, no winner) gets the returns alone. The checkpoint's policy acts
with its mode unless ``sample``; the opponent always samples (two deterministic players would replay one game).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any

import torch

from core.specs import agent_index, from_json, groups
from orchestration.builder import assignment_for, build_evaluator, build_policies, is_fixed
from orchestration.checkpoint import load_checkpoint
from orchestration.run_state import load_config, load_policy_weights_

OPPONENT = "opponent"


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default); ``(0, 1)`` without trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def play_seats(checkpoint: str, opponent: str, *, episodes: int, seats: tuple[str, ...] = (), env: str,
               num_envs: int = 4, sample: bool = False, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Seat -> results (module docstring) of ``episodes`` games per seat.

    Raises:
        ValueError: an unknown seat (the tree's agents are named), an opponent checkpoint of another tree.
    """
    weights, _, state = load_checkpoint(checkpoint)
    config = dataclasses.replace(load_config(state), env=env, seed=seed, collection=None)  # games in ``env`` only
    tree = from_json(state["tree"])
    agents = list(agent_index(tree))
    if len(agents) < 2:
        raise ValueError(f"--opponent plays the other seats of a game, and env {env!r} has one agent "
                         f"({agents[0]!r}): evaluate it without --opponent")
    unknown = [s for s in seats if s not in agents]
    if unknown:
        raise ValueError(f"unknown seats {unknown}: the tree's agents are {agents}")
    other, scripted, snapshot = None, None, None
    if opponent.startswith("scripted:"):
        from orchestration.scripted import load_function

        scripted = load_function(opponent)
    elif (Path(opponent) / "snapshot.json").is_file():  # a league's historical player (league/pool/NAME)
        from core.specs import to_json
        from orchestration.snapshots import load_snapshot

        snapshot = load_snapshot(opponent)
        if to_json(snapshot.tree) != to_json(from_json(state["tree"])):
            raise ValueError(f"opponent snapshot {opponent!r} was saved from another tree than {checkpoint!r} "
                             f"(env {config.env}){_differ(to_json(snapshot.tree), state['tree'])}")
    elif opponent != "random":
        if not Path(opponent).exists():
            from core.envsets.ids import hint

            beside = Path(opponent).parent  # a misspelt snapshot or run: the nearest of its neighbours by name
            near = [p.name for p in beside.iterdir() if p.is_dir()] if beside.is_dir() and str(beside) != "." else []
            close = difflib.get_close_matches(Path(opponent).name, near, n=1)
            said = (f" (did you mean {str(beside / close[0])!r}?)" if close else
                    "" if len(Path(opponent).parts) > 1 else hint(opponent, ["random"]))
            raise ValueError(f"--opponent {opponent!r} is no checkpoint{said}: it takes "
                             f"random, scripted:MODULE:FUNCTION, a checkpoint directory or a league snapshot "
                             f"(league/pool/*)")
        other_weights, _, other_state = load_checkpoint(opponent)
        if other_state["tree"] != state["tree"]:
            raise ValueError(f"opponent checkpoint {opponent!r} (env {load_config(other_state).env}) was trained on "
                             f"another tree than {checkpoint!r} (env {config.env})"
                             f"{_differ(other_state['tree'], state['tree'])}")
        other = (other_weights, assignment_for(load_config(other_state), tree))
    out = {}
    for seat in seats or agents:
        foe = "random" if other is None and scripted is None and snapshot is None else OPPONENT
        seat_config = dataclasses.replace(
            config, policy_mapping=tuple((a, foe) for a in agents if a != seat),
            fixed_policies=(OPPONENT,) if foe == OPPONENT else ())
        assignment = assignment_for(seat_config, tree)
        policies, fixed = build_policies(seat_config, tree, assignment)
        if scripted is not None:
            from orchestration.scripted import ScriptedPolicy

            policies[OPPONENT] = ScriptedPolicy(policies[OPPONENT], scripted)
        if snapshot is not None:  # its own architecture, whatever the checkpoint's config says
            policies[OPPONENT] = copy.deepcopy(snapshot.policy)
        group, _ = agent_index(tree)[seat]
        mine = assignment[group].main_policy if assignment[group].single else _policy_of(assignment, group, seat,
                                                                                         agents, foe)
        load_policy_weights_(policies[mine], weights, checkpoint_policy(load_config(state), tree, seat))
        if other is not None:
            foe_seat = next(a for a in agents if a != seat)
            load_policy_weights_(policies[OPPONENT], other[0],
                                 checkpoint_policy(load_config(other_state), tree, foe_seat))
        deterministic = [] if sample else [mine]
        actor = build_evaluator(seat_config, policies, assignment, set(policies) - set(deterministic),
                                num_envs=num_envs)
        returns = torch.tensor(actor.run_episodes(episodes)[f"return/{mine}"], dtype=torch.float64)
        wins, draws = int((returns > 0).sum()), int((returns == 0).sum())
        n = len(returns)
        out[seat] = {"games": n, "return_mean": float(returns.mean()), "return_std": float(returns.std(correction=0))}
        if groups(tree)[group].payoff == "zero_sum":  # elsewhere (shared or general rewards) a positive return is
            # no win: the returns alone
            out[seat].update({"win": wins / n, "draw": draws / n, "loss": (n - wins - draws) / n,
                              "win_ci95": list(wilson_interval(wins, n))})
    return out


def _policy_of(assignment, group: str, seat: str, agents: list[str], foe: str) -> str:
    """The policy acting for ``seat`` in a group split between it and the opponent."""
    return next(p for p in assignment[group].policies if p != foe)


def checkpoint_policy(config, tree, seat: str) -> str:
    """The learning policy of a checkpoint that plays ``seat``: the one that played it in the run that wrote the
    checkpoint, or, where a fixed or random policy played it there (a league player's ``opponent`` slot, a run
    against ``random``), the one learning policy of its group.

    Raises:
        ValueError: no learning policy, or several, in the seat's group and none of them played the seat.
    """
    group, slot = agent_index(tree)[seat]
    assigned = assignment_for(config, tree)[group]
    played = next(pid for pid, slots in assigned.slots.items() if bool(slots[slot]))
    learning = [pid for pid in assigned.policies if not is_fixed(config, pid)]
    if played in learning:
        return played
    if len(learning) == 1:
        return learning[0]
    raise ValueError(f"seat {seat!r} was played by the fixed policy {played!r} in the checkpoint's run, and its "
                     f"group has {'no learning policy' if not learning else f'several: {learning}'} to play it "
                     f"instead: name the seats its learning policies played with --seats")


def _differ(opponents: str, checkpoints: str) -> str:
    """Where two trees (JSON) differ, and what an opponent may be instead."""
    from adapters.external.messages import tree_difference

    where = tree_difference(json.loads(opponents), json.loads(checkpoints), here="in the opponent's tree",
                            there="in the checkpoint's")
    return (f": {where}; play an opponent of the same env (its checkpoint, a league snapshot of it, random or "
            f"scripted:MODULE:FUNCTION)")


__all__ = ["checkpoint_policy", "play_seats", "wilson_interval"]
