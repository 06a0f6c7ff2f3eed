"""The ``shoal`` command: ``train``, ``league``, ``serve``, ``evaluate``, ``export``, ``plot``, ``tune``, ``conformance``.

    shoal train CartPole-v1 --iterations 40                 # flags map onto TrainConfig (see --help)
    shoal train --preset pendulum                           # a tuned config shipped with Shoal, flags override it
    shoal train --config-file run.yaml                      # a YAML or JSON config file, flags override it
    shoal train --resume --run-dir runs/RUN                 # continue a run from its latest checkpoint
    shoal evaluate runs/RUN/checkpoints --episodes 20
    shoal league pettingzoo:classic.connect_four_v3 --backend ray --league.main-exploiters 1   # an AlphaStar
        league: main agents, main exploiters, league exploiters, matched by win rate (shoal league --help)
    shoal export runs/RUN/checkpoints --out policy/         # torch.export programs, no Shoal needed to run them
    shoal plot runs/A runs/B runs/C --out curve.png         # mean and 95% interval over seeds, final IQM
    shoal tune --config-file sweep.yaml --num-samples 4     # a Ray Tune sweep: TrainConfig keys plus
        search: {key: {grid|choice|uniform|loguniform: [...]}} (shoal tune --help)
    shoal train --env external --external.command "python examples/external_sim.py --port {port} --seed {seed}
        --sim-id {sim_id}" --external.instances 8   # launched simulators, token in SHOAL_TOKEN (external-protocol.md)
    shoal serve --external.port 8765 --mode async          # wait for simulators and robots that connect themselves
    shoal conformance --command "./my_sim --port {port}"   # check a simulator against the protocol (SHOAL_TOKEN)

Each ``shoal train`` writes to a fresh ``runs/<env>__<seed>__<time>`` unless ``--run-dir`` names one.
"""

# Imports stay light here (no torch, tensordict, torchrl or Ray at module level): ``shoal --help`` and every
# ``--help`` must answer at once, so each command imports what it needs when it runs (tests/orchestration/
# test_cli_fast.py checks that importing this module imports no torch).

from __future__ import annotations

import dataclasses
import difflib
import gc
import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import tyro

from orchestration.config import TrainConfig
from orchestration.flag_parsing import parse
from orchestration.result_line import print_result
from orchestration.run_notes import (UnusedSettingWarning, check_resumed, note_env_batch, note_past_selves,
                                    note_policy_fit, note_schedule, note_unused)
from orchestration.signals import Terminated, stop_on_sigterm
from orchestration.user_errors import exit_if_users_mistake, user_errors


def _config_from_file(path: str, base: TrainConfig | None = None) -> TrainConfig:
    """A TrainConfig from a YAML or JSON file over ``base`` (strict keys; ``orchestration.presets``)."""
    from orchestration.presets import config_from_file

    return config_from_file(path, base)


_HEADLINES = {"train": "Train with PPO. Besides the flags below: ENV may be given as the first argument;",
              "serve": "Serve external environments: wait for simulators or robots to connect over WebSocket "
                       "(docs/external-protocol.md), answer them with actions and train on what they send; the "
                       "flags are those of shoal train with --env external. Besides the flags below:"}

_TRAIN_HELP = """{headline}
--preset NAME starts from a tuned config shipped with Shoal ({presets}; flags override it);
--config-file F reads a YAML or JSON config (strict keys; over the preset if any; flags override it);
--resume continues the run that --run-dir names from its latest checkpoint (--resume=auto: if it has one, else
starts it there: one command for a supervisor that restarts the run); --seeds S1 S2 ... trains one run
per seed; --no-progress hides the progress bar (a Ray run still writes each iteration's pipeline line on stderr)."""


def _split_train_args(argv: list[str]) -> tuple[list[str], str | None, bool | str, bool, str | None]:
    """Pulls out the positional env, ``--config-file``, ``--resume`` (True, or ``"auto"``), ``--no-progress`` and
    ``--preset``."""
    rest, config_file, resume, progress, preset = [], None, False, True, None
    it = iter(argv)
    for arg in it:
        if arg.split("=", 1)[0] in ("--config-file", "--preset"):
            name, value = arg.split("=", 1) if "=" in arg else (arg, next(it, None))
            if not value:
                raise ValueError(f"{name} needs a value")
            if (given := config_file if name == "--config-file" else preset) is not None:
                raise ValueError(f"{name} is given twice ({given} and {value}): give one")
            config_file, preset = (value, preset) if name == "--config-file" else (config_file, value)
        elif arg == "--resume":
            resume = True
        elif arg.startswith("--resume="):
            if arg != "--resume=auto":
                raise ValueError(f"{arg}: --resume takes no value, or =auto (resume if the run has a checkpoint, "
                                 f"else start it)")
            resume = "auto"
        elif arg == "--no-progress":
            progress = False
        elif not arg.startswith("-") and not rest and "--env" not in argv:
            rest += ["--env", arg]
        else:
            rest.append(arg)
    return rest, config_file, resume, progress, preset


def _seeds(argv: list[str]) -> tuple[list[str], list[int]]:
    """Pulls ``--seeds S1 S2 ...`` out of ``argv``: the remaining arguments and the seeds (empty if absent)."""
    if "--seeds" not in argv:
        return argv, []
    at = argv.index("--seeds")
    end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
    try:
        seeds = [int(x) for x in argv[at + 1:end]]
    except ValueError:
        raise ValueError(f"--seeds takes whole numbers, got {argv[at + 1:end]}") from None
    if not seeds:
        raise ValueError("--seeds needs at least one seed, e.g. --seeds 0 1 2")
    if len(set(seeds)) < len(seeds):  # the second run of a seed would only repeat the first
        raise ValueError(f"--seeds {' '.join(map(str, seeds))} names a seed twice: name each once")
    rest = argv[:at] + argv[end:]
    if any(a == "--seed" or a.startswith("--seed=") for a in rest):
        print("shoal train: --seed is not used with --seeds, which gives each run its seed", file=sys.stderr)
    return rest, seeds


def train(argv: Sequence[str], command: str = "train") -> dict[str, float]:
    """``shoal train [ENV] [--config-file F] [--resume] [--no-progress] [--seeds S...] [TrainConfig flags]``.

    ``--seeds 0 1 2`` trains one run per seed, one after the other, each in its own run directory (under
    ``--run-dir`` when given), and prints the ``shoal plot`` command that draws them together. ``command``
    names the command in error messages (``shoal serve`` is this with ``--env external``).
    """
    with user_errors(command):
        argv, seeds = _seeds(list(argv))
        if seeds and any(a == "--resume" or a.startswith("--resume=") for a in argv):
            raise ValueError("--seeds starts new runs; resume each run on its own with --resume --run-dir RUN")
    if seeds:
        with user_errors(command):  # every seed's directory, before any of them trains
            rest, config_file, _, _, preset = _split_train_args(argv)
            base = _run_dir_from(rest, _defaults(preset, config_file))  # a flag, else the config file's or preset's
            for seed in seeds if base else ():
                _refuse_a_used_run_dir(str(Path(base) / f"seed_{seed}"))
        runs, metrics = [], {}
        for seed in seeds:
            one = [*argv, "--seed", str(seed)]
            if base:
                one += ["--run-dir", str(Path(base) / f"seed_{seed}")]
            with user_errors(command):
                trainer, config, resume, progress = _setup_training(one, command)
            metrics = _run_training(trainer, config, resume, progress, command)
            runs.append(config.run_dir)
        print_result({"runs": runs, "plot": "shoal plot " + " ".join(runs) + " --out curve.png"})
        return metrics
    with user_errors(command):
        trainer, config, resume, progress = _setup_training(argv, command)
    return _run_training(trainer, config, resume, progress, command)


def _run_training(trainer, config: TrainConfig, resume: bool, progress: bool,
                  command: str = "train") -> dict[str, float]:
    from orchestration.run_loop import release_run_dir, run_training  # once a run is set up (it imports torch)

    try:  # run_training wrote a checkpoint of what was trained before the error
        return run_training(trainer, config, resume, progress, command)
    except (RuntimeError, ValueError) as err:
        exit_if_users_mistake(err, command, config.run_dir)
        raise
    finally:
        release_run_dir(config.run_dir)


def _setup_training(argv: list[str], command: str = "train"):
    """Config, trainer and restored state of ``shoal train``: every user error surfaces here."""
    from orchestration.checkpoint_trust import refuse_untrusted
    from orchestration.presets import preset_names

    rest, config_file, resume, progress, preset = _split_train_args(argv)
    default = _defaults(preset, config_file)
    ckpt_root = None
    if resume:
        named = _run_dir_from(rest, default)
        if not named:
            raise ValueError("--resume continues a run: name its directory with --run-dir RUN (runs/ holds one "
                             "directory per run)")
        if resume == "auto":  # a supervisor's one command: the first start starts, every restart resumes
            resume = any((Path(named) / "checkpoints").glob("ckpt-*"))
    if resume and (Path(named) / "league").is_dir() and not (Path(named) / "checkpoints").is_dir():
        raise ValueError(f"{named} is a league, not a training run: continue it with shoal league --resume "
                         f"--run-dir {named}")
    if resume:
        from orchestration.checkpoint import load_checkpoint
        from orchestration.run_state import load_config

        ckpt_root = Path(named) / "checkpoints"
        saved = load_config(load_checkpoint(ckpt_root)[2])
        if preset:
            print(f"shoal {command} --resume: --preset {preset} is not applied: a resumed run goes on with its own "
                  f"config (flags given still change it)", file=sys.stderr)
        default = dataclasses.replace(saved, anneal_iterations=saved.schedule_iterations)  # the schedule goes on
        refuse_untrusted(saved, rest, f"shoal {command} --resume")  # nothing it names imports or runs code
    config = parse(command, TrainConfig, args=rest, default=default, prog=f"shoal {command}",
                      description=_TRAIN_HELP.format(headline=_HEADLINES.get(command, _HEADLINES["train"]),
                                                     presets=", ".join(preset_names())))
    note_unused(command, config, default if resume else None)
    if resume:
        check_resumed(command, default, config)
    if not resume and config.run_dir:
        _refuse_a_used_run_dir(config.run_dir)
    if config.backend == "local":
        _import_torchrl_without_ray()
    import torch  # the first heavy import of a training run: after parsing, so --help stays fast

    from orchestration.builder import build_trainer
    from orchestration.checkpoint import clean_stale, load_checkpoint
    from orchestration.run_loop import fresh_run_dir, run_dir_held
    from orchestration.run_state import misfit, restore_trainer_

    if not config.run_dir:  # a fresh directory per run: reruns never mix checkpoints or TensorBoard files
        stamp = time.strftime("%Y%m%d-%H%M%S")
        named = config.env if config.collection is None else "collection"  # a collection's --env is unused
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in named)
        config = dataclasses.replace(config, run_dir=str(fresh_run_dir(Path("runs") / f"{name}__{config.seed}__{stamp}")))
    torch.set_num_threads(config.threads)
    ckpt_root = Path(config.run_dir) / "checkpoints"
    with run_dir_held(config.run_dir):  # one process per run directory: until the run ends, or this fails
        clean_stale(ckpt_root)  # half-written checkpoints a killed run left
        trainer = build_trainer(config, pretrain=not resume)  # a resumed run's checkpoint holds trained weights
        config = note_env_batch(command, config, trainer.config)  # a factory's env may bring its own batch
        try:
            if config.past_selves != default.past_selves:  # flags set them (a preset's for self-play: not news)
                note_past_selves(command, config, trainer.tree)
            note_policy_fit(command, config, trainer.tree, learning=bool(trainer.trainable))
            if resume:
                try:
                    restore_trainer_(trainer, *load_checkpoint(ckpt_root))
                except (RuntimeError, ValueError) as err:  # shapes that differ: name the settings that made them
                    raise misfit(err, default, config) from None
        except BaseException:
            trainer.close()
            raise
    note_schedule(command, config, resume)  # after a resume that does not fit was refused: that error alone
    return trainer, config, resume, progress


def _defaults(preset: str | None, config_file: str | None) -> TrainConfig:
    """The config that flags change: the preset's (or TrainConfig's), with the config file over it."""
    from orchestration.presets import load_preset

    default = load_preset(preset) if preset else TrainConfig()
    return _config_from_file(config_file, default) if config_file else default


def _refuse_a_used_run_dir(run_dir: str, checkpoints: str = "checkpoints") -> None:
    """Raises ValueError naming ``--resume`` when ``run_dir`` holds a run's checkpoints (under ``checkpoints``), or
    naming the command that continues it when it holds the other kind's (a training run's ``checkpoints``, a
    league's ``league/checkpoints``): a new run there would mix two runs' checkpoints, logs and TensorBoard files."""
    if any((Path(run_dir) / checkpoints).glob("ckpt-*")):
        raise ValueError(f"--run-dir {run_dir} holds a run already (its checkpoints): continue it with --resume "
                         f"--run-dir {run_dir}, or name a new --run-dir (without one, each run gets its own under "
                         f"runs/; to start over there, remove its checkpoints directory)")
    for root, kind, command in (("checkpoints", "a training run", "train"),
                                ("league/checkpoints", "a league", "league")):
        if root != checkpoints and any((Path(run_dir) / root).glob("ckpt-*")):
            raise ValueError(f"--run-dir {run_dir} holds {kind} already (its {root}): continue it with shoal "
                             f"{command} --resume --run-dir {run_dir}, or name a new --run-dir")


def _import_torchrl_without_ray() -> None:
    """Imports TorchRL's data package with Ray made unimportable for that moment: with Ray installed it imports
    Ray at import time (``torchrl/data/replay_buffers/ray_buffer.py``, about 0.4 s of a run's start here), for a
    Ray replay buffer that Shoal never uses. For local runs only; Ray stays importable afterwards (the
    ``ray_*`` modules import it themselves), and TorchRL tolerates its absence (STYLE.md, layers)."""
    if "torchrl.data" in sys.modules or "ray" in sys.modules:
        return
    sys.modules["ray"] = None  # type: ignore[assignment]  # find_spec("ray") is None: TorchRL skips it
    try:
        importlib.import_module("torchrl.data")
    finally:
        del sys.modules["ray"]


def _run_dir_from(args: list[str], default: TrainConfig) -> str:
    for i, arg in enumerate(args):
        if arg == "--run-dir" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return default.run_dir


def _serve_args(argv: Sequence[str]) -> None:
    """Refuses an env other than ``external`` given to ``shoal serve`` (it would train that env, serving nothing)."""
    if argv and not argv[0].startswith("-"):  # ``shoal serve CartPole-v1``: the env as the first argument
        raise ValueError(f"it trains on external environments only, not {argv[0]}: drop it (or run shoal train "
                         f"{argv[0]})")
    for i, arg in enumerate(argv):
        if arg.startswith("--env="):
            value = arg.split("=", 1)[1]
        elif arg == "--env" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        if value != "external":
            raise ValueError(f"it trains on external environments only, not --env {value}: drop --env (or run "
                             f"shoal train --env {value})")


def export(checkpoint: tyro.conf.Positional[str], out: str = "exported") -> list[str]:
    """Writes one ``torch.export`` program per policy of the checkpoint, and a manifest.json that documents them.

    Args:
        checkpoint: a checkpoint directory, or a run's ``checkpoints`` directory or the run's own directory (its
            newest checkpoint).
        out: the directory to write the programs (``<policy>.pt2``) and ``manifest.json`` into.

    Returns the program paths (:func:`orchestration.exporting.export`).
    """
    import torch

    from orchestration.exporting import export as export_programs

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return export_programs(checkpoint, out)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``shoal`` command (torch is imported by the commands that use it, after parsing)."""
    command_line = argv is None  # the console command: this process ends when main returns
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest, started = argv[0], argv[1:], time.time()
    if command_line:  # a supervisor's SIGTERM where no stop is handled ends the run as Ctrl-C does (clean-up too)
        stop_on_sigterm()
    try:
        with warnings.catch_warnings():  # the commands name unused settings on stderr (note_unused) instead
            warnings.simplefilter("ignore", UnusedSettingWarning)
            _dispatch(command, rest)
    except KeyboardInterrupt as stop:  # Ctrl-C where no stop is handled (starting up, waiting, a league)
        if not command_line:
            raise
        how = "stopped by SIGTERM" if isinstance(stop, Terminated) else "interrupted"
        resumable = command in ("train", "serve", "league")
        run_dir = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--run-dir"),
                       next((a.split("=", 1)[1] for a in rest if a.startswith("--run-dir=")), None))
        if run_dir is None:  # the fresh directory under runs/ this process made: the newest checkpoint since start
            fresh = [p for p in Path("runs").glob("*/checkpoints/ckpt-*") if p.stat().st_mtime >= started]
            run_dir = str(max(fresh, key=lambda p: p.stat().st_mtime).parents[1]) if fresh else None
        wrote = resumable and run_dir is not None and any(Path(run_dir).glob("**/ckpt-*"))
        print(f"shoal {command}: {how}" + (f" (a run keeps the checkpoints it wrote: shoal {command} --resume "
                                           f"--run-dir {run_dir} continues it)" if wrote else
                                           " before its first checkpoint: nothing to resume" if resumable else ""),
              file=sys.stderr)
        raise SystemExit(143 if isinstance(stop, Terminated) else 130) from None
    except BrokenPipeError:  # the reader left (``shoal train --help | head``): the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would raise)
        raise SystemExit(141) from None  # as a shell reports SIGPIPE
    if command_line:  # the process ends next: spare it the exit's garbage collection over torch's objects (files,
        gc.freeze()  # loggers and envs are closed, atexit handlers still run; in-process callers keep theirs)


def _dispatch(command: str, rest: list[str]) -> None:
    if command == "train":
        train(rest)
    elif command == "evaluate":
        with user_errors("evaluate"):
            from orchestration.evaluate_cli import evaluate

            parse("evaluate", evaluate, args=rest, prog="shoal evaluate")
    elif command == "export":
        with user_errors("export"):
            parse("export", export, args=rest, prog="shoal export")
    elif command == "plot":
        with user_errors("plot"):
            from orchestration.plot_cli import plot

            parse("plot", plot, args=rest, prog="shoal plot")
    elif command == "league":  # an AlphaStar-style league of learners (orchestration.league_cli)
        from orchestration.league_cli import run as league

        league(rest)
    elif command == "serve":  # train on external environments that connect by themselves
        with user_errors("serve"):
            _serve_args(rest)
        train(["--env", "external", *rest], "serve")
    elif command == "tune":
        from orchestration.sweeps import main as tune

        raise SystemExit(tune(rest))
    elif command == "conformance":
        from adapters.external.conformance import main as conformance

        raise SystemExit(conformance(rest))
    else:
        commands = ["train", "league", "serve", "evaluate", "export", "plot", "tune", "conformance"]
        near = difflib.get_close_matches(command, commands, n=1)
        print(f"shoal: unknown command {command!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
              + f": use {', '.join(commands[:-1])} or {commands[-1]}", file=sys.stderr)
        raise SystemExit(2)  # a user error, as every other one


if __name__ == "__main__":
    main()
