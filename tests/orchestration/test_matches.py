"""``shoal evaluate --opponent``: a checkpoint against random or another checkpoint, seat by seat."""

from __future__ import annotations

import json

import pytest

from orchestration.cli import main
from orchestration.matches import play_seats, wilson_interval


def test_wilson_interval_matches_the_textbook_values():
    lo, hi = wilson_interval(5, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.fixture(scope="module")
def connect_four(tmp_path_factory):
    run = tmp_path_factory.mktemp("c4")
    main(["train", "pettingzoo:classic.connect_four_v3", "--iterations", "2", "--rollout.num-envs", "8",
          "--rollout.fragment-length", "32", "--run-dir", str(run), "--no-progress"])
    return str(run / "checkpoints")


def test_every_seat_plays_its_games_against_random_and_the_rates_add_up(connect_four, capsys):
    main(["evaluate", connect_four, "--opponent", "random", "--episodes", "12"])
    seats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["seats"]
    assert set(seats) == {"player_0", "player_1"}
    for result in seats.values():
        assert result["games"] == 12
        assert result["win"] + result["draw"] + result["loss"] == pytest.approx(1.0)
        lo, hi = result["win_ci95"]
        assert lo <= result["win"] <= hi
        # zero-sum: the mean return is (wins - losses) / games
        assert result["return_mean"] == pytest.approx(result["win"] - result["loss"])


def test_a_checkpoint_against_itself_on_one_seat(connect_four):
    seats = play_seats(connect_four, connect_four, episodes=6, seats=("player_1",), env="pettingzoo:classic.connect_four_v3")
    assert list(seats) == ["player_1"] and seats["player_1"]["games"] == 6


def test_bad_seats_and_opponents_are_named(connect_four, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", connect_four, "--opponent", "random", "--seats", "player_9"])
    assert exit_.value.code == 2 and "player_9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["evaluate", connect_four, "--opponent", str(tmp_path / "nowhere")])
    assert "nowhere" in capsys.readouterr().err


def test_the_learning_policy_plays_the_seats_a_fixed_one_played_in_training(connect_four):
    """A run against ``random`` (or a league player, whose other seat is its fixed ``opponent`` slot) is
    evaluated with its learner on every seat, never with the policy that held the other seat in training."""
    from core.specs import from_json
    from orchestration.checkpoint import load_checkpoint
    from orchestration.config import TrainConfig
    from orchestration.matches import checkpoint_policy

    tree = from_json(load_checkpoint(connect_four)[2]["tree"])
    env = "pettingzoo:classic.connect_four_v3"
    versus_random = TrainConfig(env=env, policy_mapping=(("player_1", "random"),))
    league_player = TrainConfig(env=env, policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",))
    two_learners = TrainConfig(env=env, policy_mapping=(("player_0", "a"), ("player_1", "b")))
    for config in (versus_random, league_player):
        learner = checkpoint_policy(config, tree, "player_0")
        assert learner not in ("random", "opponent")
        assert checkpoint_policy(config, tree, "player_1") == learner
    assert [checkpoint_policy(two_learners, tree, s) for s in ("player_0", "player_1")] == ["a", "b"]
    nobody_learns = TrainConfig(env=env, policy_mapping=two_learners.policy_mapping, fixed_policies=("a", "b"))
    with pytest.raises(ValueError, match="seat 'player_1' was played by the fixed policy 'b'.*no learning policy"):
        checkpoint_policy(nobody_learns, tree, "player_1")


def test_a_league_snapshot_is_an_opponent(connect_four, tmp_path):
    """A historical player of a league's pool (a snapshot, not a checkpoint) plays the other seats."""
    from core.policies import PolicyConfig, make_policies
    from core.specs import from_json
    from orchestration.checkpoint import load_checkpoint
    from orchestration.snapshots import save_snapshot

    tree = from_json(load_checkpoint(connect_four)[2]["tree"])
    small = PolicyConfig(hidden_sizes=(8,))  # its own architecture, not the checkpoint's
    snap = save_snapshot(tmp_path / "main_0-at-0", make_policies(tree, small)["player"], tree, group="player",
                         policy_id="main_0@0", version=0, config=small)
    seats = play_seats(connect_four, str(snap), episodes=4, seats=("player_0",),
                       env="pettingzoo:classic.connect_four_v3")
    assert seats["player_0"]["games"] == 4


@pytest.mark.parametrize("env, seat", [("builtin:spread", "agents_0"), ("mpe2:simple_spread_v3", "agent_0")])
def test_a_game_that_is_not_zero_sum_has_returns_and_no_winner(tmp_path, capsys, env, seat):
    """Every agent of builtin:spread shares one reward (cooperative): it used to report 'win' 1.0 for a return
    above 0; mpe2's spread (a general payoff) still reported win 0 / loss 1.0 for its negative returns."""
    run = tmp_path / "spread"
    main(["train", env, "--iterations", "1", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
          "--run-dir", str(run), "--no-progress"])
    capsys.readouterr()
    main(["evaluate", str(run / "checkpoints"), "--opponent", "random", "--episodes", "4", "--seats", seat])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["seats"][seat]
    assert result["games"] == 4 and "win" not in result and result["return_std"] >= 0, result


def test_an_opponent_of_another_game_is_refused_naming_both_envs_and_where_they_differ(connect_four, tmp_path, capsys):
    from core.policies import PolicyConfig, make_policies
    from orchestration.envs import make_env
    from orchestration.snapshots import save_snapshot

    run = tmp_path / "ttt"
    main(["train", "pettingzoo:classic.tictactoe_v3", "--iterations", "1", "--rollout.num-envs", "2",
          "--rollout.fragment-length", "8", "--run-dir", str(run), "--no-progress"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", connect_four, "--opponent", str(run / "checkpoints")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("(env pettingzoo:classic.tictactoe_v3) was trained on another tree than" in err
            and "(env pettingzoo:classic.connect_four_v3): tree/" in err and "play an opponent of the same env" in err)
    env = make_env("pettingzoo:classic.tictactoe_v3", 1)
    snap = save_snapshot(tmp_path / "ttt-at-0", make_policies(env.tree, PolicyConfig())["player"], env.tree,
                         group="player", policy_id="ttt@0", version=0, config=PolicyConfig())
    env.close()
    with pytest.raises(ValueError, match=r"saved from another tree than .*\(env pettingzoo:classic.connect_four_v3\): "
                                         r"tree/.*play an opponent of the same env"):
        play_seats(connect_four, str(snap), episodes=2, env="pettingzoo:classic.connect_four_v3")
