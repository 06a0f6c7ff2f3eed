"""Every command's user errors: one paragraph on stderr naming the flag, env, key or file at fault (and the nearest
valid choice), exit code 2, never a traceback; tyro's refusals too (:mod:`orchestration.flag_parsing`)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("args, named", [
    (["train", "pettingzoo:connect_four_v3"], "pettingzoo:classic.connect_four_v3"),
    (["train", "builtin:spread", "--policy-mapping", "agent_9", "x"],  # 4 as near: none is the nearest
     "does not have: 'agent_9'; its agents are ['agents_0', 'agents_1', 'agents_2', 'agents_3']"),
    (["train", "pettingzoo:classic.tictactoe_v3", "--policy-mapping", "player_0", "random"],  # two as near: both
     "'player_0' (did you mean 'player_1' or 'player_2'?)"),
    (["train", "--resume", "--run-dir", "nowhere"], "no checkpoint at nowhere"),
    (["evaluate", "nowhere"], "no checkpoint at nowhere"),
    (["train", "builtin:cartpole", "--rollout.num-envs", "2", "--rollout.env-processes", "3"], "cannot exceed"),
    (["trian", "builtin:cartpole"], "unknown command 'trian' (did you mean 'train'?)"),
    (["train", "vmas:navigaton"], "unknown VMAS scenario 'navigaton' (did you mean 'navigation'?)"),
    (["train", "--env", "externl"], "env 'externl' is neither a gymnasium id (did you mean 'external'?) nor one of"),
    (["train", "CartPol-v1"], "env 'CartPol-v1' is neither a gymnasium id (did you mean 'CartPole-v1'?)"),
    (["train", "builtin:spread", "--env-kwargs", "capcity", "3"],
     "env 'builtin:spread': --env-kwargs capcity is not a keyword it takes (did you mean 'capacity'?)"),
    (["train", "CartPole-v1", "--env-kwargs", "render_mod", "human"], "(did you mean 'render_mode'?)"),
    (["train", "CartPole-v1", "--env-kwargs", "max_episode_step", "10"],  # gymnasium.make's, not the env's
     "(did you mean 'max_episode_steps'?)"),
    (["train", "builtin:cartpole", "--env-kwargs", "max_steps", "abc"],
     "--env-kwargs max_steps 'abc' is a str, but max_steps takes an int"),
    (["train", "CartPole-v1", "--env-kwargs", "sutton_barto_reward", "yes"],
     "--env-kwargs sutton_barto_reward 'yes' is a str, but sutton_barto_reward takes a bool"),
    (["train", "builtin:cartpole", "--device", "gpu"], "--device 'gpu' is not a device"),
    (["train", "builtin:cartpole", "--device", "cuda:99"], "--device cuda:99: "),
    (["train", "vmas:navigation", "--env-kwargs", "n_agent", "3"],
     "env 'vmas:navigation': --env-kwargs n_agent is not a keyword it takes (did you mean 'n_agents'?)"),
    (["train", "vmas:navigation", "--env-kwargs", "n_agents", "three"],
     "--env-kwargs n_agents 'three' is a str, but n_agents takes an int or a float"),
    (["train", "mpe2:simple_spread_v3", "--env-kwargs", "N", "three"],
     "--env-kwargs N 'three' is a str, but N takes an int"),
    (["train", "mpe2:simple_spread_v3", "--env-kwargs", "max_cycle", "3"], "(did you mean 'max_cycles'?)"),
    # keywords Shoal sets itself, a device this machine lacks, and values the env's own code refuses while built
    (["train", "vmas:navigation", "--env-kwargs", "num_envs", "4"],
     "env 'vmas:navigation': --env-kwargs num_envs is Shoal's to set: use --rollout.num-envs 4"),
    (["train", "builtin:cartpole", "--env-kwargs", "num_envs", "4"], "use --rollout.num-envs 4"),
    (["train", "builtin:cartpole", "--env-kwargs", "device", "cpux"],  # was torch's RuntimeError, a traceback
     "env 'builtin:cartpole': --env-kwargs device 'cpux': not a device (cpu, cuda, cuda:<index> or mps)"),
    # flags tyro refuses, and values a config refuses while tyro parses: one line, not tyro's box
    (["train", "builtin:cartpole", "--lrr", "3"], "shoal train: Unrecognized options: --lrr, 3; did you mean --lr?"),
    (["train", "--iterations", "2", "pettingzoo:classic.tictactoe_v3"],  # the env after a flag's value
     "Unrecognized options: pettingzoo:classic.tictactoe_v3; the env goes first (shoal train pettingzoo:classic"),
    (["league", "--iterations", "2", "MiniGrid-Empty-5x5-v0"],
     "the env goes first (shoal league MiniGrid-Empty-5x5-v0 ...) or after --env"),
    (["train", "builtin:cartpole", "--devic", "cuda:1"],  # the value of a mistyped flag is no env: no such hint
     "shoal train: Unrecognized options: --devic, cuda:1; did you mean --device? (shoal train --help"),
    (["train", "builtin:cartpole", "--lr", "abc"],
     "--lr: could not convert string to float: 'abc'; it takes --lr FLOAT"),
    (["train", "builtin:cartpole", "--policy.recurrent-critic"], "--policy.recurrent-critic must be False unless"),
    (["train", "builtin:cartpole", "--lr", "inf"], "--lr must be > 0 and finite, got inf"),  # was accepted: NaN losses
    (["train", "builtin:cartpole", "--eval-every", "1", "--eval-episodes", "0"], "--eval-episodes must be >= 1"),
    (["train", "builtin:cartpole", "--seed", "-1"], "--seed must be in [0, 2**62), got -1"),
    (["train", "builtin:cartpole", "--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
    (["train", "builtin:cartpole", "--ray.iteration-timeout-s", "0"], "--ray.iteration-timeout-s must be > 0"),
    (["train", "builtin:cartpole", "--ray.num-cpus", "0"], "--ray.num-cpus must be > 0 (or left out), got 0"),
    (["evaluate"], "shoal evaluate: Missing from shoal evaluate: STR a checkpoint directory"),
    (["train", "--preset", ""], "--preset needs a value"),  # was the defaults, in silence
    (["train", "--preset", "cartpole", "--preset=pendulum"], "--preset is given twice (cartpole and pendulum)"),
    (["train", "torchrl:CartPol-v1"], "env 'torchrl:CartPol-v1': torchrl:ID takes a gymnasium id, and 'CartPol-v1' is "
     "none (did you mean 'CartPole-v1'?)"),  # was gymnasium's "Environment `CartPol-v1` doesn't exist."
    (["train", "--env", ""], "no env named (--env ''): give a gymnasium id such as CartPole-v1"),
    (["conformance", "--command", "sim {port}", "--episodes", "0"], "shoal conformance: --episodes must be >= 1, "
     "got 0"),  # named "episodes and max_acts", max_acts being no flag
    (["league", "builtin:cartpole", "--league.seat", "2"], "shoal league: --league.seat is 0 or 1"),
    (["train", "vmas:navigation", "--env-kwargs", "device", "cuda:7"],
     "env 'vmas:navigation': --env-kwargs device 'cuda:7': no such CUDA device here"),
    (["train", "vmas:navigation", "--env-kwargs", "n_agents", "0"], "env 'vmas:navigation' failed to build with "
     "--env-kwargs n_agents 0: AssertionError at `assert 1 <= self.agents_with_same_goal <= self.n_agents`"),
    (["train", "vmas:balance", "--env-kwargs", "n_agents", "2.5"], "failed to build with --env-kwargs n_agents 2.5: "
     "TypeError: 'float' object cannot be interpreted as an integer"),
    (["train", "mpe2:simple_spread_v3", "--env-kwargs", "N", "0"],
     "env 'mpe2:simple_spread_v3' failed to build with --env-kwargs N 0: ValueError: "),
    (["train", "mpe2:simple_spread_v3", "--env-kwargs", "payoff", "cooperativ"],
     "--env-kwargs payoff 'cooperativ' is not a payoff (did you mean 'cooperative'?)"),
    (["train", "builtin:cartpole", "--seed", str(2 ** 70)], "--seed must be in [0, 2**62)"),  # torch's overflow
    (["train", "builtin:spread", "--env-kwargs", "join_prob", "2.0"],  # a built-in env's refusal: of the keyword
     "env 'builtin:spread' failed to build with --env-kwargs join_prob 2.0: ValueError: "),
    (["train", "mpe2:simple_spread_v3", "--env-kwargs", "action_mask", "non"],  # was the env failing to build
     "env 'mpe2:simple_spread_v3': --env-kwargs action_mask 'non' is not a mask source (did you mean 'none'?)"),
    (["train", "builtin:spred"], "unknown built-in env 'builtin:spred' (did you mean 'builtin:spread'?)"),
    (["train", "builtin:cartpole", "--policy.leaf-encoders", "observation", "impala"],  # was PolicyConfig.leaf_...
     "observation: --policy.leaf-encoders gives observation the 'impala' CNN, but it is not an image"),
    (["plot", "--out", "x.png"], "shoal plot: name the run directories to draw"),
    (["plot", "nowhere"], "shoal plot: nowhere has no metrics.csv"),
    (["serve", "CartPole-v1"], "shoal serve: it trains on external environments only, not CartPole-v1"),
])
def test_a_user_error_exits_with_one_paragraph_naming_the_fault(tmp_path, monkeypatch, capsys, args, named):
    from orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--no-progress"] if args[0] == "train" else args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named in err and "Traceback" not in err and f"shoal {args[0]}: " * 2 not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph: a value a config refuses too (was tyro's box)
