"""Scripted players (orchestration.scripted): a function as an opponent of shoal evaluate."""

from __future__ import annotations

import json

import pytest
import torch

from core.layout import ACTION, ACTION_MASK, OBSERVATION
from core.policies import make_policies
from orchestration.envs import make_env
from orchestration.scripted import ScriptedPolicy, load_function

GAME = "pettingzoo:classic.connect_four_v3"
HEURISTIC = "scripted:examples.scripted_connect_four:center_first"


def _board(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> torch.Tensor:
    obs = torch.zeros(1, 1, 6, 7, 2, dtype=torch.int8)
    for r, c in mine:
        obs[0, 0, r, c, 0] = 1
    for r, c in theirs:
        obs[0, 0, r, c, 1] = 1
    return obs


def test_the_example_heuristic_wins_blocks_and_prefers_the_centre(monkeypatch):
    monkeypatch.syspath_prepend(".")
    play = load_function(HEURISTIC)
    legal = torch.ones(1, 1, 7, dtype=torch.bool)
    assert play(_board([], []), legal).item() == 3  # centre first
    assert play(_board([(5, 0), (5, 1), (5, 2)], [(5, 4), (5, 5), (5, 6)]), legal).item() == 3  # wins (not blocks)
    assert play(_board([(5, 0)], [(5, 6), (4, 6), (3, 6)]), legal).item() == 6  # blocks the column
    blocked = legal.clone()
    blocked[0, 0, 3] = False
    assert play(_board([], []), blocked).item() in (2, 4)  # nearest legal to the centre


def test_a_scripted_policy_acts_with_the_function_and_checks_its_shape():
    env = make_env(GAME, 3)
    policy = make_policies(env.tree)["player"]
    obs = env.reset()["player"]
    env.close()
    inputs = {OBSERVATION: obs[OBSERVATION], ACTION_MASK: obs[ACTION_MASK]}
    player = ScriptedPolicy(policy, lambda o, m: torch.full(o.shape[:2], 5))
    out = player.act_step(inputs, None, torch.Generator().manual_seed(0), with_value=False)
    assert torch.equal(out[ACTION], torch.full((3, 2), 5))
    with pytest.raises(ValueError, match="group 'player'.*shape \\(3,\\)"):
        ScriptedPolicy(policy, lambda o, m: torch.zeros(3)).act_step(inputs, None, torch.Generator(), with_value=False)

    def tictactoe(observation, mask):  # a player of another game: its reshape fails on connect four's board
        return observation.reshape(-1, 5, 5).sum((1, 2))

    with pytest.raises(ValueError, match=r"scripted player .*tictactoe of group 'player' failed on observations of "
                                         r"shape \(3, 2, 6, 7, 2\).*RuntimeError: shape .*this env\?"):
        ScriptedPolicy(policy, tictactoe).act_step(inputs, None, torch.Generator(), with_value=False)


def test_a_scripted_player_is_named_module_colon_function_or_refused_by_name():
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        load_function("scripted:nothing")
    with pytest.raises(ValueError, match="no module 'no_such_module'"):
        load_function("scripted:no_such_module:play")
    with pytest.raises(ValueError, match="no function 'nope'.*'center_first'"):
        load_function("scripted:examples.scripted_connect_four:nope")


@pytest.mark.slow
def test_shoal_evaluate_plays_a_checkpoint_against_a_scripted_player(tmp_path, capsys, monkeypatch):
    from orchestration.cli import main

    monkeypatch.syspath_prepend(".")
    main(["train", GAME, "--iterations", "1", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
          "--run-dir", str(tmp_path), "--no-progress"])
    capsys.readouterr()
    results = {}
    for opponent in ("random", HEURISTIC):
        main(["evaluate", str(tmp_path / "checkpoints"), "--opponent", opponent, "--episodes", "20"])
        results[opponent] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results[HEURISTIC]["opponent"] == HEURISTIC
    for seat in ("player_0", "player_1"):  # an untrained policy: the heuristic beats it far more than random does
        assert results[HEURISTIC]["seats"][seat]["games"] == 20
        assert results[HEURISTIC]["seats"][seat]["win"] + 0.3 <= results["random"]["seats"][seat]["win"]
    with pytest.raises(SystemExit) as exit_:  # a misspelled opponent is named, with the nearest choice
        main(["evaluate", str(tmp_path / "checkpoints"), "--opponent", "randm"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--opponent 'randm' is no checkpoint (did you mean 'random'?)" in err, err
