"""The built-in two-stage task Pick, structured action masks in the adapters' step assembly, and the named error
for a Graph space."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from adapters.assembly import GroupStep, StepLayout
from adapters.builtin import Pick, PickConfig
from adapters.protocol import BatchedEnv
from core.layout import ACTION, ACTION_MASK, ACTION_PRESENT, DONE, NEXT, OBSERVATION, REWARD, TERMINATED
from core.specs import AgentNode, DictNode, Leaf, to_composite, validate


def _act(node: torch.Tensor, transform: torch.Tensor) -> TensorDict:
    n = node.shape[0]
    action = TensorDict({"node": node.view(-1, 1), "transform": transform.view(-1, 1)}, [n, 1])
    return TensorDict({"agent": TensorDict({ACTION: action}, [n, 1])}, [n])


def _features(obs: TensorDict, nodes: int = 4, transforms: int = 3) -> torch.Tensor:
    return obs.get(("agent", OBSERVATION)).view(-1, nodes, 2 + 2 * transforms)


def test_pick_steps_validate_and_carry_masks_that_match_the_situation():
    env = Pick(PickConfig(num_envs=64, episode_length=2))
    assert isinstance(env, BatchedEnv)
    obs = env.reset(seed=0)
    spec = to_composite(env.tree, (64,))
    absent_seen = 0
    for t in range(4):
        validate(obs, env.tree)
        mask = obs.get(("agent", ACTION_MASK))
        assert set(mask.keys(True, True)) == set(spec["agent", ACTION_MASK].keys(True, True))
        f = _features(obs)
        assert torch.equal(f[..., 0].argmax(-1), env.good) and bool((f[..., 0].sum(-1) == 1).all())
        assert torch.equal(mask.get("node").squeeze(1), env.available)
        assert bool(env.available[torch.arange(64), env.good].all())
        assert torch.equal(mask.get("transform").squeeze(1), env.legal)
        assert torch.equal(f[..., 2:5].argmax(-1), env.preferred)
        assert bool(env.legal.gather(2, env.preferred.unsqueeze(-1)).all())  # the preferred one is always legal
        assert torch.equal(mask.get((ACTION_PRESENT, "transform")).squeeze(1), env.present)
        absent_seen += int((~env.present).sum())
        # the best answer earns 1 + [transform executed]; an unavailable node earns nothing
        good, best = env.good, env.preferred[torch.arange(64), env.good]
        assert torch.equal(env.rewards(good, best), 1.0 + env.present.float())
        bad = (~env.available).float().argmax(-1)
        assert bool((env.rewards(bad, best)[~env.available.all(-1)] == 0).all())
        present = env.present.clone()
        out = env.step(_act(good, best))
        nxt = out.get((NEXT, "agent"))
        assert torch.equal(nxt.get(REWARD).view(-1), 1.0 + present.float())
        assert bool(out.get((NEXT, TERMINATED)).all()) == (t % 2 == 1)
        assert torch.equal(out.get((NEXT, DONE)), out.get((NEXT, TERMINATED)))
        obs = out
    assert 0 < absent_seen < 4 * 64  # the transformation is skipped on some steps only


def test_pick_resumes_exactly_from_its_state_dict():
    a, b = Pick(PickConfig(num_envs=8)), Pick(PickConfig(num_envs=8))
    a.reset(seed=3)
    a.step(_act(a.good, torch.zeros(8, dtype=torch.long)))
    b.reset(seed=99)
    b.load_state_dict(a.state_dict())
    action = _act(a.good, a.preferred[torch.arange(8), a.good])
    assert (a.step(action) == b.step(action)).all()


def test_pick_is_a_builtin_env_id():
    from orchestration.envs import imports_code, make_env

    env = make_env("builtin:pick", 4, kwargs={"nodes": 5})
    assert isinstance(env, Pick) and env.legal.shape == (4, 5, 3) and imports_code("builtin:pick") is None


def test_step_assembly_builds_a_structured_mask_tree_over_all_true_defaults():
    action = DictNode({"node": Leaf.discrete(3), "transform": Leaf.discrete(2)}, atomic=False,
                      conditional={"transform": "node"})
    tree = AgentNode(observation=Leaf.box((2,)), action=action)
    layout = StepLayout(tree, num_envs=2)
    obs = [np.zeros((2, 1, 2), dtype=np.float32)]
    table = np.zeros((2, 1, 3, 2), dtype=bool)
    table[..., 1] = True
    executed = np.array([[True], [False]])
    step = layout.build([GroupStep(obs, None, {("transform",): table, (ACTION_PRESENT, "transform"): executed})])
    validate(step, tree)
    mask = step.get(("agent", ACTION_MASK))
    assert torch.equal(mask.get("transform"), torch.from_numpy(table))
    assert torch.equal(mask.get((ACTION_PRESENT, "transform")), torch.from_numpy(executed))
    assert bool(mask.get("node").all()) and bool(mask.get((ACTION_PRESENT, "node")).all())  # defaults
    assert set(layout.build([GroupStep(obs, None)]).get(("agent", ACTION_MASK)).keys(True, True)) == \
        set(mask.keys(True, True))  # no mask given: the same keys, all True
    with pytest.raises(ValueError, match=r"path \('trnsform',\) is not one of"):
        layout.build([GroupStep(obs, None, {("trnsform",): table})])
    with pytest.raises(ValueError, match="give its action mask as"):
        layout.build([GroupStep(obs, None, np.ones((2, 1, 3), dtype=bool))])


def test_a_graph_space_is_refused_naming_its_path_and_the_nearest_valid_choice():
    from gymnasium import spaces

    from adapters.spaces import UnsupportedSpaceError, space_to_node

    graph = spaces.Graph(node_space=spaces.Box(0, 1, (3,)), edge_space=None)
    with pytest.raises(UnsupportedSpaceError, match=r"agent_0/observation/graph: .*Graph.*nearest valid choice: "
                                                    r"fixed-capacity Boxes.*Discrete\(max_nodes\)"):
        space_to_node(spaces.Dict({"graph": graph, "pos": spaces.Box(0, 1, (2,))}), "agent_0/observation")
