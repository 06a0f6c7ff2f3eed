"""``shoal evaluate``: play a checkpoint's policies for some episodes and print their returns (or, against an
opponent, win/draw/loss rates per seat; with ``--video``, one video per episode).

    shoal evaluate runs/RUN/checkpoints --episodes 20
    shoal evaluate runs/RUN/checkpoints --opponent random --seats player_0
    shoal evaluate runs/RUN/checkpoints --video videos/

Imports stay light at module level (``shoal evaluate --help`` answers at once): torch and the rest when it runs.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import tyro

from orchestration.result_line import print_result


def evaluate(checkpoint: tyro.conf.Positional[str], episodes: int = 10, num_envs: int = 4,
             env: str | None = None, env_kwargs: tuple[tuple[str, str], ...] = (), threads: int = 1,
             opponent: str | None = None, seats: tuple[str, ...] = (), sample: bool = False,
             video: str | None = None, seed: int | None = None) -> float:
    """Plays ``episodes`` episodes with the deterministic policies of ``checkpoint``; prints the mean return
    and its standard deviation. With ``--opponent``: plays each seat against it and prints win/draw/loss rates
    with 95% intervals per seat (:mod:`orchestration.matches`). With ``--video DIR``: plays the episodes in one
    env that renders ``rgb_array`` frames and writes one video per episode into ``DIR``, as MP4 when the
    video extra is installed (``pip install 'shoal[video]'``), else as animated GIFs (:mod:`orchestration.videos`).
    A checkpoint of a run on an environment collection plays ``episodes`` episodes in each of its evaluation
    envs and prints the means over all of them plus per env (``eval_return_mean/env:<id>``); the stored
    collection document never imports code (``module:factory`` members are refused: pass ``--env``).

    Args:
        checkpoint: a checkpoint directory, or a run's ``checkpoints`` directory or the run's own directory (its
            newest checkpoint).
        episodes: episodes to play (per seat with ``--opponent``).
        num_envs: envs stepped together.
        env: the env to play in, instead of the checkpoint's env or collection (default: the checkpoint's,
            unless naming it would import a module: an env read from a checkpoint never imports code).
        env_kwargs: the env's keyword arguments as ``NAME VALUE`` pairs (``--env-kwargs delay 8``), as for
            ``shoal train``: for the checkpoint's own env, on top of the checkpoint's (given ones win); for
            another ``--env``, alone.
        threads: torch CPU threads (1 is fastest for small networks on a shared machine).
        opponent: ``random``, a scripted player ``scripted:MODULE:FUNCTION`` (:mod:`orchestration.scripted`),
            another checkpoint (same tree) or a league snapshot (``league/pool/NAME``) playing every seat but the
            evaluated one.
        seats: the agents the checkpoint plays, one at a time (default: every agent).
        sample: the checkpoint's policy samples instead of acting with its mode (the opponent always samples).
        video: a directory to write a video of every episode into (one env, whatever ``num_envs`` says).
        seed: the evaluation's seed: its envs' and any sampling's (default: the run's). The same checkpoint,
            seed and ``num_envs`` play the same episodes; another seed or ``num_envs`` other ones.
    """
    import statistics

    import torch

    from core.specs import from_json
    from orchestration.builder import assignment_for, build_evaluator, build_policies
    from orchestration.checkpoint import load_checkpoint
    from orchestration.collection_driver import evaluate_members
    from orchestration.env_collection import load_collection, member_config
    from orchestration.checkpoint_trust import refuse_untrusted
    from orchestration.run_state import load_config, load_policy_weights_

    for flag, value in (("--episodes", episodes), ("--num-envs", num_envs), ("--threads", threads)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if seats and opponent is None:
        raise ValueError(f"--seats {' '.join(seats)} chooses the seats the checkpoint plays against --opponent; "
                         f"without one it plays every agent: add --opponent random (or a checkpoint), or drop --seats")
    if len(set(seats)) < len(seats):
        raise ValueError(f"--seats names {sorted({s for s in seats if seats.count(s) > 1})} twice: name each seat once")
    if video is not None and opponent is not None:
        raise ValueError("--video records the evaluation of one checkpoint; it does not combine with --opponent")
    torch.set_num_threads(threads)
    weights, _, state = load_checkpoint(checkpoint)
    if "league" in state:  # the league's own checkpoint holds its pool and table, not a player to play
        from orchestration.checkpoint import league_players_hint

        raise ValueError(f"{checkpoint} is a league's own checkpoint (its pool, payoff table and ratings), not a "
                         f"player's{league_players_hint(checkpoint)}")
    config = load_config(state)
    config = config if seed is None else dataclasses.replace(config, seed=seed)
    if env is None and config.env == "external":
        raise ValueError(f"{checkpoint} is of a run on external simulators, which Shoal cannot start to play: "
                         f"name an env with their observations and actions to play in (--env ID)")
    refuse_untrusted(config, ["--env"] if env is not None else [], f"shoal evaluate {checkpoint}", evaluating=True)
    if env is None and env_kwargs and config.collection:
        raise ValueError("--env-kwargs: this checkpoint was trained on a collection, whose envs keep their own "
                         "keyword arguments; name the env to play in with --env too")
    if env is not None or env_kwargs:  # it replaces the checkpoint's env (and collection): is its tree the same?
        trained_on = "its collection's envs" if config.collection else config.env
        new_env = config.env if env is None else env
        kwargs = tuple(map(tuple, env_kwargs))  # the checkpoint's env: on top of its own (they win)
        kwargs = kwargs if new_env != config.env else tuple({**dict(config.env_kwargs), **dict(kwargs)}.items())
        given = dataclasses.replace(config, env=new_env, env_kwargs=kwargs, collection=None)
        if (trained_on, config.env_kwargs) != (new_env, kwargs):
            _check_same_tree(given, state["tree"], trained_on if trained_on != new_env or not config.env_kwargs
                             else f"{trained_on} with {' '.join(f'{k} {v}' for k, v in config.env_kwargs)}")
        config = given
    if opponent is not None:
        from orchestration.matches import play_seats

        per_seat = play_seats(checkpoint, opponent, episodes=episodes, seats=tuple(seats), env=config.env,
                              num_envs=num_envs, sample=sample, seed=config.seed)
        print_result({"checkpoint": str(checkpoint), "opponent": opponent, "seats": per_seat})
        return min((r["win"] for r in per_seat.values() if "win" in r), default=math.nan)
    tree = from_json(state["tree"])
    assignment = assignment_for(config, tree)
    policies, fixed = build_policies(config, tree, assignment)
    for pid, policy in policies.items():
        load_policy_weights_(policy, weights, pid)
    def summarize(returns) -> dict[str, float]:
        out = {}
        for key, values in returns.items():
            out[key.replace("return", "eval_return_mean", 1)] = sum(values) / max(len(values), 1)
            out[key.replace("return", "eval_return_std", 1)] = statistics.pstdev(values) if values else math.nan
        return out

    videos = None
    if video is None:
        # a collection's document, as the checkpoint stores it, never imports code (load_collection refuses it)
        collection = load_collection(config)
        actor = build_evaluator(config, policies, assignment, fixed, num_envs=num_envs)
        if collection is None:
            results = summarize(actor.run_episodes(episodes))
        else:  # every evaluation env: overall means plus ``/env:<id>`` ones
            results = evaluate_members(actor, collection.evaluation_ids(), episodes, summarize)
    else:
        from orchestration.videos import record_episodes

        collection = load_collection(config)
        if collection is None:
            returns, videos = record_episodes(config, policies, assignment, fixed, episodes=episodes, out_dir=video)
        else:  # each evaluation env of the collection, filmed into DIR/<env id>/
            returns, videos = {}, []
            for env_id in collection.evaluation_ids():
                got, paths = record_episodes(member_config(config, collection, env_id), policies, assignment,
                                             fixed, episodes=episodes, out_dir=Path(video) / env_id)
                videos += paths
                for key, values in got.items():
                    returns.setdefault(key, []).extend(values)
                    returns.setdefault(f"{key}/env:{env_id}", []).extend(values)
        results = summarize(returns)
    print_result({"checkpoint": str(checkpoint), "episodes": episodes, **results,
                  **({"videos": [str(v) for v in videos]} if videos is not None else {})})
    return results["eval_return_mean"]


def _check_same_tree(config, saved_tree: str, trained_on: str) -> None:
    """Raises ValueError naming ``--env`` and the first difference unless its tree is the checkpoint's."""
    import json

    from adapters.external.messages import tree_difference
    from core.specs import to_json
    from orchestration.envs import make_run_env

    probe = make_run_env(config, 1)
    try:
        tree = to_json(probe.tree)
    finally:
        probe.close()
    if tree != saved_tree:
        kwargs = " ".join(f"{k} {v}" for k, v in config.env_kwargs)
        where = tree_difference(json.loads(tree), json.loads(saved_tree), here=f"in {config.env}"
                                + (f" with {kwargs}" if kwargs else ""), there=f"in {trained_on}")
        given = f" --env-kwargs {kwargs}" if kwargs else ""
        raise ValueError(f"--env {config.env}{given}: the checkpoint's policies were trained on {trained_on}, whose "
                         f"observations and actions differ: {where}")

