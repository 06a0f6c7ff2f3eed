"""TorchRLEnv: spec mapping, fidelity against stepping the raw torchrl env, partial resets."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from adapters.protocol import BatchedEnv
from adapters.torchrl_env import TorchRLEnv
from core.layout import ACTION, ACTION_MASK, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import ArrayPopulation, groups, shared_observations, validate

LIMIT, HORIZON = 8, 6


class Counters(EnvBase):
    """A batched multi-agent torchrl env: group ``"team"`` of ``n`` agents, each adding its action (0-2) to a
    counter. The team's episode terminates when the counters sum to ``LIMIT``, truncates after ``HORIZON``
    steps. Root observation ``"state"`` = the sum. Flags at the root, or per agent with ``group_flags``."""

    def __init__(self, num_envs: int = 4, n: int = 2, group_flags: bool = False):
        super().__init__(batch_size=torch.Size([num_envs]))
        e, self.n, self.group_flags = num_envs, n, group_flags
        self.observation_spec = Composite(team=Composite(observation=Unbounded((e, n, 1)), shape=(e, n)),
                                          state=Unbounded((e, 1)), shape=(e,))
        self.action_spec = Composite(team=Composite(action=Categorical(3, shape=(e, n)), shape=(e, n)), shape=(e,))
        self.reward_spec = Composite(team=Composite(reward=Unbounded((e, n, 1)), shape=(e, n)), shape=(e,))
        shape = (e, n, 1) if group_flags else (e, 1)
        flags = {k: Categorical(2, shape, dtype=torch.bool) for k in (DONE, TERMINATED, TRUNCATED)}
        self.done_spec = (Composite(team=Composite(flags, shape=(e, n)), shape=(e,)) if group_flags
                          else Composite(flags, shape=(e,)))
        self.rng = torch.Generator().manual_seed(0)
        self.count, self.t = torch.zeros(e, n, 1), torch.zeros(e, 1, dtype=torch.int64)

    def _set_seed(self, seed):
        self.rng.manual_seed(seed)

    def _out(self, terminated, truncated):
        e = self.batch_size[0]
        out = TensorDict({"team": TensorDict({OBSERVATION: self.count.clone()}, batch_size=[e, self.n]),
                          "state": self.count.sum(1)}, batch_size=[e])
        flags = {TERMINATED: terminated, TRUNCATED: truncated, DONE: terminated | truncated}
        for k, v in flags.items():
            out.set(("team", k) if self.group_flags else k, v.unsqueeze(1).expand(e, self.n, 1).clone()
                    if self.group_flags else v)
        return out

    def _reset(self, td):
        e = self.batch_size[0]
        key = ("team", "_reset") if self.group_flags else "_reset"
        reset = torch.ones(e, dtype=torch.bool)
        if td is not None and key in td.keys(True):
            reset = td.get(key).reshape(e, -1).any(1)
        fresh = torch.randint(0, 2, (e, self.n, 1), generator=self.rng).float()
        self.count = torch.where(reset[:, None, None], fresh, self.count)
        self.t = torch.where(reset[:, None], 0, self.t)
        zero = torch.zeros(e, 1, dtype=torch.bool)
        return self._out(zero, zero)

    def _step(self, td):
        action = td.get(("team", ACTION)).float().unsqueeze(-1)
        self.count, self.t = self.count + action, self.t + 1
        terminated = self.count.sum(1) >= LIMIT
        out = self._out(terminated, (self.t >= HORIZON) & ~terminated)
        out.set(("team", REWARD), action.clone())
        return out


def _team_actions(action):
    return TensorDict({"team": TensorDict({ACTION: action}, batch_size=action.shape)}, batch_size=action.shape[:1])


def test_tree_mapping_of_a_multi_agent_env():
    env = TorchRLEnv(Counters(num_envs=3, n=2))
    assert isinstance(env, BatchedEnv) and env.num_envs == 3
    (name, spec), = groups(env.tree).items()
    assert name == "team" and spec.capacity == 2 and spec.is_array
    assert spec.agent.action.kind == "discrete" and spec.agent.action.n == 3
    assert spec.agent.observation.kind == "box" and spec.agent.observation.shape == (1,)
    shared = shared_observations(env.tree)[()]
    assert shared.eval_only and shared.shape == (1,)
    td = env.reset(seed=0)
    validate(td, env.tree)
    assert td.get(("team", MASK)).all() and td.get(("team", ACTION_MASK)).shape == (3, 2, 3)


@pytest.mark.parametrize("group_flags", [False, True])
def test_matches_the_raw_env_step_for_step(group_flags):
    e = 4
    env, raw = TorchRLEnv(Counters(e, group_flags=group_flags)), Counters(e, group_flags=group_flags)
    td = env.reset(seed=3)
    raw.set_seed(3)
    raw_td = raw.reset()
    assert torch.equal(td.get(("team", OBSERVATION)), raw_td.get(("team", OBSERVATION)))
    generator, ends = torch.Generator().manual_seed(0), 0
    for _ in range(40):
        action = torch.randint(0, 3, (e, 2), generator=generator)
        out = env.step(_team_actions(action))
        raw_td.set(("team", ACTION), action.clone())
        raw_out, raw_td = raw.step_and_maybe_reset(raw_td)
        validate(out, env.tree)
        validate(out.get(NEXT), env.tree)
        nxt, raw_nxt = out.get(NEXT), raw_out.get(NEXT)
        assert torch.equal(nxt.get(("team", OBSERVATION)), raw_nxt.get(("team", OBSERVATION)))
        assert torch.equal(nxt.get(("team", REWARD)), raw_nxt.get(("team", REWARD)))
        assert torch.equal(nxt.get(SHARED), raw_nxt.get("state"))
        assert torch.equal(out.get(("team", OBSERVATION)), raw_td.get(("team", OBSERVATION)))
        prefix = ("team",) if group_flags else ()
        for flag in (TERMINATED, TRUNCATED):
            theirs = raw_nxt.get((*prefix, flag))
            theirs = theirs.any(1) if group_flags else theirs
            assert torch.equal(nxt.get(flag), theirs)
            assert torch.equal(nxt.get(("team", flag)), nxt.get(flag).unsqueeze(1).expand(e, 2, 1))
        assert torch.equal(nxt.get(DONE), nxt.get(TERMINATED) | nxt.get(TRUNCATED))
        ends += int(nxt.get(DONE).sum())
    assert ends >= 10


def test_partial_reset_keeps_the_final_observation_under_next():
    env = TorchRLEnv(Counters(8))
    env.reset(seed=1)
    generator, seen = torch.Generator().manual_seed(1), 0
    for _ in range(30):
        out = env.step(_team_actions(torch.randint(1, 3, (8, 2), generator=generator)))
        ended = out.get((NEXT, DONE)).squeeze(1)
        final = out.get((NEXT, "team", OBSERVATION))[ended].sum((1, 2))
        truncated = out.get((NEXT, TRUNCATED)).squeeze(1)[ended]
        assert ((final >= LIMIT) | truncated).all()  # the state that ended the episode...
        assert (out.get(("team", OBSERVATION))[ended] <= 1).all()  # ...while the root starts a fresh one
        running = ~ended
        assert torch.equal(out.get(("team", OBSERVATION))[running], out.get((NEXT, "team", OBSERVATION))[running])
        seen += int(ended.sum())
    assert seen > 10


class TwoEntryCounters(Counters):
    """Counters whose team observes two entries (``count`` and ``steps``): a dict observation for us."""

    def __init__(self, num_envs: int = 3):
        super().__init__(num_envs)
        e = num_envs
        self.observation_spec = Composite(team=Composite(count=Unbounded((e, 2, 1)), steps=Unbounded((e, 2, 1)),
                                                         shape=(e, 2)), state=Unbounded((e, 1)), shape=(e,))

    def _out(self, terminated, truncated):
        out = super()._out(terminated, truncated)
        team = out.get("team")
        team.set("count", team.pop(OBSERVATION))
        team.set("steps", self.t.float().unsqueeze(1).expand(self.batch_size[0], 2, 1).clone())
        return out


def test_several_observation_entries_become_a_dict_node():
    env = TorchRLEnv(TwoEntryCounters())
    node = groups(env.tree)["team"].agent.observation
    assert list(node.children) == ["count", "steps"]
    env.reset(seed=0)
    out = env.step(_team_actions(torch.ones(3, 2, dtype=torch.int64)))
    validate(out, env.tree)
    validate(out.get(NEXT), env.tree)
    assert (out.get((NEXT, "team", OBSERVATION, "steps")) == 1).all()
    assert out.get(("team", OBSERVATION, "count")).shape == (3, 2, 1)


def test_single_agent_env_with_one_hot_actions():
    from torchrl.envs import GymEnv, SerialEnv

    env = TorchRLEnv(SerialEnv(2, lambda: GymEnv("CartPole-v1")))
    raw = SerialEnv(2, lambda: GymEnv("CartPole-v1"))
    assert list(groups(env.tree)) == ["agent"] and env.tree.action.kind == "discrete" and env.tree.action.n == 2
    td = env.reset(seed=0)
    raw.set_seed(0)
    raw_td = raw.reset()
    assert torch.equal(td.get(("agent", OBSERVATION))[:, 0], raw_td.get(OBSERVATION))
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        action = torch.randint(0, 2, (2, 1), generator=generator)
        out = env.step(TensorDict({"agent": TensorDict({ACTION: action}, batch_size=[2, 1])}, batch_size=[2]))
        raw_td.set(ACTION, torch.nn.functional.one_hot(action[:, 0], 2).to(raw.full_action_spec[ACTION].dtype))
        raw_out, raw_td = raw.step_and_maybe_reset(raw_td)
        validate(out.get(NEXT), env.tree)
        assert torch.equal(out.get((NEXT, "agent", OBSERVATION))[:, 0], raw_out.get((NEXT, OBSERVATION)))
        assert torch.equal(out.get((NEXT, "agent", REWARD))[:, 0], raw_out.get((NEXT, REWARD)))
        assert torch.equal(out.get((NEXT, TERMINATED)), raw_out.get((NEXT, TERMINATED)))
        assert torch.equal(out.get(("agent", OBSERVATION))[:, 0], raw_td.get(OBSERVATION))
    env.close()
    env.close()  # idempotent
    raw.close()


def test_vmas_if_installed():
    pytest.importorskip("vmas")
    from torchrl.envs.libs.vmas import VmasEnv

    def make():
        return VmasEnv("navigation", num_envs=4, n_agents=3, continuous_actions=False, max_steps=5, seed=0)

    env = TorchRLEnv(make())
    assert isinstance(env.tree.members["agents"], ArrayPopulation) and groups(env.tree)["agents"].capacity == 3
    actions = torch.randint(0, 9, (8, 4, 3), generator=torch.Generator().manual_seed(0))
    # VMAS draws its resets from torch's global generator, so the two runs go one after the other.
    raw = make()
    raw.set_seed(7)
    raw_td, expected = raw.reset(), []
    for action in actions:
        raw_td.set(("agents", ACTION), action.clone())
        raw_out, raw_td = raw.step_and_maybe_reset(raw_td)
        expected.append((raw_out.get((NEXT, "agents", OBSERVATION)), raw_out.get((NEXT, "agents", REWARD)),
                         raw_td.get(("agents", OBSERVATION))))
    env.reset(seed=7)
    for step, (action, (final, reward, first)) in enumerate(zip(actions, expected)):
        out = env.step(TensorDict({"agents": TensorDict({ACTION: action}, batch_size=[4, 3])}, batch_size=[4]))
        validate(out.get(NEXT), env.tree)
        assert torch.equal(out.get((NEXT, "agents", OBSERVATION)), final)
        assert torch.equal(out.get((NEXT, "agents", REWARD)), reward)
        assert torch.equal(out.get(("agents", OBSERVATION)), first)
        assert bool(out.get((NEXT, TERMINATED)).all()) == (step == 4)  # VMAS's max_steps sets terminated
        assert not out.get((NEXT, TRUNCATED)).any()


def test_a_torchrl_gym_env_id_trains_from_the_cli(tmp_path):
    """``torchrl:<gymnasium id>``: torchrl's vectorised GymEnv through the adapter, one iteration from the CLI;
    the id form is as safe as the gymnasium id it names (a ``module:Env`` id would import a module)."""
    import csv

    from orchestration.cli import main
    from orchestration.envs import imports_code

    main(["train", "torchrl:CartPole-v1", "--iterations", "1", "--rollout.num-envs", "4", "--rollout.fragment-length",
          "16", "--no-progress", "--run-dir", str(tmp_path / "run")])
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert int(float(list(csv.DictReader(f))[-1]["env_steps"])) == 64
    assert imports_code("torchrl:CartPole-v1") is None and imports_code("torchrl:evil:Env-v0")


def test_the_initial_weights_do_not_depend_on_how_many_torchrl_envs_are_built():
    """Building a torchrl env draws from torch's global generator: a run's initial weights moved with
    --rollout.num-envs and --rollout.num-workers, and a Ray run (which builds one probe env) started from other
    weights than a local one with the same seed."""
    from tensordict import TensorDict

    from orchestration.builder import build_trainer
    from orchestration.config import RolloutConfig, TrainConfig

    weights = []
    for envs, workers in ((2, 1), (4, 2)):
        trainer = build_trainer(TrainConfig(env="torchrl:CartPole-v1", seed=2, rollout=RolloutConfig(
            num_envs=envs, num_workers=workers, fragment_length=8)))
        weights.append(TensorDict.from_module(trainer.learners["agent"].policy).clone())
        trainer.close()
    assert (weights[0] == weights[1]).all()


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
@pytest.mark.parametrize("batch", [3, 1])
def test_a_factorys_own_env_batch_is_the_runs_on_either_backend(backend, batch, request):
    """A factory's torchrl env steps its own batch (3, or 1 for 2 asked): the run takes it (said once) and counts
    its env steps on both backends (Ray counted the 2 asked for; its probe env, never started, failed to close)."""
    import dataclasses

    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig
    from orchestration.run_notes import UnusedSettingWarning

    if backend == "ray":
        request.getfixturevalue("ray_session")
    env = "tests.adapters.own_batch_factories:make_serial"
    config = TrainConfig(env=env, env_kwargs=(("n", str(batch)),), backend=backend, iterations=2,
                         rollout=RolloutConfig(num_envs=2, fragment_length=16),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0))
    with pytest.warns(UnusedSettingWarning, match=f"--rollout.num-envs 2 is not used: env {env} steps {batch} envs"):
        trainer = build_trainer(config)
    try:
        assert trainer.config == dataclasses.replace(config, rollout=RolloutConfig(num_envs=batch, fragment_length=16))
        assert [trainer.train()["env_steps"] for _ in range(2)] == [16 * batch, 32 * batch]
    finally:
        trainer.close()
