"""The AlphaStar league (orchestration.league_roles, shoal league): roles, snapshots, resets, ratings, Ray."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.cli import main
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.league_config import LeagueConfig
from core.ratings import INITIAL
from orchestration.league_roles import MATCH_K, OPPONENT, RoleLeague

GAME = "pettingzoo:classic.connect_four_v3"


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"env": GAME, "seed": 0, "lr": 1e-3, "rollout": RolloutConfig(num_envs=8, fragment_length=32),
                          "ppo": PPOConfig(minibatch_size=128), **kw})


def test_each_role_plays_the_opponent_it_picked_and_the_league_grows_on_schedule():
    league = RoleLeague(_config(), LeagueConfig(snapshot_every=2, exploiter_threshold=1.0))
    try:
        assert [p.name for p in league.players] == ["main_0", "main_exploiter_0", "league_exploiter_0", "main_0@0"]
        total = 0.0
        for it in range(4):
            before = league.ratings[:3].clone()
            metrics = league.train()
            total += sum(metrics[f"games/{p.name}"] for p in league.players[:3])
            # an exploiter plays one match per iteration (nobody picks an active exploiter): at most K points
            assert bool(((league.ratings[1:3] - before[1:3]).abs() <= MATCH_K).all())
            for i, trainer in enumerate(league.trainers):
                name = league.players[i].name
                opponent = int(metrics[f"opponent/{name}"])
                actor = TensorDict.from_module(trainer.fleet.actors[0].policies[OPPONENT])
                assert (actor == league.weights_of(opponent)).all() or not league.players[opponent].historical
                assert metrics[f"games/{name}"] > 0
                accounted = sum(metrics[f"fragments_{k}/{name}"] for k in ("accepted", "stale", "lost", "in_flight"))
                assert metrics[f"fragments_produced/{name}"] == accounted > 0  # each player's own ledger
                assert metrics[f"env_steps_trained/{name}"] > 0
                own = list(trainer.history[f"return/{league.group}"])  # its seat's games, not both seats' (0)
                assert metrics[f"episode_return_mean/{name}"] == pytest.approx(sum(own) / len(own))
                role = league.players[i].role
                if role == "league_exploiter":
                    assert league.players[opponent].historical  # only historical players
                if role == "main_exploiter":  # the main agent (0) or its past selves
                    assert opponent == 0 or league.players[opponent].parent == 0
        assert metrics["league/size"] == 4 + 3 * 2 == len(league.players)  # snapshots at iterations 2 and 4
        assert torch.equal(league.games, league.games.T)
        recorded = float(league.games.diagonal().sum() + league.games.triu(1).sum())
        assert recorded == total > 0  # every game of every iteration in the table once
        ratings = [metrics[f"rating/{p.name}"] for p in league.players]
        assert len(set(ratings)) > 1 and ratings[0] == float(league.ratings[0])
        snapshot = league.players[4]  # main_0@2: a copy, not a view of the learning weights
        assert snapshot.historical and not (league.weights_of(0) == snapshot.weights).all()
    finally:
        league.close()


def test_an_exploiter_that_beats_its_targets_is_snapshotted_and_starts_over():
    league = RoleLeague(_config(), LeagueConfig(league_exploiters=0, snapshot_every=100, exploiter_threshold=0.0,
                                                exploiter_min_games=1))
    exploiter = league.trainers[1].learners["player"]
    initial = TensorDict({k: torch.as_tensor(v) for k, v in league._initial[1]["weights"].items()})
    try:
        metrics = league.train()
        assert metrics["league/resets"] == 1 and league.players[-1].name.startswith("main_exploiter_0@")
        trained = league.players[-1].weights  # the exploiter's weights when it was done
        now = TensorDict(dict(exploiter.policy.state_dict()))
        assert (now == initial).all() and not (trained == league.weights_of(1)).all()
        assert exploiter.published()[0] == 2  # above version 1, which the actors had: they load it
        actor = league.trainers[1].fleet.actors[0].policies["player"]
        assert (TensorDict.from_module(actor) == TensorDict.from_module(exploiter.policy)).all()  # actors reset too
        assert league.trainers[1].fleet.actors[0].versions["player"] == 2  # loaded now, before any fragment
        assert float(league.games[1].sum()) == 0  # its games start over with it
        assert float(league.ratings[1]) == INITIAL  # and its rating (a new player); the snapshot keeps the old one
        assert metrics[f"rating/{league.players[-1].name}"] == float(league.ratings[-1]) != INITIAL
        row = league.table()["players"][1]  # every game it played is still counted, though not in the table
        assert row["games"] == metrics["games/main_exploiter_0"] > 0 and row["games_in_table"] == 0
        against = metrics["games/main_exploiter_0"] if metrics["opponent/main_exploiter_0"] == 0 else 0.0
        assert league.table()["players"][0]["games"] == metrics["games/main_0"] + against  # its opponent's too
        league.train()  # trains on from the reset weights
        counts = league.trainers[1].accounting()  # nothing collected lost or counted twice across the reset
        assert counts["fragments_produced"] == 2 == counts["player/fragments_accepted"]
        assert counts["player/fragments_lost"] == counts["player/fragments_stale"] == 0
        assert league.resets == 2  # done again (threshold 0): its second run was snapshotted, then reset
        second = league.players[-1].weights
        assert not (second == trained).all() and not (second == league.weights_of(1)).all()
        league._add_snapshot(1)  # a name taken already (a league saved when names were versions): kept apart
        assert [p.name for p in league.players if p.name.startswith("main_exploiter_0@")] == [
            "main_exploiter_0@1", "main_exploiter_0@2", "main_exploiter_0@2.2"]  # iterations (the reset's version: @3)
    finally:
        league.close()


def test_a_league_refuses_an_env_that_is_not_a_two_player_game():
    with pytest.raises(ValueError, match="two-player zero-sum.*builtin:cartpole"):
        RoleLeague(TrainConfig(env="builtin:cartpole"), LeagueConfig())
    with pytest.raises(ValueError, match="main-agents"):
        LeagueConfig(main_agents=0)
    with pytest.raises(ValueError, match="--league.exploiter-min-games must be >= 1, got 0"):  # named one of two
        LeagueConfig(exploiter_min_games=0)


@pytest.mark.ray
@pytest.mark.slow
def test_the_league_trains_its_players_in_parallel_on_ray(ray_session):
    intervals: dict[int, list[tuple[float, float]]] = {}
    lock = threading.Lock()

    def timed(config):  # the real Ray trainer, its iterations timed from the league's threads
        trainer = build_trainer(config)
        train, index = trainer.train, len(intervals)
        intervals[index] = []

        def wrapped():
            start = time.perf_counter()
            out = train()
            with lock:
                intervals[index].append((start, time.perf_counter()))
            return out

        trainer.train = wrapped
        return trainer

    config = _config(backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0),
                     rollout=RolloutConfig(num_envs=4, fragment_length=32, num_workers=1))
    league = RoleLeague(config, LeagueConfig(snapshot_every=1, league_exploiters=0), build=timed)
    try:
        for _ in range(2):
            metrics = league.train()
            for i, trainer in enumerate(league.trainers):
                opponent = int(metrics[f"opponent/{league.players[i].name}"])
                workers = trainer.fleet.actor_weights(OPPONENT)
                if league.players[opponent].historical:
                    assert all((w == league.players[opponent].weights).all() for w in workers)
                assert metrics[f"games/{league.players[i].name}"] > 0
        assert len(league.players) == 3 + 2 * 2 and all(t.env_steps > 0 for t in league.trainers)
        assert all(f"rating/{p.name}" in metrics for p in league.players)
        for k in range(2):  # the players' k-th iterations overlapped in time: they ran side by side
            spans = [intervals[i][k] for i in range(2)]
            assert max(s for s, _ in spans) < min(e for _, e in spans)
    finally:
        league.close()


def test_shoal_league_trains_writes_checkpoints_a_pool_and_a_table(tmp_path, capsys):
    from orchestration.snapshots import load_snapshot

    main(["league", GAME, "--iterations", "2", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
          "--run-dir", str(tmp_path), "--league.snapshot-every", "1", "--league.league-exploiters", "0",
          "--checkpoint-every", "1", "--keep-checkpoints", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iterations"] == 2 and set(summary["players"]) == {"main_0", "main_exploiter_0"}
    table = json.loads((tmp_path / "league" / "league.json").read_text())
    assert [p["name"] for p in table["players"]][:3] == ["main_0", "main_exploiter_0", "main_0@0"]
    assert len(table["win_rates"]) == len(table["players"]) == 3 + 2 * 2
    pool = sorted((tmp_path / "league" / "pool").iterdir())
    assert len(pool) == 5 and load_snapshot(pool[0]).group == "player"
    assert all(load_snapshot(p).rating is not None for p in pool)  # as LeagueTrainer.save_pool's have
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and "rating/main_0" in rows[0]
    assert len(list((tmp_path / "players" / "main_0" / "checkpoints").glob("ckpt-*"))) == 2  # a league keeps 2
    main(["evaluate", summary["players"]["main_0"], "--opponent", "random", "--episodes", "2"])
    assert '"player_0"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # a misspelt snapshot: the nearest one in the pool, in full
        main(["evaluate", summary["players"]["main_0"], "--opponent", str(pool[0]) + "x"])
    assert stop.value.code == 2 and f"(did you mean {str(pool[0])!r}?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["league", "builtin:cartpole", "--iterations", "1", "--run-dir", str(tmp_path / "x")])
    assert stop.value.code == 2 and "two-player zero-sum" in capsys.readouterr().err


def test_a_diverging_league_ends_in_one_paragraph_with_the_way_to_continue(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["league", GAME, "--iterations", "6", "--rollout.num-envs", "4", "--rollout.fragment-length", "16",
              "--run-dir", str(tmp_path), "--league.league-exploiters", "0", "--lr", "1e30", "--no-anneal-lr",
              "--max-skipped-updates", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert "2 consecutive updates were skipped entirely" in err.strip().splitlines()[-1], err
    assert f"continue with shoal league --resume --run-dir {tmp_path} and, say, a lower --lr" in err, err


def test_a_league_state_loads_into_a_fresh_league_with_the_same_pool_table_and_ratings():
    config = _config(rollout=RolloutConfig(num_envs=4, fragment_length=16))
    rules = LeagueConfig(snapshot_every=1, league_exploiters=0)
    league = RoleLeague(config, rules)
    for _ in range(2):
        league.train()
    saved = league.state()
    league.close()
    again = RoleLeague(config, rules)
    again.load_state_(*saved)
    try:
        assert [p.name for p in again.players] == [p.name for p in league.players] and again.iteration == 2
        assert torch.equal(again.games, league.games) and torch.equal(again.ratings, league.ratings)
        for mine, theirs in zip(again.players, league.players):
            assert mine.historical == theirs.historical and mine.parent == theirs.parent
            if mine.historical:
                assert (mine.weights == theirs.weights).all()
        assert torch.equal(again.generator.get_state(), league.generator.get_state())
        with pytest.raises(ValueError, match="active players"):
            RoleLeague(config, LeagueConfig(main_exploiters=2, league_exploiters=0)).load_state_(*saved)
        weights, tensors, state = saved  # a table of another roster: it failed mid-training (a RuntimeError)
        with pytest.raises(ValueError, match=r"its 'wins' table is \(2, 2\), and its 7 players need \(7, 7\)"):
            RoleLeague(config, rules).load_state_(weights, {**tensors, "wins": torch.zeros(2, 2)}, state)
    finally:
        again.close()


def test_shoal_league_resumes_from_its_checkpoint_with_every_player_at_the_same_iteration(tmp_path, capsys):
    from orchestration.checkpoint import load_checkpoint

    flags = ["--rollout.num-envs", "4", "--rollout.fragment-length", "16", "--run-dir", str(tmp_path),
             "--checkpoint-every", "1", "--league.league-exploiters", "0", "--league.snapshot-every", "1"]
    main(["league", GAME, "--iterations", "2", "--resume=auto", *flags, "--past-selves.fraction", "0.9"])  # starts
    assert "--past-selves.* does not apply to a league" in capsys.readouterr().err  # said, not dropped
    before = json.loads((tmp_path / "league" / "league.json").read_text())
    capsys.readouterr()
    main(["league", "--resume=auto", "--iterations", "3", "--run-dir", str(tmp_path)])  # a checkpoint: resumed
    # the learning rate's schedule goes on as it started (it was stretched to 3 in silence), and that is said
    err = capsys.readouterr().err
    assert "anneals to 0 at iteration 2 (--anneal-iterations, kept from the run resumed)" in err
    assert "not bit-identical" in err and json.loads((tmp_path / "run.json").read_text())["python"]
    assert "opponents are drawn again" not in err  # its iteration 2 had ended: no player was mid-iteration
    from orchestration.run_state import load_config

    assert load_config(load_checkpoint(tmp_path / "players" / "main_0" / "checkpoints")[2]).anneal_iterations == 2
    after = json.loads((tmp_path / "league" / "league.json").read_text())
    assert before["iteration"] == 2 and after["iteration"] == 3
    names = [p["name"] for p in after["players"]]
    assert names[:len(before["players"])] == [p["name"] for p in before["players"]]  # the pool went on
    assert len(names) == len(before["players"]) + 2
    import csv

    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [float(r["iteration"]) for r in rows] == [1.0, 2.0, 3.0]  # one row per iteration, once each
    for name in ("main_0", "main_exploiter_0"):
        _, _, state = load_checkpoint(tmp_path / "players" / name / "checkpoints")
        assert state["iteration"] == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["league", "--resume", "--run-dir", str(tmp_path / "nothing")])
    assert stop.value.code == 2 and "no checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a new league in this one's directory would mix the two
        main(["league", GAME, "--iterations", "1", *flags])
    assert stop.value.code == 2 and "holds a run already" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # another network: the flag is named, not torch's traceback
        main(["league", "--resume", "--iterations", "4", "--run-dir", str(tmp_path), "--policy.hidden-sizes", "8"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--policy.hidden-sizes (64, 64) -> (8,) (size mismatch for" in err, err
    assert "Traceback" not in err and "which changes --policy.hidden-sizes (64" in err  # only what shapes it
    assert json.loads((tmp_path / "league" / "league.json").read_text())["iteration"] == 3  # untouched
    checkpoints = sorted(p.name for p in (tmp_path / "league" / "checkpoints").glob("ckpt-*"))
    main(["league", "--resume", "--iterations", "3", "--run-dir", str(tmp_path)])  # there already: said, not saved
    err = capsys.readouterr().err  # and no not-bit-identical notice for a resume that trains nothing
    assert "at iteration 3 already (--iterations 3); nothing was trained" in err and "bit-identical" not in err
    assert sorted(p.name for p in (tmp_path / "league" / "checkpoints").glob("ckpt-*")) == checkpoints
    for argv, said in ((["evaluate", str(tmp_path)], f"{tmp_path} is a league: each player's checkpoints are under "
                        f"players/ (main_0, main_exploiter_0), e.g. {tmp_path / 'players' / 'main_0' / 'checkpoints'}"),
                       (["evaluate", str(tmp_path / "league" / "checkpoints")], "a league's own checkpoint"),
                       (["evaluate", str(tmp_path / "league" / "pool" / "main_0-at-0")],
                        "checkpoints (a snapshot of league/pool/ plays only as an --opponent)"),
                       (["train", "--resume", "--run-dir", str(tmp_path)], "continue it with shoal league --resume")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err, err
    (tmp_path / "run" / "checkpoints" / "ckpt-000001").mkdir(parents=True)  # a training run's directory
    for argv in (["league", "--resume", "--run-dir", str(tmp_path / "run")],  # neither resumed nor written over
                 ["league", GAME, "--iterations", "1", "--run-dir", str(tmp_path / "run")],
                 ["league", GAME, "--resume=auto", "--iterations", "1", "--run-dir", str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and "continue it with shoal train --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # nor a league by a new training run
        main(["train", "builtin:cartpole", "--iterations", "1", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds a league already" in err and "shoal league --resume" in err, err


def test_shoal_league_on_ray_trains_and_resumes_as_on_the_local_backend(tmp_path, capsys, ray_session):
    """The league's command, its exploiter resets and its resume on Ray: the same table, pool and rows as the local
    backend's with the same seed (players train side by side there, one after another here)."""
    import csv

    def table(path) -> dict:
        out = json.loads((path / "league" / "league.json").read_text())
        return {k: out[k] for k in ("iteration", "players", "win_rates")}

    def rows(path) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith("time") and not k.endswith("per_s")}
                for row in csv.DictReader((path / "metrics.csv").read_text().splitlines())]

    flags = ["--rollout.num-envs", "4", "--rollout.fragment-length", "16", "--checkpoint-every", "1",
             "--league.snapshot-every", "1", "--league.league-exploiters", "0", "--league.exploiter-threshold", "0",
             "--league.exploiter-min-games", "1", "--no-progress"]  # the main exploiter starts over every iteration
    ray = ["--backend", "ray", "--ray.worker-num-cpus", "0", "--ray.learner-num-cpus", "0"]
    for name, backend in (("local", []), ("ray", ray)):
        main(["league", GAME, "--iterations", "2", "--run-dir", str(tmp_path / name), *flags, *backend])
        main(["league", "--resume", "--iterations", "3", "--run-dir", str(tmp_path / name)])
    capsys.readouterr()
    assert table(tmp_path / "ray") == table(tmp_path / "local") and table(tmp_path / "local")["iteration"] == 3
    assert rows(tmp_path / "ray") == rows(tmp_path / "local") and len(rows(tmp_path / "local")) == 3
    exploiter = table(tmp_path / "ray")["players"][1]  # started over: its record wiped, its rating the initial one
    assert exploiter["role"] == "main_exploiter" and exploiter["games_in_table"] < exploiter["games"]
    pools = [sorted(p.name for p in (tmp_path / name / "league" / "pool").iterdir()) for name in ("local", "ray")]
    assert pools[0] == pools[1] and len(pools[0]) == 7


@pytest.mark.ray
def test_a_league_on_ray_refuses_a_cluster_too_small_for_its_players_by_name(ray_session):
    """Every player's learner and workers must fit at once: otherwise some actors wait for CPUs for ever."""
    config = _config(backend="ray", ray=RayConfig(worker_num_cpus=1, learner_num_cpus=1))  # 3 players x 2 CPUs
    with pytest.raises(ValueError, match="reserves 6 CPUs.*3 trainers.*has 2.*--ray.worker-num-cpus"):
        RoleLeague(config, LeagueConfig())
    assert ray_session.is_initialized()  # a cluster it joined stays up


def test_a_league_exploiter_that_is_done_without_a_restart_needs_new_games_to_be_done_again():
    league = RoleLeague(_config(), LeagueConfig(main_exploiters=0, snapshot_every=100, exploiter_threshold=0.0,
                                                exploiter_min_games=25, league_reset=0.0))
    try:
        done_at = []
        for it in range(1, 7):
            size = len(league.players)
            metrics = league.train()
            if len(league.players) > size:
                done_at.append(it)
                assert league.games[1].sum() == 0  # its record starts over
            assert metrics["league/resets"] == 0  # league_reset 0: it keeps learning from where it is
        assert done_at and all(b - a >= 2 for a, b in zip(done_at, done_at[1:]))  # ~12 games per iteration
    finally:
        league.close()
