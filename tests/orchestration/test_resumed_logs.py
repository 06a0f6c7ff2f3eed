"""What a resumed run's logs hold: every iteration once, in ``metrics.csv`` and in TensorBoard, also for a sweep's
trial that Tune restores in a new directory (a restored experiment runs in a new Ray session's)."""

from __future__ import annotations

import csv
import dataclasses
import shutil
import time
from pathlib import Path

from orchestration.config import RolloutConfig, TrainConfig
from orchestration.sweeps import run_trial

CONFIG = TrainConfig(env="builtin:cartpole", iterations=4, checkpoint_every=2, seed=5,
                     rollout=RolloutConfig(num_envs=8, fragment_length=32))


def _trial(trial_dir: Path, restored: Path | None, keep: Path | None = None) -> None:
    """One :func:`run_trial`; ``keep``: where the checkpoint it reports at iteration 2 is copied (Tune keeps it)."""
    def report(metrics, directory):
        if directory is not None and keep is not None and metrics["iteration"] == 2:
            shutil.copytree(directory, keep)
    run_trial(CONFIG, str(trial_dir), None if restored is None else str(restored), report)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_trial_restored_in_a_new_directory_keeps_the_rows_before_its_checkpoint(tmp_path):
    _trial(tmp_path / "first", None, keep=tmp_path / "at2")
    _trial(tmp_path / "restored", tmp_path / "at2")  # as Tune restores it: a new, empty trial directory
    first, restored = _rows(tmp_path / "first" / "metrics.csv"), _rows(tmp_path / "restored" / "metrics.csv")
    assert [r["iteration"] for r in restored] == ["1", "2", "3", "4"]
    assert restored[:2] == first[:2]  # the rows of the first session, as written
    assert restored[-1]["env_steps"] == first[-1]["env_steps"]


def test_tensorboard_of_a_resumed_run_holds_each_iteration_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _trial(run, None, keep=tmp_path / "at2")  # 4 iterations, then resumed from iteration 2 in the same directory
    # TensorBoard reads event files in name order: seconds since the epoch, then host, pid and a per-process
    # count, compared as text. Two writers of one process in one second can sort in the wrong order ("...9"
    # after "...10"); runs a second apart, as a real resume is, do not
    time.sleep(1.05)
    _trial(run, tmp_path / "at2")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("episode_return_mean")]
    assert steps == sorted(set(steps)) and len(steps) == 4, steps  # not 6: iterations 3 and 4 once each
    assert [float(r["env_steps"]) for r in _rows(run / "metrics.csv")] == steps


def test_the_rows_a_checkpoint_carries_never_replace_a_trials_own(tmp_path):
    """Tune restarting a failed trial in the same session reuses its directory: its own file is kept."""
    _trial(tmp_path / "trial", None, keep=tmp_path / "at2")
    own = _rows(tmp_path / "trial" / "metrics.csv")
    carried = tmp_path / "at2" / "metrics.csv"
    header, *lines = carried.read_text().splitlines()  # told apart from the trial's own: env_steps -7
    carried.write_text("\n".join([header, *("-7" + line[line.index(","):] for line in lines)]) + "\n")
    shorter = dataclasses.replace(CONFIG, iterations=2)
    run_trial(shorter, str(tmp_path / "trial"), str(tmp_path / "at2"), lambda *_: None)  # nothing left to train
    assert _rows(tmp_path / "trial" / "metrics.csv") == own[:2]


def test_a_trial_does_not_warn_of_the_sweeps_ray_settings(tmp_path):
    """``shoal tune --ray.num-cpus 4`` sizes Tune's Ray instance: a local trial of that config uses it, so it
    gets no :class:`UnusedSettingWarning` (a plain ``build_trainer`` of the same config does)."""
    import warnings

    import pytest

    from orchestration.config import RayConfig
    from orchestration.run_notes import UnusedSettingWarning

    config = dataclasses.replace(CONFIG, iterations=1, checkpoint_every=0, ray=RayConfig(num_cpus=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)
        run_trial(config, str(tmp_path / "trial"), None, lambda metrics, directory: None)
    with pytest.warns(UnusedSettingWarning, match="--ray.num-cpus applies to --backend ray only"):
        from orchestration.builder import build_trainer

        build_trainer(config).close()
