"""Faulty env factories, importable by name from any process (a ``shoal`` run, an env process, a Ray rollout worker
imports ``tests.orchestration.faulty_env_factories:make_faulty`` as a user's ``package.module:factory``)."""

from __future__ import annotations

import os
import time

import gymnasium


class _Shorter(gymnasium.Wrapper):
    """Its steps (not its reset) drop the observation's last entry: found at the first step, not at the probe."""

    def step(self, action):
        obs, *rest = self.env.step(action)
        return (obs[:-1], *rest)


def make_wrong_shape():
    return _Shorter(gymnasium.make("CartPole-v1"))


class _Faulty(gymnasium.Wrapper):
    """Fails at its 40th step with the first fault of ``faults`` that no env of the run has had yet (claimed with
    a file beside ``marker``), unless another env of its process claimed one: each fault happens once per run,
    whichever env, process or restart reaches it, and every fault restarts its process. ``hang`` sleeps, ``crash``
    ends the process, ``raise`` raises, ``shape`` returns 2 numbers where the space says 4."""

    claimed: list = []  # per process (and per restart): the fault this one claimed

    def __init__(self, env, faults: list[str], marker: str) -> None:
        super().__init__(env)
        self.faults, self.marker, self.steps = faults, marker, 0

    def step(self, action):
        self.steps += 1
        fault = self._claim() if self.steps == 40 else None
        if fault == "hang":
            time.sleep(3600)
        elif fault == "crash":
            os._exit(9)
        elif fault == "shape":
            obs, *rest = self.env.step(action)
            return (obs[:2], *rest)  # 2 numbers where the space says 4
        elif fault == "raise":
            raise RuntimeError("the simulator raised")
        return self.env.step(action)

    def _claim(self):
        if _Faulty.claimed:
            return None
        for fault in self.faults:
            try:
                os.close(os.open(f"{self.marker}-{fault}", os.O_CREAT | os.O_EXCL))  # atomic: one env of all wins
            except FileExistsError:
                continue
            _Faulty.claimed.append(fault)
            return fault
        return None


def make_faulty(fault: str = "hang", marker: str = ""):
    return _Faulty(gymnasium.make("CartPole-v1"), fault.split(","), marker)


class _FarOut(gymnasium.Wrapper):
    """Its resets put the cart far outside the observation space's bounds: found at an actor's first reset."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs[0] = 100.0
        return obs, info


def make_out_of_bounds():
    return _FarOut(gymnasium.make("CartPole-v1"))


class _Raising(gymnasium.Wrapper):
    """Raises at its third step, every time: a bug in the user's env code."""

    def reset(self, **kwargs):
        self.steps = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("the env's own bug")
        return self.env.step(action)


def make_raising():
    return _Raising(gymnasium.make("CartPole-v1"))


class _FiveSteps(gymnasium.Env):
    """Episodes of exactly 5 steps, reward 1 each (return 5), cut at their second step by a fault in about half
    of them: ``nan`` returns a NaN reward (a lenient repair truncates the episode), ``raise`` raises (lenient mode
    restarts the env's process); ``final_obs`` cuts none, but returns an observation out of its space at the
    last step (repaired, the episode whole). Which episodes fault follows the reset seed, so restarts differ."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, fault: str) -> None:
        self.fault, self.t, self.cut = fault, 0, False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.cut = 0, bool(self.np_random.random() < 0.5)
        return self.observation_space.low * 0, {}

    def step(self, action):
        self.t += 1
        if self.cut and self.t == 2 and self.fault != "final_obs":
            if self.fault == "raise":
                raise RuntimeError("the simulator raised")
            return self.observation_space.low * 0, float("nan"), False, False, {}
        if self.cut and self.t == 5 and self.fault == "final_obs":  # a whole episode, its last observation repaired
            return self.observation_space.high + 4, 1.0, True, False, {}
        return self.observation_space.low * 0, 1.0, self.t == 5, False, {}


def make_five_steps(fault: str = "nan"):
    return _FiveSteps(fault)


def make_raising_filmable(render_mode=None):
    """:func:`make_raising` that renders (a video's env raising at its third step)."""
    return _Raising(gymnasium.make("CartPole-v1", render_mode=render_mode))


class _NanEveryOther(gymnasium.Wrapper):
    """CartPole whose every other episode returns a NaN reward at its second step (a lenient repair cuts it)."""

    episodes = 0

    def reset(self, **kwargs):
        self.steps, self.episodes = 0, self.episodes + 1
        return self.env.reset(**kwargs)

    def step(self, action):
        self.steps += 1
        obs, reward, *rest = self.env.step(action)
        return (obs, float("nan") if self.episodes % 2 == 0 and self.steps == 2 else reward, *rest)


def make_nan_filmable(render_mode=None):
    return _NanEveryOther(gymnasium.make("CartPole-v1", render_mode=render_mode))


def make_device_env(device: str = "auto"):
    """A factory with a ``device`` keyword of its own (any word it understands): CartPole-v1 beside it."""
    return gymnasium.make("CartPole-v1")
