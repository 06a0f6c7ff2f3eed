"""Bad env output and illegal actions, strict and lenient (adapters/checking.py through the adapters)."""

from __future__ import annotations

import warnings
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

with warnings.catch_warnings():  # pettingzoo 1.27 flags its own `from pettingzoo.classic import ..._vN`
    warnings.simplefilter("ignore", DeprecationWarning)
    from pettingzoo.classic import connect_four_v3

from adapters.checking import EnvOutputError, IllegalActionError, LeafCheck
from adapters.gymnasium_env import GymnasiumEnv, GymnasiumVectorEnv
from adapters.pettingzoo_env import PettingZooAECEnv
from core.specs import Leaf

FAULT_AT = 4  # the env's 4th step (over its whole life) goes bad
EPISODE = 6


class BadEnv(gym.Env):
    """A real gymnasium env whose output breaks the contract once, in the way ``fault`` says."""

    observation_space = spaces.Dict({"pos": spaces.Box(-1, 1, (3,), np.float32), "id": spaces.Discrete(4)})
    action_space = spaces.Discrete(2)

    def __init__(self, fault: str | None = None) -> None:
        self.fault, self.total, self.t = fault, 0, 0
        self.received: list[int] = []

    def _obs(self):
        return {"pos": np.full(3, 0.1 * self.t, np.float32), "id": self.t % 4}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.received.append(int(action))
        self.t += 1
        self.total += 1
        obs, reward = self._obs(), float(self.t)
        if self.total == FAULT_AT:
            if self.fault == "shape":
                obs["pos"] = np.zeros(4, np.float32)
            elif self.fault == "dtype":
                obs["id"] = 1.5
            elif self.fault == "nan":
                obs["pos"][1] = np.nan
            elif self.fault == "inf_reward":
                reward = float("inf")
            elif self.fault == "bounds":
                obs["pos"][0] = 2.0
        return obs, reward, self.t >= EPISODE, False, {}


FAULTS = {  # fault -> key at fault
    "shape": ("next", "agent", "observation", "pos"),
    "dtype": ("next", "agent", "observation", "id"),
    "nan": ("next", "agent", "observation", "pos"),
    "inf_reward": ("next", "agent", "reward"),
    "bounds": ("next", "agent", "observation", "pos"),
}


def actions(e: int, value: int = 1) -> TensorDict:
    a = torch.full((e, 1), value, dtype=torch.int64)
    return TensorDict({"agent": TensorDict({"action": a}, batch_size=(e, 1))}, batch_size=(e,))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_strict_single_env_raises_naming_env_agent_key(fault):
    env = GymnasiumEnv(BadEnv(fault))
    env.reset(seed=0)
    for _ in range(FAULT_AT - 1):
        env.step(actions(1))
    with pytest.raises(EnvOutputError) as info:
        env.step(actions(1))
    err = info.value
    assert (err.env_index, err.agent, err.key) == (0, "agent", FAULTS[fault])
    assert "env 0" in str(err) and "'agent'" in str(err) and "/".join(FAULTS[fault]) in str(err)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_lenient_single_env_truncates_counts_and_goes_on(fault):
    env = GymnasiumEnv(BadEnv(fault), check="lenient")
    outs = [env.reset(seed=0)]
    for _ in range(FAULT_AT - 1):
        outs.append(env.step(actions(1)))
    before = [o.clone() for o in outs]
    bad = env.step(actions(1))
    after = [env.step(actions(1)) for _ in range(3)]
    assert env.counters["invalid_output_truncations"] == 1
    assert env.recent_errors[-1].key == FAULTS[fault]
    # the faulty step: truncated, not terminated; repaired values are the last good observation / zero reward
    assert bad["next", "agent", "truncated"].item() and bad["next", "truncated"].item()
    assert not bad["next", "agent", "terminated"].item()
    if fault == "inf_reward":
        assert bad["next", "agent", "reward"].item() == 0.0
    else:
        assert bad["next", "agent", "reward"].item() == FAULT_AT
        for leaf in ("pos", "id"):
            assert torch.equal(bad["next", "agent", "observation", leaf], outs[-1]["agent", "observation", leaf])
    # the env was reset: the new episode starts at t = 0 and then goes on normally
    assert torch.equal(bad["agent", "observation", "pos"], torch.zeros(1, 1, 3))
    assert [o["next", "agent", "reward"].item() for o in after] == [1.0, 2.0, 3.0]
    # earlier data is intact
    for old, new in zip(before, outs):
        assert (old == new).all()


@pytest.mark.parametrize("fault, mode", [("nan", AutoresetMode.DISABLED), ("inf_reward", AutoresetMode.SAME_STEP),
                                         ("bounds", AutoresetMode.NEXT_STEP)])
def test_vector_env_locates_the_env_at_fault(fault, mode):
    fns = [BadEnv, partial(BadEnv, fault), BadEnv]
    strict = GymnasiumVectorEnv(SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP))
    strict.reset(seed=0)
    for _ in range(FAULT_AT - 1):
        strict.step(actions(3))
    with pytest.raises(EnvOutputError) as info:
        strict.step(actions(3))
    assert (info.value.env_index, info.value.agent, info.value.key) == (1, "agent", FAULTS[fault])

    lenient = GymnasiumVectorEnv(SyncVectorEnv(fns, autoreset_mode=mode), check="lenient")
    lenient.reset(seed=0)
    for _ in range(FAULT_AT - 1):
        lenient.step(actions(3))
    out = lenient.step(actions(3))
    assert out["next", "truncated"][:, 0].tolist() == [False, True, False]
    assert out["next", "agent", "reward"][:, 0, 0].tolist()[::2] == [FAULT_AT, FAULT_AT]  # others untouched
    assert out["agent", "observation", "pos"][:, 0, 0].tolist() == pytest.approx([0.1 * FAULT_AT, 0, 0.1 * FAULT_AT])
    assert lenient.counters["invalid_output_truncations"] == 1
    assert torch.isfinite(out["next", "agent", "observation", "pos"]).all()
    more = [lenient.step(actions(3)) for _ in range(EPISODE)]  # env 1 restarted; every env ends once more
    assert [o["next", "agent", "reward"][1, 0, 0].item() for o in more[:2]] == [1.0, 2.0]
    assert sum(int(o["next", "done"][1].item()) for o in more) == 1


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_a_vector_sub_env_observation_of_the_wrong_shape_is_named_not_left_to_numpy(mode):
    """gymnasium's SyncVectorEnv fails to stack it ('Output array is the wrong shape', naming nothing): the
    adapter names the sub-env, agent and key instead."""
    env = GymnasiumVectorEnv(SyncVectorEnv([BadEnv, BadEnv, partial(BadEnv, "shape")], autoreset_mode=mode))
    env.reset(seed=0)
    for _ in range(FAULT_AT - 1):
        env.step(actions(3))
    with pytest.raises(EnvOutputError, match=r"env 2, agent 'agent', key next/agent/observation/pos: .*\(4,\)") as info:
        env.step(actions(3))
    assert (info.value.env_index, info.value.agent, info.value.key) == (2, "agent", FAULTS["shape"])


class WrongFromTheStart(BadEnv):
    def reset(self, *, seed=None, options=None):
        return {"pos": np.zeros(4, np.float32), "id": 0}, {}


def test_a_first_observation_of_the_wrong_shape_is_named_too():
    """The same at the first reset, before the adapter holds any observation (it left numpy's message)."""
    env = GymnasiumVectorEnv(SyncVectorEnv([BadEnv, WrongFromTheStart]))
    with pytest.raises(EnvOutputError, match=r"env 1, agent 'agent', key agent/observation/pos: .*got \(4,\)"):
        env.reset(seed=0)


@pytest.mark.parametrize("check", ["strict", "lenient"])
def test_out_of_range_action_is_never_sent(check):
    raw = BadEnv()
    env = GymnasiumEnv(raw, check=check)
    env.reset(seed=0)
    env.step(actions(1, 1))
    with pytest.raises(IllegalActionError) as info:
        env.step(actions(1, 2))
    assert (info.value.env_index, info.value.agent, info.value.key) == (0, "agent", ("agent", "action"))
    with pytest.raises(IllegalActionError, match="shape"):
        env.step(TensorDict({"agent": {"action": torch.zeros(1, 1, 2, dtype=torch.int64)}}, batch_size=(1,)))
    assert raw.received == [1]


def recording_connect_four(log: list):
    env = connect_four_v3.env()
    step = env.step

    def recorded(action):
        if action is not None:
            board_top = np.asarray(env.unwrapped.board[:7])
            log.append((int(action), bool(board_top[action] == 0)))
        step(action)

    env.step = recorded
    return env


def connect_four_actions(cols: list[int]) -> TensorDict:
    e = len(cols)
    a = torch.tensor(cols, dtype=torch.int64)[:, None].expand(e, 2).contiguous()  # absent slot: ignored
    return TensorDict({"player": TensorDict({"action": a}, batch_size=(e, 2))}, batch_size=(e,))


@pytest.mark.parametrize("check", ["strict", "lenient"])
def test_masked_action_never_reaches_connect_four(check):
    log: list = []
    env = PettingZooAECEnv(partial(recording_connect_four, log), 1, check=check)
    td = env.reset(seed=0)
    for _ in range(6):  # both players fill column 0
        td = env.step(connect_four_actions([0]))
    assert td["player", "mask"][0].tolist() == [True, False]  # player_0 to move
    assert td["player", "action_mask"][0, 0].tolist() == [False] + [True] * 6
    assert td["player", "action_mask"][0, 1].all()  # absent slots allow everything (their action is ignored)
    with pytest.raises(IllegalActionError) as info:
        env.step(connect_four_actions([0]))
    assert info.value.env_index == 0 and info.value.agent == "player_0" and info.value.key == ("player", "action")
    assert [a for a, _ in log] == [0] * 6 and all(legal for _, legal in log)
    td = env.step(connect_four_actions([3]))  # a legal move still works afterwards
    assert log[-1] == (3, True)


def test_random_masked_play_sends_only_legal_moves():
    log: list = []
    env = PettingZooAECEnv(partial(recording_connect_four, log), 4)
    td = env.reset(seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        logits = torch.where(td["player", "action_mask"], 0.0, -torch.inf)
        a = torch.multinomial(logits.softmax(-1).reshape(-1, 7), 1, generator=gen).reshape(4, 2)
        td = env.step(TensorDict({"player": TensorDict({"action": a}, batch_size=(4, 2))}, batch_size=(4,)))
    assert len(log) == 150 * 4 and all(legal for _, legal in log)


def test_leaf_check_finds_nan_inf_and_bounds_per_env_and_agent():
    check = LeafCheck(Leaf.box((2,), low=[0, -1], high=[1, 1]))
    x = np.zeros((3, 2, 2), np.float32)
    assert check.bad(x, 2) is None
    x[2, 1, 0] = 1.5
    x[0, 0, 1] = np.inf
    bad = check.bad(x, 2)
    assert bad.tolist() == [[True, False], [False, False], [False, True]]
    assert check.describe(x[0, 0]) == "Inf value"
    assert "outside bounds [0.0, 1.0]" in check.describe(x[2, 1])
    assert LeafCheck(Leaf.box((), dtype=torch.float32)).bad(np.array([[np.float32(3e38)]]), 2) is None


BOUNDS = {  # name -> (low, high) of a 3-value float32 leaf
    "symmetric": ([-4.8, -np.inf, -0.4], [4.8, np.inf, 0.4]),
    "asymmetric": ([0.0, -1.0, -np.inf], [1.0, 2.0, 5.0]),
    "unbounded": ([-np.inf] * 3, [np.inf] * 3),
    "scalar": ([-1.0] * 3, [1.0] * 3),
}


@settings(max_examples=40)
@given(bounds=st.sampled_from(list(BOUNDS)), rows=st.sampled_from([1, 2, 7, 40]),
       faults=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2),
                                 st.sampled_from([np.nan, np.inf, -np.inf, 1e3, -1e3, 0.5])), max_size=4),
       seed=st.integers(0, 2**16))
def test_leaf_check_agrees_with_an_elementwise_reference(bounds, rows, faults, seed):
    """Every path of LeafCheck.bad (Python for small arrays; sum, abs or two comparisons for large ones) flags
    exactly the (env, agent) rows that hold a NaN, an Inf or a value outside the bounds."""
    low, high = (np.array(b, np.float32) for b in BOUNDS[bounds])
    check = LeafCheck(Leaf.box((3,), low=low.tolist(), high=high.tolist()))
    x = np.random.default_rng(seed).uniform(-0.3, 0.3, (rows, 2, 3)).astype(np.float32)
    for index, column, value in faults:
        x.reshape(-1, 3)[index % (rows * 2), column] = value
    expected = ~(np.isfinite(x) & (x >= low) & (x <= high)).all(-1)
    bad = check.bad(x, 2)
    assert (np.zeros((rows, 2), bool) if bad is None else bad).tolist() == expected.tolist()


def test_int_action_lists_check_present_agents_only():
    """The int fast path gives the arrays path's values, ignores absent agents' actions, and raises naming the
    env and agent of an out-of-range action of a present one."""
    from adapters.checking import ActionCheck
    from core.specs import AgentNode, DictPopulation, groups

    agent = AgentNode(observation=Leaf.box((2,)), action=Leaf.discrete(5))
    spec = groups(DictPopulation(members={"a_0": agent, "a_1": agent}))["a"]
    check = ActionCheck(spec, num_envs=2)

    def acts(values):
        a = torch.tensor(values, dtype=torch.int64)
        return TensorDict({"a": TensorDict({"action": a}, batch_size=(2, 2))}, batch_size=(2,))

    assert check.int_lists(acts([[0, 4], [2, 3]]), None, None) == [[0, 4], [2, 3]]
    present = np.array([[True, True], [True, False]])
    assert check.int_lists(acts([[1, 2], [3, 9]]), present, None) == [[1, 2], [3, 9]]  # absent: not checked
    with pytest.raises(IllegalActionError) as info:
        check.int_lists(acts([[1, 2], [3, 9]]), None, None)
    assert (info.value.env_index, info.value.agent) == (1, "a_1")
    legal = np.ones((2, 2, 5), bool)
    legal[0, 1, 2] = False
    with pytest.raises(IllegalActionError, match="masked"):
        check.int_lists(acts([[1, 2], [3, 4]]), None, legal)


class BadResetEnv(gym.Env):
    """Plain Box observations; its second reset (the first one inside a step) returns an out-of-bounds one."""

    observation_space = spaces.Box(-1, 1, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, bad: bool = False) -> None:
        self.bad, self.resets, self.t = bad, 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets, self.t = self.resets + 1, 0
        value = 2.0 if self.bad and self.resets == 2 else 0.5
        return np.full(3, value, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 1.0, self.t >= 2, False, {}


def test_bad_reset_observation_inside_a_step_is_named_or_retried():
    """The sync vector env's direct resets check each reset observation: strict names the env, lenient resets
    that env again and counts the retry; a good reset observation passes untouched."""
    fns = [BadResetEnv, partial(BadResetEnv, True), BadResetEnv]
    strict = GymnasiumVectorEnv(SyncVectorEnv(fns))
    strict.reset(seed=0)
    strict.step(actions(3))
    with pytest.raises(EnvOutputError) as info:
        strict.step(actions(3))  # every env ends: env 1's new observation is out of bounds
    assert (info.value.env_index, info.value.key) == (1, ("agent", "observation"))
    lenient = GymnasiumVectorEnv(SyncVectorEnv(fns), check="lenient")
    lenient.reset(seed=0)
    lenient.step(actions(3))
    out = lenient.step(actions(3))
    assert lenient.counters["invalid_reset_retries"] == 1
    assert out["agent", "observation"][:, 0].tolist() == [[0.5] * 3] * 3


def test_an_error_of_the_whole_batch_names_its_key_without_a_none_env_or_agent():
    assert str(EnvOutputError("action missing", env_index=None, agent=None, key=("blue", "action"))) == \
        "key blue/action: action missing"
    assert str(EnvOutputError("bad", env_index=2, agent=None, key=("next", "shared"))) == "env 2, key next/shared: bad"


def test_an_env_output_error_pickles_as_it_is():
    """It crosses processes (a Ray rollout worker's error reaches the driver) with its text and attributes: its
    keyword-only constructor made it unpicklable, and Ray sent an UnserializableException in its place."""
    import pickle

    from adapters.checking import EnvOutputError, IllegalActionError

    for cls in (EnvOutputError, IllegalActionError):
        error = cls("expected shape (4,), got (3,)", env_index=0, agent="agent", key=("next", "agent", "observation"))
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error) == ("env 0, agent 'agent', key next/agent/observation: "
                                                                 "expected shape (4,), got (3,)")
        assert (back.env_index, back.agent, back.key) == (0, "agent", ("next", "agent", "observation"))


def test_a_lenient_run_logs_each_agent_and_keys_problem_once_and_counts_every_one(caplog):
    """A long lenient run truncates many episodes for the same fault: the first is logged, every one counted."""
    from adapters.checking import Checker

    checker = Checker("lenient")
    for e in range(5):
        checker.report(EnvOutputError("NaN", env_index=e, agent="a", key=("next", "g", "reward")))
        checker.report(EnvOutputError("NaN", env_index=e, agent="b", key=("next", "g", "reward")))
        assert len(checker.take()) == 2
        checker.count_truncations(2)
    logged = [r.getMessage() for r in caplog.records if "truncating episode" in r.getMessage()]
    assert len(logged) == 2 and "env 0, agent 'a'" in logged[0] and "env 0, agent 'b'" in logged[1], logged
    assert checker.counters["invalid_output_truncations"] == 10 and len(checker.recent) == 10
