"""``shoal league``: an AlphaStar league in small from the command line (:mod:`orchestration.league_roles`).

    shoal league pettingzoo:classic.connect_four_v3 --iterations 50 --backend ray \\
        --league.main-agents 1 --league.main-exploiters 1 --league.league-exploiters 1

Every ``shoal train`` flag applies to every player (env, backend, rollout, PPO, policy, ``--preset``,
``--config-file``); ``--league.*`` flags set the roles and rules (``shoal league --help``). The run directory
gets ``metrics.csv`` (and the run's loggers) with one row per league iteration, each active player's
checkpoint under ``players/<name>/checkpoints`` (``shoal evaluate`` plays them, e.g. ``--opponent random``),
every historical player as a snapshot under ``league/pool/``, and ``league/league.json`` (players, ratings,
the win-rate table); the league's own checkpoint (pool, payoff table, ratings) goes to ``league/checkpoints``,
and ``run.json`` ends with each player's settled fragment accounting (``final_accounting``).

    shoal league --resume --run-dir runs/RUN [--iterations 100]   # continues from the newest league checkpoint

A resumed league rebuilds its players from the saved configs and loads each player's checkpoint of the same
iteration as the league's, so the league and its players go on from one consistent point. Ctrl-C (or SIGTERM)
ends the league after the iteration every player is in (exit 130 / 143, with a checkpoint); a second Ctrl-C stops
at once, except that players training on Ray finish their iteration first (a player that finished an iteration
cut short for the others keeps it and its games, and sits the next one out; a local player cut halfway through
its update is saved as it was).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import tyro

from orchestration.config import TrainConfig
from orchestration.flag_parsing import parse as parse_flags
from orchestration.league_config import LeagueConfig
from orchestration.result_line import print_result
from orchestration.signals import StopAfterIteration, deferred_interrupts


@dataclass(frozen=True)
class _LeagueFlags:
    league: LeagueConfig = field(default_factory=LeagueConfig)
    """The league's roles and rules."""


def split_league_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(train flags, --league.* flags)`` of a ``shoal league`` command line (an on/off flag such as
    ``--league.no-parallel`` takes no value: the word after it stays where it was)."""
    switches = {f"--league.{prefix}{f.name.replace('_', '-')}" for f in dataclasses.fields(LeagueConfig)
                if f.type in (bool, "bool") for prefix in ("", "no-")}
    rest, league = [], []
    it = iter(argv)
    for arg in it:
        if arg.startswith("--league."):
            league.append(arg)
            if "=" not in arg and arg.replace("_", "-") not in switches:
                value = next(it, None)
                if value is not None:
                    league.append(value)
        else:
            rest.append(arg)
    return rest, league


def parse(argv: Sequence[str]) -> tuple[TrainConfig, LeagueConfig, bool, tuple | None]:
    """The run's TrainConfig, the LeagueConfig, whether to show progress and, with ``--resume``, the league's
    checkpoint ``(weights, tensors, state)``; ``--help`` prints both flag sets."""
    from orchestration.cli import _defaults, _refuse_a_used_run_dir, _run_dir_from, _split_train_args
    from orchestration.run_notes import check_resumed, note_schedule, note_unused

    rest, league_args = split_league_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        try:
            tyro.cli(_LeagueFlags, args=["--help"], prog="shoal league (league flags)")
        except SystemExit:
            pass
    train_args, config_file, resume, progress, preset = _split_train_args(rest)
    default = _defaults(preset, config_file)
    league_default, checkpoint = LeagueConfig(), None
    if resume:
        named = _run_dir_from(train_args, default)
        if not named:
            raise ValueError("--resume continues a league: name its directory with --run-dir RUN")
        if resume == "auto":  # a supervisor's one command: the first start starts, every restart resumes
            resume = any((Path(named) / "league" / "checkpoints").glob("ckpt-*"))
    if resume and (Path(named) / "checkpoints").is_dir() and not (Path(named) / "league").is_dir():
        raise ValueError(f"{named} is a training run, not a league (it has no league/): continue it with "
                         f"shoal train --resume --run-dir {named}")
    if resume:
        from orchestration.checkpoint import load_checkpoint
        from orchestration.checkpoint_trust import refuse_untrusted
        from orchestration.run_state import load_config

        checkpoint = load_checkpoint(Path(named) / "league" / "checkpoints")
        state = checkpoint[2]
        if "league" not in state:
            raise ValueError(f"{named} holds no league checkpoint (shoal train --resume continues a training run)")
        saved = load_config(state)
        default = dataclasses.replace(saved, anneal_iterations=saved.schedule_iterations)  # the schedule goes on
        try:
            league_default = LeagueConfig(**state["league"]["config"])
        except TypeError as err:  # an edited checkpoint: an unknown setting, or no settings object
            raise ValueError(f"{named}/league/checkpoints: its league settings do not load ({err})") from None
        refuse_untrusted(saved, train_args, "shoal league --resume")  # nothing it names imports or runs code
    config = parse_flags("league", TrainConfig, args=train_args, default=default, prog="shoal league",
                         description="Train a league (shoal league --help lists the --league.* flags first).")
    league = parse_flags("league", _LeagueFlags, args=league_args, default=_LeagueFlags(league_default),
                         prog="shoal league").league
    if not resume and config.run_dir:
        _refuse_a_used_run_dir(config.run_dir, "league/checkpoints")
    note_unused("league", config, default if resume else None)
    if resume:
        check_resumed("league", default, config)
    if config.past_selves != default.past_selves:  # flags gave them (a preset's for self-play are not news)
        print("shoal league: --past-selves.* does not apply to a league, whose players play its players",
              file=sys.stderr)
    note_schedule("league", config, bool(resume))
    return config, league, progress, checkpoint


def run(argv: Sequence[str]) -> dict:
    """Parses, builds the league, trains ``config.iterations`` league iterations, writes its outputs."""
    from orchestration.user_errors import exit_if_users_mistake, user_errors

    with user_errors("league"):
        config, league_config, progress, checkpoint = parse(argv)
        import torch

        from orchestration.league_roles import RoleLeague
        from orchestration.run_loop import fresh_run_dir, release_run_dir, run_dir_held

        if not config.run_dir:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in config.env)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            config = dataclasses.replace(config, run_dir=str(fresh_run_dir(Path("runs") / f"league__{name}__{stamp}")))
        with run_dir_held(config.run_dir):  # one process per run directory: until the league ends, or this fails
            torch.set_num_threads(config.threads)
            league = RoleLeague(config, league_config)
            if checkpoint is not None:
                try:
                    restore_league_(league, Path(config.run_dir), checkpoint)
                except (RuntimeError, ValueError) as err:  # shapes that differ: name the settings that made them
                    league.close()
                    from orchestration.run_state import load_config, misfit

                    saved = load_config(checkpoint[2])  # with its schedule kept, as parse() resumed it: not a change
                    saved = dataclasses.replace(saved, anneal_iterations=saved.schedule_iterations)
                    raise misfit(err, saved, config) from None
                except BaseException:
                    league.close()
                    raise
    try:
        return train_league(league, config, progress, resume=checkpoint is not None)
    except (RuntimeError, ValueError) as err:  # the checkpoint is written; a user's mistake is one paragraph
        exit_if_users_mistake(err, "league", config.run_dir)
        raise
    finally:
        release_run_dir(config.run_dir)


def restore_league_(league, run_dir: Path, checkpoint: tuple) -> None:
    """Loads the league's checkpoint and each player's checkpoint of the same iteration."""
    from orchestration.checkpoint import checkpoint_at, load_checkpoint
    from orchestration.run_state import restore_trainer_

    try:
        league.load_state_(*checkpoint)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as err:  # an edited or another league's
        raise ValueError(f"{run_dir / 'league' / 'checkpoints'}: the league's state does not load "
                         f"({type(err).__name__}: {err})") from None
    paired = checkpoint[2].get("player_checkpoints", {})  # the player checkpoints this league checkpoint saved
    for player, trainer in zip(league.players, league.trainers):
        root = run_dir / "players" / player.name / "checkpoints"
        name = paired.get(player.name) if isinstance(paired, dict) else None
        if isinstance(name, str) and re.fullmatch(r"ckpt-[0-9]{6}(\.[0-9]{1,6})?", name):  # a name, never a path
            restore_trainer_(trainer, *load_checkpoint(root / name))
        else:  # a league checkpoint of an older Shoal: the player's newest of the same iteration
            restore_trainer_(trainer, *load_checkpoint(checkpoint_at(root, league.iteration)))


def train_league(league, config: TrainConfig, progress: bool = True, resume: bool = False) -> dict:
    """The loop of ``shoal league``: metrics every iteration, checkpoints every ``checkpoint_every`` and last."""
    from orchestration.league_roles import progress_line
    from orchestration.metrics_log import MetricsLog
    from orchestration.run_loop import exit_stopped, record_final_accounting, write_provenance
    from orchestration.run_state import config_to_dict

    run_dir = Path(config.run_dir)
    saved_at, trained, stopped = None, 0, None
    why = [*(["opponents are drawn again for the players that had not finished the interrupted iteration"]
             if league.mid_iteration else []),  # the checkpoint was taken while an iteration ran
           *dict.fromkeys(gap for trainer in league.trainers for gap in trainer.resume_gaps)]
    if resume and league.iteration < config.iterations and why:
        print("shoal league --resume: this continuation is not bit-identical to an uninterrupted run: "
              + ", and ".join(why) + "; learners, optimizers, ratings and the payoff table are restored exactly.",
              file=sys.stderr)
    try:
        log = MetricsLog(run_dir, config=config, resume=resume, upto_iteration=league.iteration if resume else None,
                         upto_env_steps=sum(t.env_steps for t in league.trainers) if resume else None)
        (run_dir / "config.json").write_text(json.dumps({"train": config_to_dict(config),
                                                         "league": dataclasses.asdict(league.league)},
                                                        indent=1, default=str))
        write_provenance(run_dir, resume)
        # the first Ctrl-C ends the league after the current iteration of every player (none is saved halfway
        # through its update, which a resume would train again); a second one stops at once (players on Ray that
        # are training finish first). Leagues play internal envs: no collection waits for data to be given up.
        try:
            with StopAfterIteration() as stop:
                while league.iteration < config.iterations and stop.signal is None:
                    try:
                        metrics = league.train()
                    except BaseException:  # what was trained so far survives an env error or Ctrl-C
                        try:
                            with deferred_interrupts():  # a second Ctrl-C would leave the checkpoint unwritten
                                save_league(league, run_dir)
                        except Exception as err:  # noqa: BLE001 -- reported; the original error propagates
                            print(f"shoal league: could not write a checkpoint after the error ({err})",
                                  file=sys.stderr)
                        raise
                    trained += 1
                    log.write(int(metrics["env_steps"]), metrics)
                    if progress:  # on stderr: stdout is the result line alone
                        print(progress_line(metrics), file=sys.stderr, flush=True)
                    if config.checkpoint_every and league.iteration % config.checkpoint_every == 0:
                        written, saved_at = save_league(league, run_dir), league.iteration
                stopped = stop.signal
        finally:
            log.close()
        if not trained:  # a resumed league at --iterations already: its checkpoints stay as they are
            print(f"shoal league: the league is at iteration {league.iteration} already (--iterations "
                  f"{config.iterations}); nothing was trained (raise --iterations to train on)", file=sys.stderr)
            written = league_paths(league, run_dir)
        elif saved_at != league.iteration:
            written = save_league(league, run_dir)
    finally:
        league.close()
    record_final_accounting(run_dir, {p.name: t.accounting() for p, t in zip(league.players, league.trainers)})
    table = league.table()
    summary = {"run_dir": str(run_dir), "iterations": league.iteration, **written,
               "ratings": {p["name"]: round(p["rating"], 1) for p in table["players"]}}
    if stopped is not None:  # as shoal train: no result line for a run that did not end
        exit_stopped("league", stopped, league.iteration, run_dir)
    print_result(summary)
    return summary


def save_league(league, run_dir: Path) -> dict:
    """Each active player's checkpoint, every historical player as a snapshot, and ``league/league.json``."""
    import copy

    import torch
    from tensordict import TensorDict

    from orchestration.checkpoint import save_checkpoint
    from orchestration.run_state import trainer_state
    from orchestration.snapshots import save_snapshot

    # players' checkpoints are saved before the league's that names them: keep the ones the previous names too
    keep = league.config.keep_checkpoints and max(2, league.config.keep_checkpoints)
    paired = {}
    for player, trainer in zip(league.players, league.trainers):
        weights, tensors, state = trainer_state(trainer)
        paired[player.name] = save_checkpoint(run_dir / "players" / player.name / "checkpoints", league.iteration,
                                              weights=weights, tensors=tensors, state=state,
                                              keep=keep).name
    pool = run_dir / "league" / "pool"
    module = league.trainers[0].learners[league.group].policy if league.config.backend == "local" else None
    for i, player in enumerate(league.players):
        if not player.historical or (pool / player.name.replace("@", "-at-")).exists():
            continue
        if module is None:  # Ray: a local module of the policy's architecture to write the weights through
            from orchestration.builder import assignment_for, build_policies

            trainer = league.trainers[0]
            module = build_policies(trainer.config, trainer.tree, assignment_for(trainer.config, trainer.tree)
                                    )[0][league.group]
        policy = copy.deepcopy(module)
        with torch.no_grad():
            TensorDict.from_module(policy).update_(player.weights)
        save_snapshot(pool / player.name.replace("@", "-at-"), policy, league.trainers[0].tree, group=league.group,
                      policy_id=player.name, version=i, config=league.config.policy,
                      rating=float(league.ratings[i]))  # when saved, as LeagueTrainer.save_pool (league.json: now)
    weights, tensors, state = league.state()  # last: it names the iteration every player has a checkpoint of,
    state["player_checkpoints"] = paired  # and which one (a save cut short leaves newer ones of the same iteration)
    save_checkpoint(run_dir / "league" / "checkpoints", league.iteration, weights=weights, tensors=tensors, state=state,
                    keep=keep)
    (run_dir / "league" / "league.json").write_text(json.dumps({"iteration": league.iteration, **league.table()},
                                                               indent=1))
    return league_paths(league, run_dir)


def league_paths(league, run_dir: Path) -> dict:
    """Where a league's outputs are: each active player's checkpoints and the pool of historical players."""
    return {"players": {p.name: str(run_dir / "players" / p.name / "checkpoints")
                        for p in league.players[:len(league.trainers)]}, "pool": str(run_dir / "league" / "pool")}


def main(argv: Sequence[str]) -> int:
    """Entry of ``shoal league`` (see :mod:`orchestration.cli`)."""
    run(list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
