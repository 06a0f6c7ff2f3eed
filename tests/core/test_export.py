"""Export: the saved/loaded program gives the actions of ``act(..., deterministic=True)`` at any batch size."""

from __future__ import annotations

import io

import pytest
import torch

from core.layout import ACTION, ACTION_MASK, NEXT, RECURRENT_STATE
from core.policies import PolicyConfig, deployable, deployment_inputs, export_policy, make_policies
from core.specs import AgentNode, ArrayPopulation, DictNode, Leaf, iter_leaves, rand

BATCHES = (1, 7, 64)


def _array(obs, action, capacity=3) -> ArrayPopulation:
    return ArrayPopulation(template=AgentNode(observation=obs, action=action), capacity=capacity)


CASES = {
    # masked discrete action, dict observation with an eval-only leaf, slot ids
    "masked_discrete": (_array(DictNode({"pos": Leaf.box((3,)), "kind": Leaf.discrete(4),
                                         "secret": Leaf.box((2,), eval_only=True)}), Leaf.discrete(5)),
                        PolicyConfig(agent_id_input=True, critic="central")),
    "composite_tanh": (_array(Leaf.box((4,)), DictNode({"move": Leaf.multi_discrete((3, 2)),
                                                        "aim": Leaf.box((2,), low=-1.0, high=2.0)})),
                       PolicyConfig(activation="relu")),
    "recurrent_binary": (_array(Leaf.box((2,)), Leaf.binary(3), capacity=2),
                         PolicyConfig(recurrent=True, recurrent_size=8, hidden_sizes=(16,))),
    "recurrent_lstm_critic": (_array(Leaf.box((2,)), Leaf.discrete(3), capacity=2),
                              PolicyConfig(recurrent=True, recurrent_cell="lstm", recurrent_critic=True,
                                           recurrent_size=8, hidden_sizes=(16,))),
}


def _round_trip(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _step(tree, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    step = rand(tree, (batch,), g)["agents"]
    if ACTION_MASK in step.keys():
        mask = torch.rand(step[ACTION_MASK].shape, generator=g) < 0.5
        mask[..., -1] = True
        step[ACTION_MASK] = mask
    return step


@pytest.fixture(scope="module", params=list(CASES))
def exported(request):
    tree, config = CASES[request.param]
    torch.manual_seed(0)
    policy = make_policies(tree, config)["agents"]
    with torch.no_grad():  # make the deterministic output depend on the observation visibly
        policy.actor_out.weight.mul_(10.0)
    return tree, policy, _round_trip(export_policy(policy, _step(tree, 1, seed=1)))


def _flat_actions(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("batch", BATCHES)
def test_loaded_program_matches_deterministic_act(exported, batch):
    tree, policy, program = exported
    step = _step(tree, batch, seed=10 + batch)
    if policy.recurrent:  # a carried, non-zero state
        step[RECURRENT_STATE] = torch.randn(batch, policy.num_agents, policy.state_size)
    args, kwargs = deployment_inputs(policy, step)
    with torch.no_grad():
        got = _flat_actions(program.module()(*args, **kwargs))
        ref = policy.act(step, deterministic=True, recurrent_state=step.get(RECURRENT_STATE, None))
        eager = _flat_actions(deployable(policy)(*args, **kwargs))
    expected = [ref.get((ACTION, *path)) for path in policy.heads.paths]
    if policy.recurrent:
        expected.append(policy.split_state(ref[NEXT, RECURRENT_STATE])[0])  # the actor cell's part
    assert len(got) == len(expected) == len(eager)
    for g, e, d in zip(got, expected, eager):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(d, e, atol=1e-6, rtol=1e-6)
    if ACTION_MASK in kwargs:
        assert bool(kwargs[ACTION_MASK].gather(-1, got[0].unsqueeze(-1)).all())
    assert len({tuple(a.tolist()) for a in got[0].flatten(1)}) > 1 or batch == 1  # not a constant output


def test_a_loaded_programs_outputs_need_no_gradient_and_the_policy_still_trains(exported):
    """``program(obs).numpy()`` works as the docs write it (no ``torch.no_grad()``): a float action of a program
    whose parameters required grad could not be read that way. The live policy's parameters still train."""
    tree, policy, program = exported
    args, kwargs = deployment_inputs(policy, _step(tree, 3, seed=4))
    for out in _flat_actions(program.module()(*args, **kwargs)):
        assert not out.requires_grad
        out.numpy()
    assert all(p.requires_grad for p in policy.parameters())


def test_inputs_exclude_eval_only_leaves_in_documented_order(exported):
    tree, policy, _ = exported
    module = deployable(policy)
    expected = [p for p, leaf in iter_leaves(tree.template.observation) if not leaf.eval_only]
    assert module.observation_keys == expected
    args, _ = deployment_inputs(policy, _step(tree, 2, seed=3))
    assert len(args) == len(expected)
    assert not any(name.startswith("critic") for name, _ in module.named_parameters())


def test_a_structured_action_exports_with_its_mask_tree():
    """A conditional, non-atomic action (builtin:pick's) takes its masks as a nested dict; the program's greedy
    pair equals act(deterministic=True)'s and is legal under the table of the chosen node."""
    from adapters.builtin.pick import Pick, PickConfig
    from core.policies.export import deployment_signature

    env = Pick(PickConfig(num_envs=5))
    step = env.reset(seed=3)["agent"]
    torch.manual_seed(0)
    policy = make_policies(env.tree)["agent"]
    args, kwargs = deployment_inputs(policy, step)
    assert isinstance(kwargs[ACTION_MASK], dict) and set(kwargs[ACTION_MASK]) >= {"node", "transform"}
    program = _round_trip(export_policy(policy, step))
    node, transform = program.module()(*args, **kwargs)
    ref = policy.act(step, deterministic=True)
    assert torch.equal(node, ref[ACTION, "node"]) and torch.equal(transform, ref[ACTION, "transform"])
    table = step[ACTION_MASK, "transform"]  # [E, 1, nodes, T]
    legal = table.gather(2, node[..., None, None].expand(*node.shape, 1, table.shape[-1])).squeeze(2)
    assert bool(legal.gather(-1, transform.unsqueeze(-1)).all())
    names = [i["name"] for i in deployment_signature(policy, step)["inputs"]]
    assert "action_mask/node" in names and "action_mask/transform" in names
