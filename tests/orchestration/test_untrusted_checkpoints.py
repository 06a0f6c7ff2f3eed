"""Untrusted checkpoints and run directories: crafted or damaged checkpoint files are refused in one paragraph,
nothing a checkpoint names is imported or run unless the user names it again, weights and optimizer state of
another network are refused before torch reads them, and one process at a time runs in a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from orchestration import checkpoint as ckpt
from orchestration.builder import build_trainer
from orchestration.run_state import trainer_state
from tests.orchestration.test_crash_safety import ARGS, FAST, _iterations, _parts


# -- untrusted checkpoints -----------------------------------------------------------------------------------
def _valid(tmp_path: Path) -> Path:
    trainer = build_trainer(FAST)
    trainer.train()
    return ckpt.save_checkpoint(tmp_path / "root", 1, **_parts(trainer))


def _edit_state(directory: Path, change) -> None:
    path = directory / "state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


CRAFTED = {
    "pickle payload as state.json": lambda d: (d / "state.json").write_bytes(
        b"\x80\x04\x95\x1f\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94."),
    "state.json is a list": lambda d: (d / "state.json").write_text("[]"),
    "iteration negative": lambda d: _edit_state(d, lambda s: s.update(iteration=-1)),
    "iteration a string": lambda d: _edit_state(d, lambda s: s.update(iteration="1; rm -rf /")),
    "version a bool": lambda d: _edit_state(d, lambda s: s["learners"]["agent"].update(version=True)),
    "learners empty": lambda d: _edit_state(d, lambda s: s.update(learners={})),
    "config missing": lambda d: _edit_state(d, lambda s: s.pop("config")),
    "tree not a string": lambda d: _edit_state(d, lambda s: s.update(tree={"__class__": "os.system"})),
    "history of strings": lambda d: _edit_state(d, lambda s: s.update(history={"return": ["x"]})),
    "NaN weights": lambda d: save_file({"agent/actor_out.weight": torch.full((2, 64), float("nan"))},
                                       str(d / "weights.safetensors")),
    "Inf optimizer moment": lambda d: save_file({"optimizer/agent/state/0/exp_avg": torch.tensor([float("inf")])},
                                                str(d / "state.safetensors")),
    "weights of an unknown policy": lambda d: save_file({"intruder/w": torch.zeros(1)}, str(d / "weights.safetensors")),
    "garbage weights file": lambda d: (d / "weights.safetensors").write_bytes(b"\xff" * 64),
    "truncated weights file": lambda d: (d / "weights.safetensors").write_bytes(
        (d / "weights.safetensors").read_bytes()[:40]),
    "state.json symlinked out of the run": lambda d: ((d / "state.json").unlink(),
                                                      (d / "state.json").symlink_to("/etc/hostname")),
    "weights symlinked": lambda d: ((d / "weights.safetensors").rename(d.parent / "w"),
                                    (d / "weights.safetensors").symlink_to(d.parent / "w")),
    "missing state tensors": lambda d: (d / "state.safetensors").unlink(),
    "unknown config key": lambda d: _edit_state(d, lambda s: s["config"].update(evil=1)),
    "config value out of range": lambda d: _edit_state(d, lambda s: s["config"].update(lr=-1.0)),
    "JSON nested deeper than the stack": lambda d: (d / "state.json").write_text("[" * 200_000),  # RecursionError
    "config section a string": lambda d: _edit_state(d, lambda s: s["config"].update(policy="big")),  # AttributeError
    "version past int64": lambda d: _edit_state(d, lambda s: s["learners"]["agent"].update(version=10 ** 30)),
    "config section missing": lambda d: _edit_state(d, lambda s: s["config"].pop("rollout")),  # said "rollout"
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checkpoint_is_refused_with_a_named_error(tmp_path, case):
    from orchestration.run_state import load_config

    directory = _valid(tmp_path)
    CRAFTED[case](directory)
    with pytest.raises((ckpt.CheckpointError, ValueError, FileNotFoundError)) as err:
        load_config(ckpt.load_checkpoint(directory)[2])
    assert len(str(err.value).split()) > 3  # a message, naming what is wrong (not only a key)


def test_a_pointer_out_of_the_root_and_a_huge_json_are_refused(tmp_path, monkeypatch):
    directory = _valid(tmp_path)
    (directory.parent / "latest").write_text("../../etc")
    with pytest.warns(RuntimeWarning):  # not followed: the newest checkpoint inside the root is used
        assert ckpt.resolve(directory.parent) == directory
    monkeypatch.setattr(ckpt, "MAX_JSON_BYTES", 100)
    with pytest.raises(ckpt.CheckpointError, match="larger than"):
        ckpt.load_checkpoint(directory)


def test_a_checkpoint_naming_a_module_env_imports_nothing(tmp_path):
    directory = _valid(tmp_path)
    marker = tmp_path / "imported"
    (tmp_path / "evil_ckpt_mod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit_state(directory, lambda s: s["config"].update(env="evil_ckpt_mod:Evil-v0"))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    os.rename(directory, run_dir / "checkpoints" / directory.name)
    (run_dir / "checkpoints" / "latest").write_text(directory.name)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    commands = (["evaluate", str(run_dir / "checkpoints")], ["train", "--resume", "--run-dir", str(run_dir)])
    processes = [subprocess.Popen([sys.executable, "-m", "orchestration.cli", *args], cwd=tmp_path, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in commands]  # side by side
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 2 and "never allowed to import code" in err, err[-2000:]  # a user error's status
        assert "Traceback" not in err
    assert not marker.exists()


def test_weights_of_another_network_are_one_paragraph_in_evaluate_and_export(tmp_path, capsys):
    """A checkpoint whose weights file came from a 32-unit run: torch's size-mismatch traceback before."""
    import dataclasses

    from core.policies import PolicyConfig
    from orchestration.cli import main

    directory = _valid(tmp_path)
    small = build_trainer(dataclasses.replace(FAST, policy=PolicyConfig(hidden_sizes=(32, 32))))
    save_file(trainer_state(small)[0], str(directory / "weights.safetensors"))
    for args in (["evaluate", str(directory), "--episodes", "1"], ["export", str(directory), "--out",
                                                                    str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err, err
        assert ("checkpoint policy 'agent': its weights are another network's than the one its config builds (size "
                "mismatch for actor_trunk.0.weight") in err, err


def test_an_optimizer_state_of_another_network_is_refused_before_torch_reads_it():
    """Adam's moments of a 32-unit network beside a 64-unit one's weights: torch's fused Adam wrote past the
    parameters' memory (a segfault, or a Ray learner aborted by malloc); now a ValueError names the tensor."""
    import dataclasses

    from core.policies import PolicyConfig
    from orchestration.run_state import restore_trainer_

    small = build_trainer(dataclasses.replace(FAST, policy=PolicyConfig(hidden_sizes=(32, 32))))
    small.train()
    weights, tensors, state = trainer_state(build_trainer(FAST))
    tensors = {**tensors, **{k: v for k, v in trainer_state(small)[1].items() if k.startswith("optimizer/")}}
    with pytest.raises(ValueError, match=r"policy 'agent': its state does not fit .* optimizer state 'exp_avg' of "
                                         r"parameter 0 has shape \(32, 4\), the parameter \(64, 4\)"):
        restore_trainer_(build_trainer(FAST), weights, tensors, state)
    state["learners"]["agent"]["optimizer"]["param_groups"] = "x"  # was an AttributeError
    with pytest.raises(ValueError, match="the checkpoint's optimizer state is malformed"):
        restore_trainer_(build_trainer(FAST), weights, tensors, state)


@pytest.mark.parametrize("hazard", ["external_command", "collection_file"])
def test_a_checkpoint_that_would_run_a_command_or_open_a_collection_file_runs_nothing(tmp_path, monkeypatch, capsys,
                                                                                     hazard):
    """A checkpoint's external.command (run by the launcher) and a collection named by its file (whose members
    may import code) are taken only when the user names them again; a resume and an evaluation ran them."""
    from orchestration.cli import main

    directory, marker = _valid(tmp_path), tmp_path / "ran"
    if hazard == "external_command":
        _edit_state(directory, lambda s: (s["config"].update(env="external"),
                                          s["config"]["external"].update(command=f"touch {marker}")))
        said = {"train": "the checkpoint launches its simulators with external.command 'touch ",
                "evaluate": "is of a run on external simulators, which Shoal cannot start to play"}
    else:
        (tmp_path / "evil_member.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef make():\n    pass\n")
        (tmp_path / "evil.json").write_text(json.dumps({"format": "shoal.envcollection/1",
                                                        "members": {"a": "evil_member:make"}}))
        _edit_state(directory, lambda s: s["config"].update(collection=str(tmp_path / "evil.json")))
        said = dict.fromkeys(("train", "evaluate"), f"the checkpoint names the collection file '{tmp_path}/evil.json'")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    os.rename(directory, run_dir / "checkpoints" / directory.name)
    (run_dir / "checkpoints" / "latest").write_text(directory.name)
    monkeypatch.syspath_prepend(str(tmp_path))
    resume = ["train", "--resume", "--run-dir", str(run_dir), "--iterations", "2"]
    for args in (resume, ["evaluate", str(run_dir)], [*resume, "--env", "builtin:cartpole"]):  # a run's --env
        with pytest.raises(SystemExit) as exit_:                                                # keeps its collection
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and said[args[0]] in err and "Traceback" not in err, err
    assert not marker.exists()
    main(["evaluate", str(run_dir), "--env", "builtin:cartpole", "--episodes", "1"])  # evaluate's --env replaces
    assert not marker.exists() and json.loads(capsys.readouterr().out.splitlines()[-1])["episodes"] == 1


def test_a_run_directory_in_use_by_another_process_is_refused_until_it_ends(tmp_path, monkeypatch, capsys):
    """Two runs started on one directory at once both trained, their checkpoints interleaved, one's metrics
    lost (a resume's iteration counted twice); the second is now refused while the first holds the directory."""
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom orchestration.run_loop import "
                               "hold_run_dir\nhold_run_dir('r')\nprint('held', flush=True)\ntime.sleep(300)"],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["train", *ARGS, "--iterations", "1", "--run-dir", "r"],
                     ["league", "pettingzoo:classic.tictactoe_v3", "--iterations", "1", "--run-dir", "r"]):
            with pytest.raises(SystemExit) as exit_:
                main(args)
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and f"r is in use by another shoal process (pid {holder.pid})" in err, err
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / "afile").write_text("")  # a run directory that cannot be one: FileExistsError's traceback before
    with pytest.raises(SystemExit) as exit_:
        main(["train", *ARGS, "--iterations", "1", "--run-dir", "afile"])
    assert exit_.value.code == 2 and "--run-dir afile: File exists" in capsys.readouterr().err
    main(["train", *ARGS, "--iterations", "1", "--run-dir", "r"])  # free again
    main(["train", "--resume", "--run-dir", "r", "--iterations", "2", "--no-progress"])  # and again once it ended
    assert _iterations(tmp_path / "r" / "metrics.csv") == [1, 2]
    with pytest.raises(SystemExit):  # a resume refused while it was set up lets the directory go too
        main(["train", "--resume", "--run-dir", "r", "--iterations", "3", "--policy.hidden-sizes", "32"])
    taken = subprocess.run([sys.executable, "-c", "from orchestration.run_loop import hold_run_dir\nhold_run_dir('r')"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert taken.returncode == 0, taken.stderr
