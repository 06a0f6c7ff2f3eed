"""A fast ``shoal`` command: light imports for ``--help`` (checked by module, never by a clock) and ``evaluate --video``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "tensordict", "torchrl", "ray", "gymnasium", "matplotlib", "tensorboard")


def _imported_after(code: str) -> list[str]:
    """The heavy top-level packages in ``sys.modules`` after ``code`` ran in a fresh interpreter."""
    probe = (f"import sys\n{code}\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"'))


@pytest.mark.parametrize("module", ["orchestration.config", "orchestration.cli", "orchestration.evaluate_cli"])
def test_the_config_and_the_command_import_no_torch(module):
    assert _imported_after(f"import {module}") == []


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["evaluate", "--help"], ["export", "--help"],
                                  ["plot", "--help"], ["serve", "--help"], ["league", "--help"]])
def test_help_imports_no_torch(args):
    code = f"from orchestration.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass"
    assert _imported_after(code) == []


def test_a_user_error_in_a_config_file_imports_no_torch(tmp_path):
    (tmp_path / "bad.yaml").write_text("rollout:\n  num_env: 4\n")
    code = (f"from orchestration.cli import main\ntry:\n    main(['train', '--config-file', {str(tmp_path / 'bad.yaml')!r}])\n"
            f"except SystemExit as e:\n    assert e.code == 2")
    assert _imported_after(code) == []


def test_torchrl_imported_for_a_local_run_leaves_ray_importable():
    code = ("from orchestration.cli import _import_torchrl_without_ray\n_import_torchrl_without_ray()\n"
            "import torchrl.data, ray\nassert sys.modules['ray'] is not None and hasattr(ray, 'init')")
    assert "torchrl" in _imported_after(code)


BLIND_ENVS = '''
from gymnasium.envs.classic_control import CartPoleEnv


def make_blind(**kwargs):
    env = CartPoleEnv()
    env.metadata = {"render_modes": [], "render_fps": 50}
    return env
'''


@pytest.fixture(scope="module")
def cartpole_checkpoint(tmp_path_factory):
    """A one-iteration gymnasium CartPole-v1 run (2 envs x 16 steps): its checkpoints directory."""
    from orchestration.cli import main

    run = tmp_path_factory.mktemp("video") / "run"
    main(["train", "CartPole-v1", "--iterations", "1", "--rollout.num-envs", "2", "--rollout.fragment-length", "16",
          "--no-progress", "--run-dir", str(run)])
    return run / "checkpoints"


def _frame_count(path) -> int:
    """Frames in a video written by :mod:`orchestration.videos` (a GIF merges repeated frames into longer ones)."""
    if path.suffix == ".gif":
        from PIL import Image, ImageSequence

        with Image.open(path) as gif:
            return round(sum(frame.info["duration"] for frame in ImageSequence.Iterator(gif)) / 20)  # 50 fps
    import imageio_ffmpeg

    frames = imageio_ffmpeg.read_frames(str(path))
    next(frames)  # the metadata
    return sum(1 for _ in frames)


@pytest.mark.parametrize("fmt", ["auto", "gif", "mp4"])
def test_evaluate_records_a_video_of_every_episode(cartpole_checkpoint, tmp_path, capsys, monkeypatch, fmt):
    import orchestration.videos as videos
    from orchestration.cli import main

    if fmt == "mp4":
        pytest.importorskip("imageio_ffmpeg", reason="MP4 videos need the video extra")
    if fmt != "auto":  # the command picks MP4 when imageio-ffmpeg is installed; force each encoder here
        monkeypatch.setattr(videos, "video_format", lambda _fmt="auto", f=fmt: f)
    main(["evaluate", str(cartpole_checkpoint), "--episodes", "2", "--video", str(tmp_path / "videos")])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    paths = [tmp_path / "videos" / f"episode_00{k}.{fmt if fmt != 'auto' else videos.video_format()}"
             for k in range(2)]
    assert result["videos"] == [str(p) for p in paths]
    assert all(p.stat().st_size > 0 for p in paths)
    # CartPole pays 1 per step: an episode's video holds its reset frame and the frame after each step, the
    # last one included (the adapter resets an ended episode inside its step: the frame is taken before that)
    assert sum(_frame_count(p) for p in paths) == round(2 * result["eval_return_mean"]) + 2


@pytest.mark.parametrize("env, why", [("builtin:cartpole", "do not render frames"),
                                      ("my_blind_envs:make_blind", "without 'rgb_array'")])
def test_an_env_that_does_not_render_is_named_in_one_paragraph(cartpole_checkpoint, tmp_path, capsys, monkeypatch,
                                                               env, why):
    from orchestration.cli import main

    (tmp_path / "my_blind_envs.py").write_text(BLIND_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", str(cartpole_checkpoint), "--env", env, "--video", str(tmp_path / "videos")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"env {env!r} cannot be filmed" in err and why in err and "--video" in err
    assert not any((tmp_path / "videos").glob("*.*"))


def test_a_video_path_that_is_a_file_is_named(cartpole_checkpoint, tmp_path, capsys):
    from orchestration.cli import main

    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_:  # was FileExistsError's traceback
        main(["evaluate", str(cartpole_checkpoint), "--episodes", "1", "--video", str(tmp_path / "afile")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and "afile: cannot make that directory" in err, err


def test_evaluate_films_every_evaluation_env_of_a_collection(tmp_path, capsys, monkeypatch):
    """A collection checkpoint: each evaluation env is filmed into DIR/<env id>/ (not the config's default env),
    with per-env returns; the training-only env is not filmed."""
    import orchestration.videos as videos
    from orchestration.cli import main

    monkeypatch.setattr(videos, "video_format", lambda _fmt="auto": "gif")
    split = {"format": "shoal.envcollection/1",
             "members": {"a": "CartPole-v1", "t": {"env": "CartPole-v1", "kwargs": {"max_episode_steps": 5}}},
             "structure": {"kind": "split", "train": ["a"], "test": ["t"]}}
    (tmp_path / "split.json").write_text(json.dumps(split))
    main(["train", "--collection", str(tmp_path / "split.json"), "--iterations", "1", "--rollout.num-envs", "2",
          "--rollout.fragment-length", "16", "--no-progress", "--run-dir", str(tmp_path / "run")])
    capsys.readouterr()
    main(["evaluate", str(tmp_path / "run" / "checkpoints"), "--episodes", "2", "--video", str(tmp_path / "v")])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["videos"] == [str(tmp_path / "v" / "t" / f"episode_00{k}.gif") for k in range(2)]
    assert result["eval_return_mean/env:t"] <= 5 and not (tmp_path / "v" / "a").exists()  # capped at 5 steps


def test_an_env_that_raises_while_filmed_is_one_paragraph_and_leaves_no_half_written_video(
        cartpole_checkpoint, tmp_path, capsys):
    from orchestration.cli import main

    with pytest.raises(SystemExit) as exit_:  # was the env's traceback, and a video of an unfinished episode
        main(["evaluate", str(cartpole_checkpoint), "--env", "tests.orchestration.faulty_env_factories:"
              "make_raising_filmable", "--episodes", "1", "--video", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and "failed while it was filmed (RuntimeError" in err, err
    assert list((tmp_path / "v").iterdir()) == []


def test_episodes_a_lenient_repair_cut_are_not_filmed_as_scored_ones(cartpole_checkpoint, tmp_path, monkeypatch):
    """Every other episode gets a NaN reward at its second step: cut, not scored, and now not filmed either (its
    two frames were a video of their own among the scored episodes')."""
    import dataclasses

    import orchestration.videos as videos
    from core.specs import from_json
    from orchestration.builder import assignment_for, build_policies
    from orchestration.checkpoint import load_checkpoint
    from orchestration.run_state import load_config

    monkeypatch.setattr(videos, "video_format", lambda _fmt="auto": "gif")
    weights, _, state = load_checkpoint(cartpole_checkpoint)
    config = load_config(state)
    config = dataclasses.replace(config, env="tests.orchestration.faulty_env_factories:make_nan_filmable",
                                 rollout=dataclasses.replace(config.rollout, check="lenient"))
    assignment = assignment_for(config, from_json(state["tree"]))
    policies, fixed = build_policies(config, from_json(state["tree"]), assignment)
    for pid, policy in policies.items():
        policy.load_state_dict({k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")})
    returns, paths = videos.record_episodes(config, policies, assignment, fixed, episodes=3, out_dir=tmp_path / "v")
    assert len(returns["return"]) == 3 and len(paths) == 3 == len(list((tmp_path / "v").iterdir()))
    assert [_frame_count(p) for p in paths] == [round(r) + 1 for r in returns["return"]]


def test_help_read_by_a_reader_that_leaves_early_ends_quietly(tmp_path):
    """``shoal train --help | head``: the reader closes the pipe; Python's BrokenPipeError was a traceback."""
    import os
    import subprocess
    import sys

    reader, writer = os.pipe()
    os.close(reader)  # gone before a byte is written: every write meets a closed pipe
    done = subprocess.run([sys.executable, "-m", "orchestration.cli", "train", "--help"], stdout=writer,
                          stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    os.close(writer)
    assert done.returncode == 141 and "Traceback" not in done.stderr, done.stderr


def test_continuous_action_settings_on_an_env_without_one_are_named(capsys):
    """--policy.log-std-init and --policy.no-squash-bounded-actions on CartPole (discrete actions only) were taken
    in silence; where a box action reads them, nothing is said."""
    from core.policies import PolicyConfig
    from orchestration.config import TrainConfig
    from orchestration.envs import make_env
    from orchestration.run_notes import note_policy_fit

    policy = PolicyConfig(log_std_init=-1.0, squash_bounded_actions=False)
    for env, said in (("builtin:cartpole", True), ("Pendulum-v1", False)):
        probe = make_env(env, 1)
        note_policy_fit("train", TrainConfig(env=env, policy=policy), probe.tree)
        probe.close()
        err = capsys.readouterr().err
        assert ("--policy.squash-bounded-actions, --policy.log-std-init apply to box (continuous) actions, and "
                "builtin:cartpole has none: they do nothing here" in err) is said, err
