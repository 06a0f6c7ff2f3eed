"""PettingZoo adapters: fidelity against the raw envs, groups, masks, joining/leaving agents, AEC rewards."""

from __future__ import annotations

import importlib.util
import warnings
from collections import defaultdict
from functools import partial

import numpy as np
import pytest
import torch
from gymnasium import spaces
from mpe2 import simple_spread_v3, simple_tag_v3, simple_world_comm_v3
from pettingzoo import ParallelEnv
from pettingzoo.test import parallel_api_test
from tensordict import TensorDict

with warnings.catch_warnings():  # pettingzoo 1.27 flags its own `from pettingzoo.classic import ..._vN`
    warnings.simplefilter("ignore", DeprecationWarning)
    from pettingzoo.classic import connect_four_v3

from adapters.checking import EnvOutputError, IllegalActionError, validate_step
from adapters.pettingzoo_env import PettingZooAECEnv, PettingZooParallelEnv
from adapters.protocol import BatchedEnv
from core.specs import agent_index, groups, shared_observations

SEED = 3


class JoinLeaveEnv(ParallelEnv):
    """A real ParallelEnv: walker_2 joins at t=2, walker_0 terminates at t=3, the rest truncate at t=6.

    Action masks come in ``infos``; ``fault`` makes it emit an unknown agent, drop one without a flag, leave out
    the reward of one that acted, or keep one that ended in ``agents``.
    """

    metadata = {"name": "join_leave_v0"}

    def __init__(self, fault: str | None = None) -> None:
        self.possible_agents = ["walker_0", "walker_1", "walker_2"]
        self._obs_space = {a: spaces.Box(-100, 100, (2,), np.float32) for a in self.possible_agents}
        self._act_space = {a: spaces.Discrete(3) for a in self.possible_agents}
        self.fault, self.received, self.rng = fault, [], np.random.default_rng(0)

    def observation_space(self, agent):
        return self._obs_space[agent]

    def action_space(self, agent):
        return self._act_space[agent]

    def _obs(self, agent):
        return np.array([self.t, self.possible_agents.index(agent) + self.offset], np.float32)

    def _info(self, agent):
        mask = np.ones(3, np.int8)
        mask[(self.t + self.possible_agents.index(agent)) % 3] = 0
        return {"action_mask": mask}

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.offset, self.t = float(self.rng.integers(0, 10)), 0
        self.agents = ["walker_0", "walker_1"]
        return {a: self._obs(a) for a in self.agents}, {a: self._info(a) for a in self.agents}

    def step(self, actions):
        self.received.append(dict(actions))
        self.t += 1
        if self.t == 2:
            self.agents.append("walker_2")
        obs = {a: self._obs(a) for a in self.agents}
        rewards = {a: float(actions.get(a, 0)) + 10 * self.possible_agents.index(a) for a in self.agents}
        terms = {a: a == "walker_0" and self.t == 3 or self.fault == "zombie" and (a, self.t) == ("walker_1", 2)
                 for a in self.agents}  # zombie: ended, yet kept in agents below (PettingZoo removes it)
        truncs = {a: self.t >= 6 for a in self.agents}
        if self.fault == "unknown" and self.t == 2:
            obs["ghost_0"] = np.zeros(2, np.float32)
        if self.fault == "vanish" and self.t == 2:
            self.agents.remove("walker_1")
        if self.fault == "no_reward" and self.t == 2:  # walker_1 acted: its reward must not read as 0
            rewards.pop("walker_1")
        if self.fault == "four" and self.t == 2:  # the old API: one dict of dones
            dones = {a: terms[a] or truncs[a] for a in self.agents}
            return obs, rewards, dones, {a: self._info(a) for a in self.agents}
        if self.fault == "str_flag" and self.t == 2:  # "False" is a non-empty string: read as True, it ended them
            truncs = {a: "False" for a in self.agents}
        infos = {a: self._info(a) for a in self.agents}
        self.agents = [a for a in self.agents if not (terms[a] or truncs[a]) or self.fault == "zombie"]
        return obs, rewards, terms, truncs, infos


def sample_actions(td: TensorDict, tree, gen: torch.Generator) -> TensorDict:
    """Uniform legal actions for every slot (absent slots too: they must be ignored)."""
    out = TensorDict(batch_size=td.batch_size)
    for name, g in groups(tree).items():
        probs = td[name, "action_mask"].float()
        e, a, n = probs.shape
        action = torch.multinomial(probs.reshape(-1, n), 1, generator=gen).reshape(e, a)
        out[name] = TensorDict({"action": action}, batch_size=(e, a))
    return out


def check_root(td, raw, e, index, obs, infos) -> None:
    live = set(raw.agents)
    for agent, (g, s) in index.items():
        assert bool(td[g, "mask"][e, s]) == (agent in live), (e, agent)
        if agent in live:
            np.testing.assert_array_equal(td[g, "observation"][e, s].numpy(), obs[agent])
            if "action_mask" in infos.get(agent, {}):
                assert td[g, "action_mask"][e, s].tolist() == infos[agent]["action_mask"].astype(bool).tolist()


def run_parallel_pair(env_fn, num_envs: int, steps: int, **kwargs) -> tuple[list, PettingZooParallelEnv]:
    """Steps the adapter and raw copies with the same seeds and actions; asserts every slot on the way."""
    env = PettingZooParallelEnv(env_fn, num_envs, **kwargs)
    assert isinstance(env, BatchedEnv)
    raws = [env_fn() for _ in range(num_envs)]
    index = agent_index(env.tree)
    td = env.reset(seed=SEED)
    for e, raw in enumerate(raws):
        check_root(td, raw, e, index, *raw.reset(seed=SEED + e))
        if env._state is not None:
            np.testing.assert_array_equal(td["shared"][e].numpy(), raw.state())
    gen, outs = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        acts = sample_actions(td, env.tree, gen)
        td = env.step(acts)
        validate_step(td, env.tree)
        outs.append(td)
        for e, raw in enumerate(raws):
            sent = {a: int(acts[index[a][0], "action"][e, index[a][1]]) for a in raw.agents}
            obs, rew, term, trunc, infos = raw.step(sent)
            for agent, (g, s) in index.items():
                assert bool(td["next", g, "mask"][e, s]) == (agent in sent)
                assert td["next", g, "reward"][e, s, 0].item() == pytest.approx(rew.get(agent, 0.0), abs=1e-6)
                assert bool(td["next", g, "terminated"][e, s]) == bool(term.get(agent, False))
                assert bool(td["next", g, "truncated"][e, s]) == bool(trunc.get(agent, False))
                if agent in obs:
                    np.testing.assert_array_equal(td["next", g, "observation"][e, s].numpy(), obs[agent])
            if env._state is not None:
                np.testing.assert_array_equal(td["next", "shared"][e].numpy(), raw.state())
            ended = not raw.agents
            assert bool(td["next", "done"][e]) == ended
            assert bool(td["next", "truncated"][e]) == (ended and any(trunc.values()))
            if ended:
                obs, infos = raw.reset()
            check_root(td, raw, e, index, obs, infos)
            if env._state is not None:
                np.testing.assert_array_equal(td["shared"][e].numpy(), raw.state())
    return outs, env


@pytest.mark.parametrize("module, expected", [
    (simple_tag_v3, {"adversary": 3, "agent": 1}),
    (simple_world_comm_v3, {"leadadversary": 1, "adversary": 3, "agent": 2}),
])
def test_mpe2_parallel_matches_raw_env_with_heterogeneous_groups(module, expected):
    outs, env = run_parallel_pair(partial(module.parallel_env, max_cycles=5), 2, 14)
    assert {name: g.capacity for name, g in groups(env.tree).items()} == expected
    assert sum(int(o["next", "done"].sum()) for o in outs) >= 4  # several episodes per copy, resets included
    shared = shared_observations(env.tree)[()]
    assert shared.eval_only and shared.shape == env.envs[0].state_space.shape


def test_join_and_leave_via_masks_matches_raw_env():
    outs, env = run_parallel_pair(JoinLeaveEnv, 2, 13)
    w = [tuple(o["walker", "mask"][0].tolist()) for o in outs[:6]]
    assert w == [(True, True, False), (True, True, True), (False, True, True), (False, True, True),
                 (False, True, True), (True, True, False)]  # joined at t=2, left at t=3, reset after t=6
    assert outs[2]["next", "walker", "terminated"][0, :, 0].tolist() == [True, False, False]
    assert outs[5]["next", "done"][0].item() and outs[5]["next", "truncated"][0].item()
    assert not outs[5]["next", "terminated"][0].item()
    assert outs[5]["next", "walker", "truncated"][0, :, 0].tolist() == [False, True, True]
    assert groups(env.tree)["walker"].capacity == 3 and env._state is None
    sent = [sorted(a) for a in env.envs[0].received[:7]]  # only present agents get an action
    w01, w12 = ["walker_0", "walker_1"], ["walker_1", "walker_2"]
    assert sent == [w01, w01, ["walker_0", "walker_1", "walker_2"], w12, w12, w12, w01]


def test_info_action_mask_forbids_actions():
    env = PettingZooParallelEnv(JoinLeaveEnv, 1)
    td = env.reset(seed=0)
    assert td["walker", "action_mask"][0, 0].tolist() == [False, True, True]
    bad = TensorDict({"walker": TensorDict({"action": torch.tensor([[0, 1, 1]])}, batch_size=(1, 3))}, batch_size=(1,))
    with pytest.raises(IllegalActionError) as info:
        env.step(bad)
    assert (info.value.env_index, info.value.agent) == (0, "walker_0")
    assert env.envs[0].received == []


class MultiDiscreteMaskEnv(ParallelEnv):
    """Two agents with MultiDiscrete([3, 4]) actions and the usual flat mask (7 entries), in a dict observation or
    in ``infos``: a mask Shoal cannot apply, which must never be dropped in silence."""

    metadata = {"name": "multi_discrete_mask_v0"}

    def __init__(self, where: str) -> None:
        self.possible_agents, self.where = ["p_0", "p_1"], where
        box = spaces.Box(0, 1, (5,), np.float32)
        self._obs_space = spaces.Dict(observation=box, action_mask=spaces.Box(0, 1, (7,), np.int8)) \
            if where == "observation" else box

    def observation_space(self, agent):
        return self._obs_space

    def action_space(self, agent):
        return spaces.MultiDiscrete([3, 4])

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        mask, obs = np.array([0, 1, 1, 1, 0, 0, 0], np.int8), np.zeros(5, np.float32)
        if self.where == "observation":
            return {a: {"observation": obs, "action_mask": mask} for a in self.agents}, {a: {} for a in self.agents}
        return {a: obs for a in self.agents}, {a: {"action_mask": mask} for a in self.agents}

    def step(self, actions):
        raise AssertionError("not reached")


@pytest.mark.parametrize("where", ["observation", "info"])
def test_an_action_mask_shoal_cannot_apply_is_refused_not_dropped(where):
    with pytest.raises((ValueError, EnvOutputError), match=r"agent 'p_\d' has an 'action_mask' in its " + where +
                       r", but Shoal applies an env's action mask to a Discrete action only"):
        PettingZooParallelEnv(partial(MultiDiscreteMaskEnv, where), 1).reset(seed=0)
    env = PettingZooParallelEnv(partial(MultiDiscreteMaskEnv, where), 1, action_mask="none")  # the user's choice
    assert "action_mask" not in env.reset(seed=0)["p"].keys()


@pytest.mark.parametrize("fault, agent, key", [
    ("unknown", "ghost_0", ("next", "observation")),
    ("vanish", "walker_1", ("next", "walker", "truncated")),
    ("no_reward", "walker_1", ("next", "walker", "reward")),
    ("str_flag", "walker_0", ("next", "walker", "truncated")),
    ("zombie", "walker_1", ("next", "walker", "terminated")),
])
def test_unknown_or_vanishing_agent_strict_and_lenient(fault, agent, key):
    legal = TensorDict({"walker": TensorDict({"action": torch.tensor([[1, 2, 2]])}, batch_size=(1, 3))},
                       batch_size=(1,))
    env = PettingZooParallelEnv(partial(JoinLeaveEnv, fault), 1)
    env.reset(seed=0)
    env.step(legal)
    with pytest.raises(EnvOutputError) as info:
        env.step(TensorDict({"walker": {"action": torch.tensor([[2, 0, 0]])}}, batch_size=(1,)))
    assert (info.value.env_index, info.value.agent, info.value.key) == (0, agent, key)
    lenient = PettingZooParallelEnv(partial(JoinLeaveEnv, fault), 1, check="lenient")
    lenient.reset(seed=0)
    lenient.step(legal)
    out = lenient.step(TensorDict({"walker": {"action": torch.tensor([[2, 0, 0]])}}, batch_size=(1,)))
    assert out["next", "truncated"].item() and lenient.counters["invalid_output_truncations"] == 1
    assert out["walker", "mask"][0].tolist() == [True, True, False]  # reset


def test_shoal_follows_a_custom_env_that_passes_the_pettingzoo_api_test_over_many_episodes():
    """The fixture is a valid PettingZoo env (PettingZoo's own check), and Shoal's adapter reports what the raw
    env does at every step of 30 steps (several join/leave episodes and resets), masks and rewards included."""
    parallel_api_test(JoinLeaveEnv(), num_cycles=30)
    outs, env = run_parallel_pair(JoinLeaveEnv, 2, 30)  # asserts step by step against raw copies of the env
    assert sum(int(o["next", "done"].sum()) for o in outs) >= 8  # 2 copies x at least 4 episodes each
    assert {tuple(o["walker", "mask"][0].tolist()) for o in outs} >= {(True, True, False), (True, True, True),
                                                                      (False, True, True)}


def aec_reference(env_fn, seed: int, decisions: int, rng: np.random.Generator):
    """Canonical PettingZoo loop (agent_iter / last): decisions and per-episode returns."""
    env, records, returns = env_fn(), [], []
    env.reset(seed=seed)
    while len(records) < decisions:
        total = defaultdict(float)
        for agent in env.agent_iter():
            obs, reward, term, trunc, info = env.last()
            total[agent] += reward
            if term or trunc:
                env.step(None)
                continue
            mask = obs["action_mask"] if isinstance(obs, dict) else info.get("action_mask")
            legal = np.flatnonzero(mask) if mask is not None else np.arange(env.action_space(agent).n)
            action = int(rng.choice(legal))
            records.append((agent, obs["observation"] if isinstance(obs, dict) else obs, mask, action))
            env.step(action)
        returns.append(dict(total))
        env.reset()
    return records, returns


@pytest.mark.parametrize("env_fn, steps", [(connect_four_v3.env, 70),
                                           (partial(simple_spread_v3.env, max_cycles=4), 40)])
def test_aec_matches_canonical_loop_and_rewards_land_on_the_right_agent(env_fn, steps):
    n = 3
    refs = [aec_reference(env_fn, SEED + e, steps, np.random.default_rng(e)) for e in range(n)]
    env = PettingZooAECEnv(env_fn, n)
    index = agent_index(env.tree)
    td = env.reset(seed=SEED)
    sums = [defaultdict(float) for _ in range(n)]
    episodes = [[] for _ in range(n)]
    flagged = [set() for _ in range(n)]
    for t in range(steps):
        action = TensorDict(batch_size=(n,))
        for name, g in groups(env.tree).items():
            action[name] = TensorDict({"action": torch.zeros(n, g.capacity, dtype=torch.int64)},
                                      batch_size=(n, g.capacity))
        for e, (records, _) in enumerate(refs):
            agent, obs, mask, act = records[t]
            g, s = index[agent]
            present = [(a, i) for a, i in index.items() if bool(td[i[0], "mask"][e, i[1]])]
            assert present == [(agent, (g, s))]  # only the acting agent is unmasked
            np.testing.assert_array_equal(td[g, "observation"][e, s].numpy(), obs)
            if mask is not None:
                assert td[g, "action_mask"][e, s].tolist() == np.asarray(mask, bool).tolist()
            action[g, "action"][e, s] = act
        td = env.step(action)
        validate_step(td, env.tree)
        for e in range(n):
            for agent, (g, s) in index.items():
                sums[e][agent] += td["next", g, "reward"][e, s, 0].item()
                if td["next", g, "done"][e, s, 0]:
                    assert agent not in flagged[e]  # each agent ends once per episode
                    flagged[e].add(agent)
            if td["next", "done"][e]:
                assert flagged[e] == set(index)
                episodes[e].append(dict(sums[e]))
                sums[e], flagged[e] = defaultdict(float), set()
    assert sum(len(x) for x in episodes) >= n
    for e, (_, returns) in enumerate(refs):  # per-agent returns equal PettingZoo's: nothing lost or doubled
        for got, want in zip(episodes[e], returns):
            assert got == pytest.approx({a: want.get(a, 0.0) for a in got}, abs=1e-4)


def test_connect_four_tree_masks_and_no_state():
    env = PettingZooAECEnv(connect_four_v3.env, 2)
    (group,) = groups(env.tree).values()
    assert group.name == "player" and group.agent_names == ("player_0", "player_1")
    assert group.agent.observation.shape == (6, 7, 2)  # the inner observation, the mask went to action_mask
    assert shared_observations(env.tree) == {}
    td = env.reset(seed=0)
    assert td["player", "action_mask"].shape == (2, 2, 7) and "shared" not in td.keys()


@pytest.mark.skipif(importlib.util.find_spec("pymunk") is None,
                    reason="knights_archers_zombies_v11 needs pymunk, which is not installed")
def test_knights_archers_zombies_matches_raw_env():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pettingzoo.butterfly import knights_archers_zombies_v11

    env_fn = partial(knights_archers_zombies_v11.parallel_env, max_cycles=25, spawn_delay=2, line_death=True)
    outs, env = run_parallel_pair(env_fn, 2, 60)
    assert {name: g.capacity for name, g in groups(env.tree).items()} == {"archer": 2, "knight": 2}
    assert sum(int(o["next", "done"].sum()) for o in outs) >= 2
    left = sum(int((o["next", g, "mask"] & ~o[g, "mask"] & ~o["next", "done"]).sum())
               for o in outs for g in ("archer", "knight"))
    assert left > 0  # agents died mid-episode: flagged terminated, then masked out while the others go on


def test_a_parallel_env_on_the_old_four_value_api_is_named():
    """A step of 4 values failed in the adapter's tuple unpacking ('not enough values to unpack')."""
    env = PettingZooParallelEnv(partial(JoinLeaveEnv, "four"), 1)
    env.reset(seed=0)
    env.step(TensorDict({"walker": TensorDict({"action": torch.tensor([[1, 2, 2]])}, batch_size=(1, 3))},
                        batch_size=(1,)))
    with pytest.raises(EnvOutputError, match=r"env 0, key next: step\(\) returned 4 values; a parallel env's step "
                                             r"returns \(observations, rewards, terminations, truncations, infos\)"):
        env.step(TensorDict({"walker": {"action": torch.tensor([[2, 0, 0]])}}, batch_size=(1,)))


class _StringFlagsAfterOneMove:
    """Connect four whose ``truncations`` come back as strings after the first move: the string "False" read as a
    flag would end every agent (the AEC adapter steps ended agents with None until none is left)."""

    def __init__(self) -> None:
        self.env, self.moves = connect_four_v3.env(), 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, *args, **kwargs):
        self.moves = 0
        return self.env.reset(*args, **kwargs)

    def step(self, action) -> None:
        self.env.step(action)
        self.moves += 1

    @property
    def truncations(self):
        return {a: "False" for a in self.env.truncations} if self.moves else self.env.truncations


def test_an_aec_env_whose_flags_are_no_bools_is_named_strict_and_truncated_lenient():
    move = TensorDict({"player": TensorDict({"action": torch.tensor([[3, 3]])}, batch_size=(1, 2))}, batch_size=(1,))
    env = PettingZooAECEnv(_StringFlagsAfterOneMove, 1)
    env.reset(seed=0)
    with pytest.raises(EnvOutputError, match=r"truncated is 'False' \(str\), not a bool") as info:
        env.step(move)
    assert (info.value.env_index, info.value.key) == (0, ("next", "player", "truncated"))
    lenient = PettingZooAECEnv(_StringFlagsAfterOneMove, 1, check="lenient")
    lenient.reset(seed=0)
    out = lenient.step(move)
    assert out["next", "truncated"].item() and lenient.counters["invalid_output_truncations"] == 1
    assert out["player", "mask"][0].tolist() == [True, False]  # a fresh game: player_0 to move
