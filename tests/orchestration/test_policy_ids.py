"""Policy ids a user gets wrong in ``--policy-mapping`` / ``--fixed-policies`` are refused before training, by name:
before, each silently became a fresh learning policy (so a "frozen" or "scripted" opponent trained)."""

from __future__ import annotations

import pytest

from orchestration.cli import main

ENV = ["train", "builtin:spread", "--iterations", "1", "--rollout.num-envs", "2", "--rollout.fragment-length", "4",
       "--no-progress"]


@pytest.mark.parametrize("flags, said", [
    (["--policy-mapping", "agents_1", "scripted:examples.scripted_connect_four:center_first"],
     "a scripted player or a checkpoint plays only in evaluation"),
    (["--policy-mapping", "agents_1", "runs/c4/checkpoints"], "a scripted player or a checkpoint plays only in"),
    (["--policy-mapping", "agents_1", "randon"], "did you mean 'random' (the uniform policy)?"),
    (["--policy-mapping", "agents_1", "opponent", "--fixed-policies", "oponent"],
     "--fixed-policies oponent: no agent plays policy 'oponent'; the run's policies are ['agents', 'opponent'] "
     "(did you mean 'opponent'?)"),
    (["--fixed-policies", "opponent"], "--fixed-policies opponent: no agent plays policy 'opponent'"),
])
def test_a_wrong_policy_id_is_one_paragraph_naming_it(flags, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*ENV, "--run-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err, err


def test_a_frozen_opponent_and_random_still_train_the_rest(tmp_path, capsys):
    main([*ENV, "--run-dir", str(tmp_path / "run"), "--policy-mapping", "agents_1", "opponent", "agents_2", "random",
          "--fixed-policies", "opponent"])
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "agents/loss_policy" in header and "opponent/loss_policy" not in header
