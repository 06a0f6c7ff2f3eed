"""Gymnasium adapters: fidelity against the raw envs in every autoreset mode (adapters/gymnasium_env.py)."""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

from adapters.checking import EnvOutputError, validate_step
from adapters.gymnasium_env import GymnasiumEnv, GymnasiumVectorEnv, make_gymnasium
from adapters.protocol import BatchedEnv
from core.specs import AgentNode, groups, zeros

SEED = 7


def reference(env_id: str, num_envs: int, actions: np.ndarray, **kwargs) -> list[dict]:
    """The ground truth: single envs stepped by hand, reset (seed=None) right after an episode ends."""
    envs = [gym.make(env_id, **kwargs) for _ in range(num_envs)]
    obs = [env.reset(seed=SEED + i)[0] for i, env in enumerate(envs)]
    steps = [{"obs": np.stack(obs)}]
    for t in range(actions.shape[0]):
        out = {k: [] for k in ("next", "reward", "terminated", "truncated", "obs")}
        for i, env in enumerate(envs):
            o, r, term, trunc, _ = env.step(int(actions[t, i]))
            out["next"].append(o)
            out["reward"].append(r)
            out["terminated"].append(term)
            out["truncated"].append(trunc)
            out["obs"].append(env.reset()[0] if term or trunc else o)
        steps.append({k: np.stack(v) for k, v in out.items()})
    return steps


def action_td(a: np.ndarray) -> TensorDict:
    e = a.shape[0]
    return TensorDict({"agent": TensorDict({"action": torch.from_numpy(a).long().reshape(e, 1)},
                                           batch_size=(e, 1))}, batch_size=(e,))


def run_adapter(env: BatchedEnv, actions: np.ndarray) -> list:
    outs = [env.reset(seed=SEED)]
    for t in range(actions.shape[0]):
        outs.append(env.step(action_td(actions[t])))
    return outs


def assert_matches(outs, ref, tree) -> None:
    """Every observation, reward and flag of every step lands in the right env slot."""
    np.testing.assert_array_equal(outs[0]["agent", "observation"][:, 0].numpy(), ref[0]["obs"])
    episodes = 0
    for out, want in zip(outs[1:], ref[1:]):
        validate_step(out, tree)
        np.testing.assert_array_equal(out["next", "agent", "observation"][:, 0].numpy(), want["next"])
        np.testing.assert_allclose(out["next", "agent", "reward"][:, 0, 0].numpy(), want["reward"])
        for flag in ("terminated", "truncated"):
            np.testing.assert_array_equal(out["next", "agent", flag][:, 0, 0].numpy(), want[flag])
            np.testing.assert_array_equal(out["next", flag][:, 0].numpy(), want[flag])
        np.testing.assert_array_equal(out["next", "done"][:, 0].numpy(), want["terminated"] | want["truncated"])
        np.testing.assert_array_equal(out["agent", "observation"][:, 0].numpy(), want["obs"])
        assert out["agent", "mask"].all() and out["next", "agent", "mask"].all()
        episodes += int(out["next", "done"].sum())
    assert episodes >= 2 * outs[0].batch_size[0]  # several episodes per env, resets included


def draw(steps: int, num_envs: int, n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, (steps, num_envs))


@pytest.mark.parametrize("mode, direct", [(AutoresetMode.NEXT_STEP, True), (AutoresetMode.NEXT_STEP, False),
                                          (AutoresetMode.SAME_STEP, False), (AutoresetMode.DISABLED, True),
                                          (AutoresetMode.DISABLED, False)])
def test_sync_vector_env_matches_raw_envs_in_every_autoreset_mode(mode, direct):
    actions = draw(120, 4)
    vec = SyncVectorEnv([partial(gym.make, "CartPole-v1")] * 4, autoreset_mode=mode)
    env = GymnasiumVectorEnv(vec)
    assert env._direct == (mode != AutoresetMode.SAME_STEP)
    env._direct = direct  # direct sub-env resets (fast path) or gymnasium's reset_mask (public path)
    assert isinstance(env, BatchedEnv) and env.num_envs == 4
    assert_matches(run_adapter(env, actions), reference("CartPole-v1", 4, actions), env.tree)
    assert env.counters["invalid_output_truncations"] == 0
    env.close()


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_async_vector_env_matches_raw_envs(mode):
    actions = draw(40, 2, n=3, seed=1)
    vec = AsyncVectorEnv([partial(gym.make, "Acrobot-v1", max_episode_steps=10)] * 2, autoreset_mode=mode)
    env = GymnasiumVectorEnv(vec)
    try:
        assert_matches(run_adapter(env, actions), reference("Acrobot-v1", 2, actions, max_episode_steps=10),
                       env.tree)
    finally:
        env.close()


def test_async_next_step_without_shared_memory_is_refused():
    vec = AsyncVectorEnv([partial(gym.make, "CartPole-v1")] * 2, shared_memory=False)
    try:
        with pytest.raises(ValueError, match="shared_memory"):
            GymnasiumVectorEnv(vec)
    finally:
        vec.close()


@pytest.mark.parametrize("vectorization", ["sync", "none"])
def test_make_gymnasium_matches_raw_envs(vectorization):
    n = 3 if vectorization == "sync" else 1
    actions = draw(100, n, seed=2)
    env = make_gymnasium("CartPole-v1", n, vectorization=vectorization)
    assert isinstance(env, GymnasiumEnv if vectorization == "none" else GymnasiumVectorEnv)
    if vectorization == "sync":
        assert env.autoreset_mode == AutoresetMode.NEXT_STEP and env._direct
    assert_matches(run_adapter(env, actions), reference("CartPole-v1", n, actions), env.tree)
    env.close()


def test_tree_group_and_step_layout_match_core_specs():
    env = make_gymnasium("CartPole-v1", 2)
    assert isinstance(env.tree, AgentNode)
    (group,) = groups(env.tree).values()
    assert group.name == "agent" and group.capacity == 1
    first = env.reset(seed=0)
    out = env.step(action_td(np.array([0, 1])))
    expected = zeros(env.tree, (2,))
    assert set(first.keys(True, True)) == set(expected.exclude(("agent", "action")).keys(True, True))
    for key in first.keys(True, True):
        assert first[key].shape == expected[key].shape and first[key].dtype == expected[key].dtype
    assert out["next", "agent", "reward"].shape == (2, 1, 1) and out["next", "agent", "reward"].dtype == torch.float32
    assert out["next", "done"].shape == (2, 1)
    # no env ended: the root is the observation after the step (tensors may be shared: they are read-only)
    assert not out["next", "done"].any()
    assert torch.equal(out["agent", "observation"], out["next", "agent", "observation"])
    env.close()


def test_vector_env_that_reuses_its_arrays_is_copied():
    vec = SyncVectorEnv([partial(gym.make, "CartPole-v1")] * 2, copy=False, autoreset_mode=AutoresetMode.DISABLED)
    env = GymnasiumVectorEnv(vec)
    first = env.reset(seed=0)["agent", "observation"].clone()
    out = env.reset(seed=0)
    outs = [env.step(action_td(np.array([1, 1]))) for _ in range(3)]
    np.testing.assert_array_equal(out["agent", "observation"].numpy(), first.numpy())
    assert not torch.equal(outs[0]["next", "agent", "observation"], outs[2]["next", "agent", "observation"])
    env.close()


class EchoEnv(gym.Env):
    """A real gymnasium env with composite spaces that echoes the action it received in its observation."""

    action_space = spaces.Dict({"move": spaces.MultiDiscrete([3, 3], start=[-1, -1]), "fire": spaces.Discrete(2)})
    observation_space = spaces.Tuple((spaces.Box(-1, 1, (2,), np.int64), spaces.Discrete(2)))

    def __init__(self) -> None:
        self.received = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return (np.zeros(2, np.int64), 0), {}

    def step(self, action):
        assert self.action_space.contains(action)
        self.received.append(action)
        return (np.asarray(action["move"]), int(action["fire"])), 0.5, False, len(self.received) % 3 == 0, {}


@pytest.mark.parametrize("vector", [False, True])
def test_composite_actions_and_observations_round_trip(vector):
    env = GymnasiumVectorEnv(SyncVectorEnv([EchoEnv] * 2, autoreset_mode=AutoresetMode.SAME_STEP)) if vector \
        else GymnasiumEnv(EchoEnv())
    e = env.num_envs
    assert list(env.tree.action.children) == ["fire", "move"]  # gymnasium sorts Dict keys
    td = env.reset(seed=0)
    assert td["agent", "observation", "0"].shape == (e, 1, 2) and "action_mask" not in td["agent"].keys()
    move = torch.tensor([[0, 2], [1, 1]])[:e].reshape(e, 1, 2)  # Shoal values 0..nvec-1
    act = TensorDict({"agent": TensorDict({"action": {"move": move, "fire": torch.ones(e, 1, dtype=torch.int64)}},
                                          batch_size=(e, 1))}, batch_size=(e,))
    out = env.step(act)
    received = env.env.envs[0].received if vector else env.env.received
    np.testing.assert_array_equal(received[0]["move"], [-1, 1])  # gymnasium values: start added back
    np.testing.assert_array_equal(out["next", "agent", "observation", "0"][:, 0].numpy(), move[:, 0].numpy() - 1)
    assert out["next", "agent", "observation", "1"][:, 0].tolist() == [1] * e
    for _ in range(2):
        out = env.step(act)
    assert out["next", "truncated"].all() and not out["next", "terminated"].any()
    env.close()
    env.close()  # idempotent


class ArrayRewardEnv(gym.Env):
    """A real gymnasium env whose second step returns a reward array instead of one number (a user's mistake)."""

    action_space, observation_space = spaces.Discrete(2), spaces.Box(-1, 1, (3,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), np.ones(2) if self.t == 2 else 1.0, False, False, {}


def test_a_reward_that_is_not_one_number_is_named_with_its_key():
    """gymnasium's vector env fails to store it ("setting an array element with a sequence"): the error names the
    key and says what a step returns (a user's mistake: one paragraph at the CLI), not numpy's words alone."""
    env = GymnasiumVectorEnv(SyncVectorEnv([ArrayRewardEnv] * 2))
    env.reset(seed=0)
    act = TensorDict({"agent": TensorDict({"action": torch.zeros(2, 1, dtype=torch.int64)}, batch_size=(2, 1))},
                     batch_size=(2,))
    env.step(act)
    with pytest.raises(EnvOutputError, match=r"^agent 'agent', key next/agent/reward: a sub-env's step returned a "
                                             r"reward, terminated or truncated that is not one number"):
        env.step(act)
    env.close()


class _OldApiEnv(gym.Env):
    """CartPole-shaped env whose ``fault`` breaks the gymnasium (>= 0.26) API's form."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def reset(self, seed=None, options=None):
        obs = np.zeros(2, np.float32)
        return obs if self.fault == "reset_obs" else (obs, {})

    def step(self, action):
        obs = np.zeros(2, np.float32)
        if self.fault == "four":
            return obs, 1.0, False, {}
        return obs, 1.0, "False" if self.fault == "str_flag" else False, False, {}


@pytest.mark.parametrize("fault, named", [
    ("str_flag", "key next/agent/terminated: step() returned terminated 'False' (str), not a bool"),
    ("four", "key next: step() returned a tuple of 4 values; it returns (observation, reward, terminated, truncated"),
    ("reset_obs", "key observation: reset() returned a ndarray; it returns (observation, info)"),
])
def test_a_vector_env_of_sub_envs_off_the_gymnasium_api_names_the_sub_env_and_the_value(fault, named):
    """A SyncVectorEnv stores what it gets: a "False" flag ended every step in silence; a 4-value step or an
    observation-only reset failed inside gymnasium with an unpacking error naming neither env nor method."""
    env = GymnasiumVectorEnv(SyncVectorEnv([partial(_OldApiEnv, fault)] * 2))
    with pytest.raises(EnvOutputError, match=named.replace("(", r"\(").replace(")", r"\)")):
        env.reset(seed=0)
        env.step(TensorDict({"agent": TensorDict({"action": torch.zeros(2, 1, dtype=torch.int64)}, [2, 1])}, [2]))
    fine = GymnasiumVectorEnv(SyncVectorEnv([partial(_OldApiEnv, "none")] * 2))
    fine.reset(seed=0)
    for _ in range(2):  # the check steps aside after the first call: the env's own method is back
        out = fine.step(TensorDict({"agent": TensorDict({"action": torch.zeros(2, 1, dtype=torch.int64)}, [2, 1])},
                                   [2]))
        assert not out["next", "agent", "terminated"].any()
    assert "step" not in vars(fine.env.envs[0]) and "reset" not in vars(fine.env.envs[0])


def taxi_reference(num_envs: int, steps: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Raw Taxi-v4 copies (10-step episodes) acting uniformly among the actions each one's info mask allows:
    the actions ``[T, E]`` and the masks of every root ``[E, 6]`` (after a reset: the reset's)."""
    rng = np.random.default_rng(0)
    envs = [gym.make("Taxi-v4", max_episode_steps=10) for _ in range(num_envs)]
    masks = [env.reset(seed=SEED + i)[1]["action_mask"] for i, env in enumerate(envs)]
    actions, roots = [], [np.stack(masks)]
    for _ in range(steps):
        actions.append([int(rng.choice(np.flatnonzero(m))) for m in masks])
        for i, env in enumerate(envs):
            _, _, term, trunc, info = env.step(actions[-1][i])
            masks[i] = (env.reset()[1] if term or trunc else info)["action_mask"]
        roots.append(np.stack(masks))
    return np.array(actions), roots


@pytest.mark.parametrize("how", ["none", "direct", "public", "same_step"])
def test_an_info_action_mask_is_every_roots_and_a_masked_action_never_reaches_the_env(how):
    """Taxi-v4 gives ``info["action_mask"]``: each step's ``("agent", "action_mask")`` is the mask of the env's
    observation there (a reset's after an episode ends), in every vectorisation and reset path; an action it
    forbids is refused before it is sent. It used to be all True: the policy chose illegal moves."""
    from adapters.checking import IllegalActionError

    n = 1 if how == "none" else 3
    actions, roots = taxi_reference(n, 40)
    if how == "none":
        env = make_gymnasium("Taxi-v4", 1, vectorization="none", max_episode_steps=10)
    else:
        mode = AutoresetMode.SAME_STEP if how == "same_step" else AutoresetMode.NEXT_STEP
        env = GymnasiumVectorEnv(SyncVectorEnv([partial(gym.make, "Taxi-v4", max_episode_steps=10)] * n,
                                               autoreset_mode=mode))
        env._direct = how == "direct"
    outs = run_adapter(env, actions)
    for out, want in zip(outs, roots):
        np.testing.assert_array_equal(out["agent", "action_mask"][:, 0].numpy(), want.astype(bool))
    assert sum(int(out["next", "done"].sum()) for out in outs[1:]) >= 3 * n
    illegal = (~outs[-1]["agent", "action_mask"][:, 0]).float().argmax(-1).numpy()
    with pytest.raises(IllegalActionError, match="is masked"):
        env.step(action_td(illegal))
    env.close()


class MaskInObservationEnv(gym.Env):
    """Its observation ``Dict`` carries the mask: action ``t % 3`` is illegal at step ``t``."""

    def __init__(self, action_space=None) -> None:
        self.observation_space = spaces.Dict({"observation": spaces.Box(0, 100, (1,), np.float32),
                                              "action_mask": spaces.MultiBinary(3)})
        self.action_space = action_space or spaces.Discrete(3)

    def _obs(self):
        mask = np.ones(3, np.int8)
        mask[self.t % 3] = 0
        return {"observation": np.array([self.t], np.float32), "action_mask": mask}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, False, self.t >= 5, {}


class StepMaskEnv(MaskInObservationEnv):
    """Its ``info`` carries a mask after a step only (action 0 illegal); its reset gives none."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = self.observation_space["observation"]

    def reset(self, seed=None, options=None):
        return super().reset(seed=seed)[0]["observation"], {}

    def step(self, action):
        self.t += 1
        return np.array([self.t], np.float32), 1.0, False, self.t >= 2, {"action_mask": np.array([0, 1, 1], np.int8)}


@pytest.mark.parametrize("direct", [True, False])
def test_a_mask_lasts_as_long_as_the_observation_it_came_with(direct):
    """A reset without a mask allows every action: the previous episode's last mask did not carry over."""
    env = GymnasiumVectorEnv(SyncVectorEnv([StepMaskEnv] * 2))
    env._direct = direct
    out, legal = env.reset(seed=0), []
    for _ in range(4):
        out = env.step(action_td(np.ones(2, np.int64)))
        legal.append(out["agent", "action_mask"][0, 0].tolist())
    assert legal == [[False, True, True], [True, True, True]] * 2  # steps 1 and 3 masked, 2 and 4 reset
    env.close()


def test_a_mask_in_the_observation_dict_leaves_it_for_the_action_mask():
    env = GymnasiumVectorEnv(SyncVectorEnv([MaskInObservationEnv] * 2))
    assert groups(env.tree)["agent"].agent.observation.shape == (1,)  # the "observation" entry alone
    out = env.reset(seed=0)
    for t in range(1, 8):
        assert out["agent", "action_mask"][:, 0].tolist() == [[i != (t - 1) % 5 % 3 for i in range(3)]] * 2
        out = env.step(action_td(np.full(2, (t - 1) % 5 % 3 + 1) % 3))
    kept = GymnasiumVectorEnv(SyncVectorEnv([MaskInObservationEnv] * 2), action_mask="none")
    assert "action_mask" in groups(kept.tree)["agent"].agent.observation.children  # kept as an observation
    with pytest.raises(ValueError, match="'action_mask' in its observation, but Shoal applies an env's action mask "
                                         "to a Discrete action only .*--env-kwargs action_mask none"):
        GymnasiumEnv(MaskInObservationEnv(spaces.MultiDiscrete([3, 2])))
    for adapter in (env, kept):
        adapter.close()
