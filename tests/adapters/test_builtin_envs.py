"""Built-in envs: CartPole against gymnasium CartPole-v1, Spread's masks, and the ecosystem checkers."""

from __future__ import annotations

import warnings

import gymnasium
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from adapters.builtin import CartPole, CartPoleConfig, Spread, SpreadConfig
from adapters.builtin.cartpole import THETA_THRESHOLD
from adapters.protocol import BatchedEnv
from core.layout import ACTION, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import groups, validate


def _actions(group: str, action: torch.Tensor) -> TensorDict:
    return TensorDict({group: TensorDict({ACTION: action}, batch_size=action.shape[:2])}, batch_size=action.shape[:1])


def _check_step(out: TensorDict, tree) -> None:
    validate(out, tree)
    validate(out.get(NEXT), tree)
    for g in groups(tree):
        nxt = out.get((NEXT, g))
        assert torch.equal(nxt.get(DONE), nxt.get(TERMINATED) | nxt.get(TRUNCATED))
        assert nxt.get(REWARD).dtype == torch.float32 and nxt.get(REWARD).shape[-1] == 1
    root = out.get(NEXT)
    assert torch.equal(root.get(DONE), root.get(TERMINATED) | root.get(TRUNCATED))


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_cartpole_matches_gymnasium_step_by_step(dtype, atol):
    n = 8
    env = CartPole(CartPoleConfig(num_envs=n, dtype=dtype))
    assert isinstance(env, BatchedEnv) and list(groups(env.tree)) == ["agent"]
    gym_env = gymnasium.make("CartPole-v1").unwrapped
    gym_env.reset(seed=0)
    env.reset(seed=0)
    generator, terminations = torch.Generator().manual_seed(1), 0
    for _ in range(300):
        action = torch.randint(0, 2, (n, 1), generator=generator)
        states = env.state.double().numpy().copy()
        out = env.step(_actions("agent", action))
        nxt = out.get((NEXT, "agent"))
        for i in range(n):
            gym_env.state, gym_env.steps_beyond_terminated = states[i], None
            obs, reward, terminated, truncated, _ = gym_env.step(int(action[i, 0]))
            np.testing.assert_allclose(nxt.get(OBSERVATION)[i, 0].numpy(), obs, rtol=0, atol=atol)
            assert float(nxt.get(REWARD)[i, 0, 0]) == reward
            assert bool(nxt.get(TERMINATED)[i, 0, 0]) == terminated
            terminations += terminated
    assert terminations > 50  # random actions end an episode every ~20 steps: the check saw many terminations
    _check_step(out, env.tree)


def test_cartpole_partial_reset_keeps_final_obs():
    env = CartPole(CartPoleConfig(num_envs=4))
    env.reset(seed=0)
    state = torch.zeros(4, 4)
    state[0, 2], state[0, 3] = 0.2, 2.0  # falls at the next step
    env.state = state
    env.steps = torch.tensor([3, 3, 499, 3])  # env 2 reaches the time limit upright
    out = env.step(_actions("agent", torch.zeros(4, 1, dtype=torch.int64)))
    _check_step(out, env.tree)
    nxt, root = out.get((NEXT, "agent")), out.get("agent")
    assert out.get((NEXT, TERMINATED)).view(-1).tolist() == [True, False, False, False]
    assert out.get((NEXT, TRUNCATED)).view(-1).tolist() == [False, False, True, False]
    assert nxt.get(OBSERVATION)[0, 0, 2] > THETA_THRESHOLD  # the final observation, not the reset one
    assert root.get(OBSERVATION)[[0, 2]].abs().max() <= 0.05  # fresh episodes
    assert torch.equal(root.get(OBSERVATION)[[1, 3]], nxt.get(OBSERVATION)[[1, 3]])  # running envs go on
    assert env.steps.tolist() == [0, 4, 0, 4]


def test_cartpole_observations_observe_the_state_and_never_change_once_handed_out():
    """Observations are views of the env's state (no transposed copy): a step must never write into a state
    it already handed out, or the fragments that hold earlier steps would change under the learner."""
    env = CartPole(CartPoleConfig(num_envs=64))
    first = env.reset(seed=0).get(("agent", OBSERVATION))
    assert torch.equal(first.squeeze(1), env.state)
    handed = [(first, first.clone())]  # (what the env handed out, a copy taken at once)
    g, resets = torch.Generator().manual_seed(0), 0
    for _ in range(40):  # random actions: episodes end and reset every ~20 steps
        out = env.step(_actions("agent", torch.randint(0, 2, (64, 1), generator=g)))
        root, final = out.get(("agent", OBSERVATION)), out.get((NEXT, "agent", OBSERVATION))
        assert torch.equal(root.squeeze(1), env.state)  # after the partial reset
        handed += [(root, root.clone()), (final, final.clone())]
        resets += int(out.get((NEXT, DONE)).sum())
    assert resets > 5
    assert all(torch.equal(now, then) for now, then in handed)


def test_cartpole_state_dict_resumes_the_batch_exactly_and_public_state_is_a_copy():
    env, g = CartPole(CartPoleConfig(num_envs=32)), torch.Generator().manual_seed(1)
    env.reset(seed=0)
    for _ in range(30):
        env.step(_actions("agent", torch.randint(0, 2, (32, 1), generator=g)))
    saved = env.state_dict()
    assert saved["state"].shape == (4, 32) and saved["steps"].shape == (32,)  # the layout of older checkpoints
    steps, state = env.steps, env.state
    resumed = CartPole(CartPoleConfig(num_envs=32))
    resumed.load_state_dict(saved)
    for _ in range(30):
        action = _actions("agent", torch.randint(0, 2, (32, 1), generator=g))
        a, b = env.step(action), resumed.step(action)
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys(True, True))
    assert torch.equal(steps, saved["steps"]) and torch.equal(state, saved["state"].t())  # read before: unchanged
    now = env.state
    now.fill_(1.0)  # a caller writing into what it read changes nothing in the env
    assert not torch.equal(env.state, now)


def test_cartpole_refuses_actions_of_another_batch():
    env = CartPole(CartPoleConfig(num_envs=8))
    env.reset(seed=0)
    with pytest.raises(RuntimeError):
        env.step(_actions("agent", torch.zeros(1, 1, dtype=torch.int64)))


def test_cartpole_seeding():
    env = CartPole(CartPoleConfig(num_envs=16))
    first = env.reset(seed=3).get(("agent", OBSERVATION))
    assert torch.equal(first, env.reset(seed=3).get(("agent", OBSERVATION)))
    assert not torch.equal(first, env.reset(seed=4).get(("agent", OBSERVATION)))
    assert not torch.equal(first, env.reset().get(("agent", OBSERVATION)))  # None continues the stream


@pytest.mark.filterwarnings("ignore:.*Box observation space m.* value is .*infinity")  # as for gymnasium's own
def test_gymnasium_check_env_passes_on_the_single_env_view():
    from gymnasium.utils.env_checker import check_env

    from adapters.builtin.views import as_gymnasium

    env = as_gymnasium()
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4,) and env.observation_space.contains(obs)
    total, ended = 0.0, False
    while not ended:
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        total, ended = total + reward, terminated or truncated
    assert 5 <= total <= 500
    obs, _ = env.reset(seed=0)
    obs[:] = 100.0  # observations are the caller's: writing into one never reaches the env's state
    assert np.abs(env.step(0)[0]).max() < 1.0


def _run_spread(env: Spread, steps: int, seed: int):
    """Yields (step output, root mask before the step) under random actions."""
    generator = torch.Generator().manual_seed(seed)
    root = env.reset(seed=seed)
    for _ in range(steps):
        action = torch.randint(0, 5, root.get(("agents", MASK)).shape, generator=generator)
        out = env.step(_actions("agents", action))
        yield out, root.get(("agents", MASK))
        root = out.exclude(NEXT)


def test_spread_masks_absent_agents_and_agents_never_come_back():
    config = SpreadConfig(num_envs=16, capacity=4, min_agents=2, max_agents=3, join_prob=0.05, max_steps=30)
    env = Spread(config)
    start = env.reset(seed=0).get(("agents", MASK)).sum(1)
    assert start.min() >= 2 and start.max() <= 3
    gone = torch.zeros(16, 4, dtype=torch.bool)
    arrivals = joins = 0
    for out, before in _run_spread(env, 200, seed=0):
        _check_step(out, env.tree)
        nxt, root = out.get((NEXT, "agents")), out.get("agents")
        assert torch.equal(nxt.get(MASK), before)
        absent = ~before
        assert not nxt.get(OBSERVATION)[absent].any() and not nxt.get(REWARD)[absent].any()
        assert not nxt.get(DONE)[absent].any()
        assert not root.get(OBSERVATION)[~root.get(MASK)].any()
        left = nxt.get(TERMINATED).squeeze(-1)
        ended = out.get((NEXT, DONE)).squeeze(-1)
        gone = (gone | left) & ~ended.unsqueeze(1)
        assert not (root.get(MASK) & gone).any()  # a leaver is absent until its env's episode ends
        arrivals += int(left.sum())
        joins += int((root.get(MASK) & ~before & ~ended.unsqueeze(1)).sum())
        # every env's episode flag agrees with its agents: terminated when nobody is left
        assert torch.equal(out.get((NEXT, TERMINATED)).squeeze(-1) & ~ended, torch.zeros(16, dtype=torch.bool))
    assert arrivals > 0 and joins > 0


def test_spread_ignores_actions_of_absent_agents():
    outs = []
    for garbage in (0, 3):
        env = Spread(SpreadConfig(num_envs=8, join_prob=0.1))
        root, generator, steps = env.reset(seed=1), torch.Generator().manual_seed(2), []
        for _ in range(20):
            mask = root.get(("agents", MASK))
            action = torch.where(mask, torch.randint(0, 5, mask.shape, generator=generator), garbage)
            out = env.step(_actions("agents", action))
            steps.append(out)
            root = out.exclude(NEXT)
        outs.append(torch.stack(steps))
    assert (outs[0] == outs[1]).all()


def test_spread_shared_reward_is_the_team_mean():
    env = Spread(SpreadConfig(num_envs=8, shared_reward=True))
    for out, before in _run_spread(env, 10, seed=0):
        reward = out.get((NEXT, "agents", REWARD)).squeeze(-1)
        for e in range(8):
            values = reward[e][before[e]]
            assert torch.allclose(values, values[0].expand_as(values))
        assert out.get(SHARED).shape == (8, 28)


def test_spread_heading_for_the_landmark_beats_random():
    """The dense reward points the right way: a greedy mover collects far more than random actions."""
    def greedy(env: Spread) -> torch.Tensor:
        delta = env.goal - env.pos - 0.3 * env.vel  # brake before arriving
        horizontal = delta[..., 0].abs() >= delta[..., 1].abs()
        return torch.where(horizontal, torch.where(delta[..., 0] < 0, 1, 2), torch.where(delta[..., 1] < 0, 3, 4))

    returns, arrivals = [], []
    for policy in ("greedy", "random"):
        env, generator = Spread(SpreadConfig(num_envs=64, join_prob=0.0)), torch.Generator().manual_seed(0)
        env.reset(seed=0)
        total = arrived = 0.0
        for _ in range(50):
            action = greedy(env) if policy == "greedy" else torch.randint(0, 5, (64, 4), generator=generator)
            nxt = env.step(_actions("agents", action)).get((NEXT, "agents"))
            total, arrived = total + float(nxt.get(REWARD).sum()), arrived + int(nxt.get(TERMINATED).sum())
        returns.append(total)
        arrivals.append(arrived)
    assert returns[0] > returns[1] / 10 and arrivals[0] > 10 * max(arrivals[1], 1)


@pytest.mark.filterwarnings("ignore:The old environment creation API:DeprecationWarning")  # pettingzoo.test import
def test_pettingzoo_parallel_api_test_passes_on_the_parallel_view():
    from pettingzoo.test import parallel_api_test, parallel_seed_test

    from adapters.builtin.views import as_pettingzoo

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the API test only warns about keys; make those fail here
        parallel_api_test(as_pettingzoo(SpreadConfig(join_prob=0.1)), num_cycles=200)
    parallel_seed_test(lambda: as_pettingzoo(SpreadConfig(join_prob=0.1)), num_cycles=100)
    env = as_pettingzoo()
    obs, _ = env.reset(seed=0)
    assert set(obs) == set(env.agents) and env.state().shape == (28,)


def test_spread_resumes_exactly_from_its_state_dict():
    """It had none: a resumed run started new episodes everywhere (docs/ray.md says built-in envs resume)."""
    config = SpreadConfig(num_envs=8, join_prob=0.3)
    a, b = Spread(config), Spread(config)
    a.reset(seed=3)
    actions = TensorDict({("agents", ACTION): torch.randint(0, 5, (8, config.capacity))}, batch_size=[8])
    for _ in range(5):
        a.step(actions)
    b.reset(seed=99)
    b.load_state_dict(a.state_dict())
    for _ in range(30):  # across episode ends and joins: the generator goes on too
        assert (a.step(actions) == b.step(actions)).all()
