"""Interrupting a league: Ctrl-C ends it after the iteration every player is in; a player that finished an
interrupted iteration keeps it; a second interrupt while players finish loses nothing; its on/off flags."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

from core.losses import PPOConfig
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.league_config import LeagueConfig
from core.ratings import INITIAL, elo_update
from orchestration.league_roles import MATCH_K, RoleLeague

GAME = "pettingzoo:classic.connect_four_v3"


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"env": GAME, "seed": 0, "lr": 1e-3, "rollout": RolloutConfig(num_envs=8, fragment_length=32),
                          "ppo": PPOConfig(minibatch_size=128), **kw})


def _on(backend: str, request, **kw) -> TrainConfig:
    """:func:`_config` on ``backend``; on Ray, players in parallel on the shared instance (0-CPU actors: 2 players
    fit on 2 CPUs)."""
    if backend == "local":
        return _config(**kw)
    request.getfixturevalue("ray_session")
    return _config(backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0),
                   rollout=RolloutConfig(num_envs=8, fragment_length=32, num_workers=1), **kw)


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_ctrl_c_inside_a_players_iteration_ends_the_league_after_that_iteration_with_nothing_saved_halfway(
        tmp_path, capsys, backend, request):
    """Players that train one after another (the local backend): a Ctrl-C after the first one collected used to
    stop it there and save it halfway through its iteration (a resume trained part of it again); on Ray (players
    in parallel) it raised once they had finished and left the league's iteration unrecorded. Now every player ends
    the iteration, the league is saved at its end, and the command exits 130 saying how to go on."""
    import os
    import signal

    from orchestration.checkpoint import load_checkpoint
    from orchestration.league_cli import train_league

    config = _on(backend, request, iterations=3, run_dir=str(tmp_path))
    league = RoleLeague(config, LeagueConfig(league_exploiters=0, snapshot_every=100))
    assert league.parallel == (backend == "ray")
    fleet = league.trainers[0].fleet
    collect = fleet.collect

    def collect_then_ctrl_c(*args, **kwargs):
        reports = collect(*args, **kwargs)
        if league.iteration == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return reports
    fleet.collect = collect_then_ctrl_c
    with pytest.raises(SystemExit) as ended:
        train_league(league, config, progress=False)
    assert ended.value.code == 128 + signal.SIGINT
    assert "stopped by SIGINT after iteration 1; continue with: shoal league --resume" in capsys.readouterr().err
    assert league.iteration == 1 and [t.iteration for t in league.trainers] == [1, 1]
    _, _, state = load_checkpoint(tmp_path / "league" / "checkpoints")
    assert state["iteration"] == 1 and not state["mid_iteration"] and state["finished"] == {}
    settled = json.loads((tmp_path / "run.json").read_text())["final_accounting"]  # per player, as shoal train's
    for name in ("main_0", "main_exploiter_0"):
        _, _, player = load_checkpoint(tmp_path / "players" / name / "checkpoints")
        assert player["iteration"] == 1
        assert settled[name]["fragments_produced"] == settled[name]["player/fragments_accepted"] == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_player_that_finished_an_interrupted_iteration_sits_the_resumed_one_out(tmp_path, backend, request):
    """Ctrl-C after the first player's iteration but before the second's: the checkpoint keeps the first
    player's extra iteration and its games; the resumed league trains only the second, so all are level again,
    and the iteration's bookkeeping counts both players' games, ratings and metrics (none lost, none twice)."""
    from orchestration.checkpoint import load_checkpoint
    from orchestration.league_cli import restore_league_, train_league

    config = _on(backend, request, iterations=3, run_dir=str(tmp_path))
    rules = LeagueConfig(league_exploiters=0, snapshot_every=100)
    league = RoleLeague(config, rules)
    assert league.parallel == (backend == "ray")

    def interrupted():
        raise KeyboardInterrupt
    league.trainers[1].train = interrupted  # the second player is stopped before its iteration
    with pytest.raises(KeyboardInterrupt):
        train_league(league, config, progress=False)
    kept = league.finished[0]["metrics"]["games/main_0"]
    assert kept > 0 and list(league.finished) == [0]
    players = tmp_path / "players" / "main_0" / "checkpoints"  # a later save of the same iteration, cut short
    shutil.copytree(players / "ckpt-000000", players / "ckpt-000000.1")  # before the league's own checkpoint:
    state = json.loads((players / "ckpt-000000.1" / "state.json").read_text())
    (players / "ckpt-000000.1" / "state.json").write_text(json.dumps({**state, "iteration": 5}))
    again = RoleLeague(config, rules)  # the league resumes from the player checkpoints its checkpoint names
    restore_league_(again, tmp_path, load_checkpoint(tmp_path / "league" / "checkpoints"))
    assert (again.iteration, again.trainers[0].iteration, again.trainers[1].iteration) == (0, 1, 0)
    assert again.games.sum() == 0 and list(again.finished) == [0]  # kept, not yet in the table
    assert again.mid_iteration  # its opponents are drawn again: said (and not after an iteration that ended)
    steps = [t.env_steps for t in again.trainers]
    metrics = again.train()
    assert [t.iteration for t in again.trainers] == [1, 1] and again.iteration == 1 and again.finished == {}
    assert not again.mid_iteration
    assert again.trainers[0].env_steps == steps[0] and again.trainers[1].env_steps > steps[1]
    assert metrics["games/main_0"] == kept and metrics["games/main_exploiter_0"] > 0
    assert metrics["env_steps/main_0"] == steps[0] and "fragments_produced/main_0" in metrics
    recorded = float(again.games.diagonal().sum() + again.games.triu(1).sum())
    assert recorded == kept + metrics["games/main_exploiter_0"]  # each game in the table once
    pairs = [(i, int(metrics[f"opponent/{name}"]), metrics[f"win_rate/{name}"])  # one rating period for both
             for i, name in enumerate(["main_0", "main_exploiter_0"]) if int(metrics[f"opponent/{name}"]) != i]
    expected = elo_update(torch.full((3,), INITIAL, dtype=torch.float64), torch.tensor([p[0] for p in pairs]),
                          torch.tensor([p[1] for p in pairs]), torch.tensor([p[2] for p in pairs],
                                                                             dtype=torch.float64), k=MATCH_K)
    assert torch.allclose(again.ratings[:3], expected)
    again.close()


def test_a_league_checkpoint_whose_finished_record_is_not_data_is_refused_by_name():
    from orchestration.league_roles import finished_from_json

    names = ["main_0", "main_exploiter_0"]
    good = {"0": {"opponent": 2, "scores": [1.0, 0.5], "metrics": {"games/main_0": 2.0, "matched/main_0/pfsp": 1.0}}}
    assert finished_from_json(good, names, 3)[0]["scores"] == [1.0, 0.5]
    entry = good["0"]
    for bad in ({"0": {**entry, "opponent": 7}}, {"5": entry}, [1], {"\u00b2": entry},
                {"0": {**entry, "opponent": True}},
                {"0": {**entry, "metrics": {"games/main_0": "os.system"}}}, {"0": {**entry, "scores": [5.0]}},
                {"0": {**entry, "scores": [float("nan")]}}, {"0": {**entry, "metrics": {"iteration": 99.0}}},
                {"1": entry}):  # main_exploiter_0's entry holding main_0's metrics
        with pytest.raises(ValueError, match="'finished'"):
            finished_from_json(bad, names, 3)


def test_a_second_interrupt_while_the_league_waits_for_a_player_does_not_lose_its_games():
    """Ray trains the players in threads; after Ctrl-C the league waits for those still training. A second
    Ctrl-C in that wait would save them mid-iteration, their games lost: it is ignored until they finish."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    league = RoleLeague(_config(), LeagueConfig(league_exploiters=0, snapshot_every=100))
    league.parallel = True  # the Ray path's threads, on local trainers
    raised, train = threading.Event(), league.trainers[0].train

    def interrupted():
        raised.set()
        raise KeyboardInterrupt

    deferred = []

    def slow():  # the first Ctrl-C reaches the main thread while it waits for this player, then a second one
        raised.wait()
        time.sleep(0.1)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        for _ in range(500):  # until the league waits with interrupts deferred (the old code never did)
            if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
                deferred.append(True)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                break
            time.sleep(0.01)
        return train()

    league.trainers[0].train, league.trainers[1].train = slow, interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            league.train()
        assert deferred and list(league.finished) == [0] and league.trainers[0].iteration == 1  # finished, kept
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        league.close()


@pytest.mark.parametrize("switch, parallel", [("--league.no-parallel", False), ("--league.parallel", True)])
def test_an_on_off_league_flag_leaves_the_next_word_to_the_flag_it_belongs_to(tmp_path, switch, parallel):
    """``--league.no-parallel --run-dir X`` took X as the switch's value ("Unrecognized options: X")."""
    from orchestration.league_cli import parse

    config, rules, _, _ = parse([GAME, switch, "--run-dir", str(tmp_path / "run"), "--seed", "3", "--league.seat", "1"])
    assert (config.run_dir, config.seed, rules.parallel, rules.seat) == (str(tmp_path / "run"), 3, parallel, 1)
