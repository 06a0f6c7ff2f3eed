"""GroupPolicy: shapes per tree, masks, eval-only isolation, parameter sharing, determinism, act/evaluate agreement."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import (ACTION, ACTION_MASK, ACTION_PARAMS, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE,
                         SHARED, STATE_VALUE)
from core.policies import ENTROPY, GroupPolicy, PolicyConfig, make_policies
from core.specs import AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, groups, iter_leaves, rand

E = 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _array(obs, action, capacity=3, shared=None) -> ArrayPopulation:
    return ArrayPopulation(template=AgentNode(observation=obs, action=action), capacity=capacity,
                           shared_observation=shared)


TREES = {
    "box_discrete": _array(Leaf.box((4,)), Leaf.discrete(2)),
    "dict_evalonly_multidiscrete": _array(
        DictNode({"pos": Leaf.box((2, 2)), "kind": Leaf.discrete(3, start=1), "bits": Leaf.binary(2),
                  "secret": Leaf.box((3,), eval_only=True)}),
        Leaf.multi_discrete((3, 2)), shared=DictNode({"state": Leaf.box((5,)), "god": Leaf.box((2,), eval_only=True)})),
    "composite_discrete_box": _array(Leaf.box((4,)), DictNode({"move": Leaf.discrete(4), "aim": Leaf.box((2,))})),
    "bounded_tanh": _array(Leaf.box((3,)), Leaf.box((2,), low=-2.0, high=(1.0, 3.0))),
}
CONFIGS = [PolicyConfig(), PolicyConfig(critic="central", agent_id_input=True),
           PolicyConfig(recurrent=True, recurrent_size=8, hidden_sizes=(16,)),
           PolicyConfig(recurrent=True, recurrent_cell="lstm", recurrent_critic=True, recurrent_size=8,
                        hidden_sizes=(16,), critic="central"),
           PolicyConfig(critic="joint", recurrent=True, recurrent_size=8, hidden_sizes=(16,))]


def _setup(tree, config, seed=0):
    torch.manual_seed(seed)  # parameter init only; acting uses explicit generators
    policy = make_policies(tree, config)["agents"]
    step = rand(tree, (E,), _gen(seed + 1))
    return policy, step["agents"], step.get(SHARED, None)


_SYMMETRIC = _setup(TREES["composite_discrete_box"], PolicyConfig())


@pytest.mark.parametrize("config", CONFIGS, ids=["local", "central_ids", "recurrent", "lstm_recurrent_critic",
                                                "joint_recurrent_actor"])
@pytest.mark.parametrize("name", list(TREES))
def test_act_and_evaluate_shapes_and_agreement(name, config):
    tree = TREES[name]
    policy, obs, shared = _setup(tree, config)
    a = groups(tree)["agents"].capacity
    out = policy.act(obs, shared, _gen(2))
    assert out.batch_size == (E, a)
    for path, leaf in iter_leaves(tree.template.action):
        action = out.get((ACTION, *path))
        assert action.shape == (E, a, *leaf.shape) and action.dtype == leaf.dtype
        if leaf.kind == "box" and leaf.low != float("-inf"):
            low, high = torch.tensor(leaf.low), torch.tensor(leaf.high)
            assert bool(((action >= low) & (action <= high)).all())
    assert out[LOG_PROB].shape == out[STATE_VALUE].shape == (E, a, 1)
    assert not out[LOG_PROB].requires_grad and not out[STATE_VALUE].requires_grad
    batch = obs.copy().update(out.exclude(NEXT))
    ev = policy.evaluate(batch, shared)
    assert set(ev.keys()) == {LOG_PROB, ENTROPY, STATE_VALUE} and ev.batch_size == (E, a)
    for key in (LOG_PROB, ENTROPY, STATE_VALUE):
        assert ev[key].shape == (E, a, 1) and ev[key].requires_grad
    torch.testing.assert_close(ev[LOG_PROB], out[LOG_PROB], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ev[STATE_VALUE], out[STATE_VALUE])
    if policy.critic_cell is None:
        torch.testing.assert_close(policy.value(obs, shared), out[STATE_VALUE])
    else:
        with pytest.raises(ValueError, match="sequence_values"):
            policy.value(obs, shared)
    (ev[LOG_PROB].sum() + ev[ENTROPY].sum() + ev[STATE_VALUE].sum()).backward()
    assert policy.actor_out.weight.grad.abs().sum() > 0 and policy.critic_out.weight.grad.abs().sum() > 0
    if config.recurrent:
        assert out[RECURRENT_STATE].shape == out[NEXT, RECURRENT_STATE].shape == (E, a, policy.state_size)
        assert not torch.equal(out[NEXT, RECURRENT_STATE], out[RECURRENT_STATE])


def test_act_works_on_other_batch_dims_and_plain_dicts():
    policy, obs, _ = _setup(TREES["box_discrete"], PolicyConfig())
    et = obs.reshape(2, 3, 3)  # [E, T, A] layout, as in a fragment
    assert policy.act(et, generator=_gen(0))[LOG_PROB].shape == (2, 3, 3, 1)
    plain = {OBSERVATION: obs[OBSERVATION], ACTION_MASK: obs[ACTION_MASK]}
    step = policy.act_step(plain, generator=_gen(5))
    assert isinstance(step, dict) and torch.equal(step[ACTION], policy.act(obs, generator=_gen(5))[ACTION])



def test_masked_actions_are_never_sampled():
    tree = _array(Leaf.box((4,)), Leaf.discrete(6), capacity=4)
    policy, _, _ = _setup(tree, PolicyConfig())
    g = _gen(7)
    obs = rand(tree, (500,), g)["agents"]
    mask = torch.rand(500, 4, 6, generator=g) < 0.4
    mask[..., 5] = True  # keep at least one legal action; bias every row's logits towards illegal ones too
    obs[ACTION_MASK] = mask
    with torch.no_grad():
        policy.actor_out.bias.copy_(torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, -3.0]))
    seen = 0
    for seed in range(5):  # 5 x 500 envs x 4 agents = 10k samples
        action = policy.act(obs, generator=_gen(100 + seed))[ACTION]
        assert bool(mask.gather(-1, action.unsqueeze(-1)).all())
        seen += action.numel()
    assert seen == 10_000
    assert bool(mask.gather(-1, policy.act(obs, deterministic=True)[ACTION].unsqueeze(-1)).all())


def test_eval_only_leaves_reach_the_central_critic_but_not_the_actor():
    tree = TREES["dict_evalonly_multidiscrete"]
    policy, obs, shared = _setup(tree, PolicyConfig(critic="central"))
    changed = obs.clone()
    changed[OBSERVATION, "secret"] = changed[OBSERVATION, "secret"] + 5.0
    x1 = policy.actor_encoder(policy.actor_encoder.read(obs[OBSERVATION]))
    x2 = policy.actor_encoder(policy.actor_encoder.read(changed[OBSERVATION]))
    assert torch.equal(policy.actor_params(x1, shared=shared)[0], policy.actor_params(x2, shared=shared)[0])
    # the shared leaf that is not eval-only reaches the actor; without the shared entry it is a named error
    moved = shared.clone()
    moved["state"] = moved["state"] + 5.0
    assert not torch.allclose(policy.actor_params(x1, shared=shared)[0], policy.actor_params(x1, shared=moved)[0])
    assert policy.actor_shared_encoder.paths == [()] and policy.actor_shared_encoder.out_features == 5
    with pytest.raises(ValueError, match="actor reads the shared observations"):
        policy.actor_params(x1)
    a1, a2 = policy.act(obs, shared, _gen(3)), policy.act(changed, shared, _gen(3))
    assert torch.equal(a1[ACTION], a2[ACTION]) and torch.equal(a1[LOG_PROB], a2[LOG_PROB])
    assert not torch.allclose(a1[STATE_VALUE], a2[STATE_VALUE])
    shared2 = shared.clone()
    shared2["god"] = shared2["god"] + 5.0  # eval-only shared leaf
    assert not torch.allclose(policy.value(obs, shared), policy.value(obs, shared2))
    assert torch.equal(policy.act(obs, shared2, _gen(3))[ACTION], a1[ACTION])
    with pytest.raises(ValueError, match="shared observation"):
        policy.value(obs, None)


def test_central_critic_reads_other_agents_but_not_absent_ones():
    tree = TREES["box_discrete"]
    obs_of = lambda td: td[OBSERVATION]  # noqa: E731
    for critic, sees_others in (("local", False), ("central", True)):
        policy, obs, _ = _setup(tree, PolicyConfig(critic=critic))
        other = obs.clone()
        obs_of(other)[:, 1] += 3.0  # change agent 1 only
        v1, v2 = policy.value(obs, None), policy.value(other, None)
        assert not torch.allclose(v1[:, 1], v2[:, 1])  # its own value moves
        assert (not torch.allclose(v1[:, 0], v2[:, 0])) == sees_others
        if critic == "central":  # an absent agent's observation is zeroed: changing it changes nothing
            obs[MASK][:, 1] = False
            other[MASK][:, 1] = False
            torch.testing.assert_close(policy.value(obs, None)[:, [0, 2]], policy.value(other, None)[:, [0, 2]])


def test_joint_critic_runs_once_per_env_and_equals_a_per_slot_reference():
    """critic="joint": one trunk pass per env row on [every agent's observation (absent zeroed), shared], one
    output unit per slot; differential against the same arithmetic written out by hand."""
    tree = TREES["dict_evalonly_multidiscrete"]
    policy, obs, shared = _setup(tree, PolicyConfig(critic="joint", hidden_sizes=(16, 8)))
    obs[MASK][:, 2] = torch.tensor([True, False] * (E // 2))
    rows, first = [], policy.critic_trunk[0]
    first.forward = lambda x: rows.append(x.shape) or type(first).forward(first, x)  # run_layers skips hooks
    value = policy.value(obs, shared)
    del first.forward
    assert value.shape == (E, 3, 1) and rows == [torch.Size([E, policy.critic_trunk[0].in_features])]
    encoder = policy.critic_encoder or policy.actor_encoder
    own = encoder.encode(obs[OBSERVATION]) * obs[MASK].unsqueeze(-1).float()
    x = torch.cat([own.reshape(E, -1), policy.shared_encoder(shared)], -1)
    h = x
    for layer in policy.critic_trunk:
        h = layer(h)
    expected = torch.stack([h @ policy.critic_out.weight[i] + policy.critic_out.bias[i] for i in range(3)], 1)
    torch.testing.assert_close(value, expected.unsqueeze(-1))
    # every slot reads every present agent; an absent agent's observation changes nothing
    other = obs.clone()
    other[OBSERVATION, "pos"][:, 0] += 3.0
    moved = (policy.value(other, shared) - value).abs().squeeze(-1)
    assert bool((moved > 0).all())
    hidden = obs.clone()
    hidden[OBSERVATION, "pos"][1::2, 2] += 3.0  # agent 2 is absent in the odd rows
    torch.testing.assert_close(policy.value(hidden, shared)[1::2], value[1::2])
    with pytest.raises(ValueError, match="joint critic needs the shared observation"):
        policy.value(obs, None)
    with pytest.raises(ValueError, match="recurrent_critic must be False with critic='joint'"):
        PolicyConfig(critic="joint", recurrent=True, recurrent_critic=True)


@given(perm=st.permutations(range(3)), seed=st.integers(0, 2**31 - 1))
def test_parameters_shared_across_agents_permutation_equivariance(perm, seed):
    """Without slot ids, one set of weights serves all agents: permuting agents permutes every output."""
    policy = _SYMMETRIC[0]
    obs = rand(TREES["composite_discrete_box"], (E,), _gen(seed))["agents"]
    perm = torch.tensor(perm)
    permuted = policy.act(obs[:, perm], generator=_gen(seed))
    det, det_p = policy.act(obs, deterministic=True), policy.act(obs[:, perm], deterministic=True)
    torch.testing.assert_close(det[ACTION, "aim"][:, perm], det_p[ACTION, "aim"])
    assert torch.equal(det[ACTION, "move"][:, perm], det_p[ACTION, "move"])
    for key in (STATE_VALUE, LOG_PROB):
        torch.testing.assert_close(det[key][:, perm], det_p[key])
    # sampled actions of a permuted batch: evaluate agrees with act
    batch = obs[:, perm].update(permuted.exclude(NEXT))
    torch.testing.assert_close(policy.evaluate(batch)[LOG_PROB], permuted[LOG_PROB], atol=1e-5, rtol=1e-5)


def test_agent_ids_break_the_symmetry():
    policy, obs, _ = _setup(TREES["composite_discrete_box"], PolicyConfig(agent_id_input=True))
    obs[OBSERVATION] = obs[OBSERVATION][:, :1].expand(E, 3, 4).clone()  # identical agents
    aim = policy.act(obs, deterministic=True)[ACTION, "aim"]
    assert not torch.allclose(aim[:, 0], aim[:, 1])
    aim = _SYMMETRIC[0].act(obs, deterministic=True)[ACTION, "aim"]
    torch.testing.assert_close(aim[:, 0], aim[:, 1])


def test_policies_pickle_and_deep_copy():
    policy, obs, shared = _setup(TREES["dict_evalonly_multidiscrete"], PolicyConfig(critic="central", recurrent=True))
    for clone in (copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert (clone.act(obs, shared, deterministic=True) == policy.act(obs, shared, deterministic=True)).all()
    lean, obs, _ = _setup(TREES["box_discrete"], PolicyConfig())
    for clone in (copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
        # the lean path's layer references follow the clone (new weights loaded into it act)
        assert clone._lean[1][-1] is clone.actor_out and clone._lean[2] is clone.heads.heads[0]
        with torch.no_grad():
            clone.actor_out.bias.copy_(torch.tensor([50.0, -50.0]))
        assert (clone.act(obs, deterministic=True)[ACTION] == 0).all()


def test_deterministic_mode_and_seeding():
    policy, obs, _ = _setup(TREES["composite_discrete_box"], PolicyConfig())
    d1, d2 = policy.act(obs, deterministic=True), policy.act(obs, generator=_gen(9), deterministic=True)
    assert (d1 == d2).all()
    torch.testing.assert_close(d1[ACTION, "aim"], policy.actor_params(
        policy.actor_encoder(policy.actor_encoder.read(obs[OBSERVATION])))[0][..., 4:])
    s1, s2, s3 = (policy.act(obs, generator=_gen(s)) for s in (11, 11, 12))
    assert (s1 == s2).all()
    assert not torch.equal(s1[ACTION, "aim"], s3[ACTION, "aim"])
    with pytest.raises(ValueError, match="Generator"):
        policy.act(obs)


def test_recurrent_state_reset_and_evaluate_from_stored_state():
    tree = TREES["box_discrete"]
    policy, obs, _ = _setup(tree, PolicyConfig(recurrent=True, recurrent_size=8))
    first = policy.act(obs, generator=_gen(1))
    state = first[NEXT, RECURRENT_STATE]
    second = policy.act(obs, generator=_gen(2), recurrent_state=state)
    restart = torch.zeros(E, dtype=torch.bool)
    restart[::2] = True
    reset = policy.act(obs, generator=_gen(2), recurrent_state=state, episode_start=restart)
    assert torch.equal(reset[RECURRENT_STATE][::2], torch.zeros(3, 3, 8))
    assert torch.equal(reset[RECURRENT_STATE][1::2], state[1::2])
    # a new episode continues as from a zero state; the others as from their carried state
    torch.testing.assert_close(reset[NEXT, RECURRENT_STATE][::2], first[NEXT, RECURRENT_STATE][::2])
    torch.testing.assert_close(reset[NEXT, RECURRENT_STATE][1::2], second[NEXT, RECURRENT_STATE][1::2])
    ev = policy.evaluate(obs.copy().update(second.exclude(NEXT)))
    torch.testing.assert_close(ev[LOG_PROB], second[LOG_PROB])
    with pytest.raises(ValueError, match="recurrent_state"):
        policy.evaluate(obs.copy().set(ACTION, second[ACTION]))


def test_shared_observations_of_ancestor_populations_only():
    inner = _array(Leaf.box((2,)), Leaf.discrete(2), capacity=2, shared=Leaf.box((4,)))
    tree = DictPopulation(members={"team": inner, "solo": AgentNode(observation=Leaf.box((2,)),
                                                                        action=Leaf.discrete(2))},
                          shared_observation=DictNode({"g": Leaf.box((3,))}))
    policies = make_policies(tree, PolicyConfig(critic="central"))
    assert policies["team"].shared_encoder.paths == [(), ("team",)]
    assert policies["solo"].shared_encoder.paths == [()]
    step = rand(tree, (E,), _gen(3))
    assert policies["team"].act(step["team"], step[SHARED], _gen(4))[STATE_VALUE].shape == (E, 2, 1)


def test_errors_and_init():
    policy, obs, _ = _setup(TREES["box_discrete"], PolicyConfig())
    with pytest.raises(ValueError, match="agent dim"):
        policy.act(obs[:, :2], generator=_gen(0))
    with pytest.raises(ValueError, match="does not end with"):
        policy.act(TensorDict({OBSERVATION: torch.zeros(E, 3, 5)}, batch_size=[E, 3]), generator=_gen(0))
    with pytest.raises(ValueError, match="eval_only"):
        GroupPolicy(groups(_array(Leaf.box((2,), eval_only=True), Leaf.discrete(2)))["agents"])
    with pytest.raises(ValueError, match="critic"):
        PolicyConfig(critic="global")
    with pytest.raises(ValueError, match="hidden_sizes"):
        PolicyConfig(hidden_sizes=[64])
    w = policy.actor_out.weight  # orthogonal rows with gain 0.01 (37 details, detail 2)
    torch.testing.assert_close(w @ w.T, 1e-4 * torch.eye(w.shape[0]), atol=1e-7, rtol=0)
    assert torch.equal(policy.critic_out.bias, torch.zeros(1))


# Trees whose action heads recompute log-probabilities exactly (Head.exact_log_prob), with and without masks.
EXACT_TREES = {
    "discrete": _array(Leaf.box((4,)), Leaf.discrete(3, start=2)),
    "multi_discrete": TREES["dict_evalonly_multidiscrete"],
    "binary": _array(Leaf.box((4,)), Leaf.binary(3)),
    "composite": _array(Leaf.box((4,)), DictNode({"move": Leaf.discrete(4), "fire": Leaf.binary(2),
                                                  "pick": Leaf.multi_discrete((2, 3))})),
}


def _stack_steps(outs: list[dict], key: str, batch) -> torch.Tensor | TensorDict:
    """Per-step outputs ``[E, A, ...]`` (tensors or action trees) stacked along a new time dim 1."""
    values = [o[key] if isinstance(o[key], torch.Tensor) else TensorDict(o[key], batch) for o in outs]
    return torch.stack(values, 1)


def _random_mask(leaf: Leaf, shape, generator) -> torch.Tensor:
    """A random action mask ``[*shape, n]`` with at least one legal action in every component."""
    sizes = (leaf.n,) if leaf.kind == "discrete" else leaf.nvec
    parts = []
    for n in sizes:
        m = torch.rand(*shape, n, generator=generator) < 0.5
        m[..., 0] |= ~m.any(-1)
        parts.append(m)
    return torch.cat(parts, -1)


@given(name=st.sampled_from(sorted(EXACT_TREES)), steps=st.integers(1, 5), envs=st.integers(1, 9),
       seed=st.integers(0, 2**16), masked=st.booleans(), deterministic=st.booleans())
def test_log_probs_recomputed_for_a_fragment_equal_the_per_step_ones_bit_for_bit(name, steps, envs, seed, masked,
                                                                                 deterministic):
    """An actor may record action params and compute a fragment's log-probs at once (orchestration.actor)."""
    tree = EXACT_TREES[name]
    torch.manual_seed(seed)
    policy = make_policies(tree)["agents"]
    assert policy.defers_log_prob
    roots = [rand(tree, (envs,), _gen(seed + 1 + t)) for t in range(steps)]
    obs_steps = [r["agents"] for r in roots]
    shared = [r.get(SHARED, None) for r in roots]  # the actor reads non-eval-only shared observations
    has_mask = ACTION_MASK in obs_steps[0].keys()
    if masked and has_mask:
        for o in obs_steps:
            o[ACTION_MASK] = _random_mask(tree.template.action, (envs, 3), _gen(seed))
    direct_gen, deferred_gen = _gen(seed + 100), _gen(seed + 100)
    direct = [policy.act_step(o, sh, direct_gen, deterministic, with_value=False) for o, sh in zip(obs_steps, shared)]
    deferred = [policy.act_step(o, sh, deferred_gen, deterministic, with_value=False, with_log_prob=False)
                for o, sh in zip(obs_steps, shared)]
    assert all(LOG_PROB not in d and ACTION_PARAMS in d for d in deferred)
    actions = _stack_steps(deferred, ACTION, [envs, 3])
    assert (actions == _stack_steps(direct, ACTION, [envs, 3])).all()  # the same random draws
    mask = torch.stack([o[ACTION_MASK] for o in obs_steps], 1) if has_mask else None
    recomputed = policy.log_prob_from_params(_stack_steps(deferred, ACTION_PARAMS, None), actions, mask)
    assert recomputed.shape == (envs, steps, 3, 1)
    assert torch.equal(recomputed, _stack_steps(direct, LOG_PROB, None))


def test_heads_that_cannot_recompute_log_probs_keep_returning_them():
    policy, obs, _ = _setup(TREES["bounded_tanh"], PolicyConfig())
    assert not policy.heads.exact_log_prob  # a tanh-squashed Gaussian: atanh of the action loses bits
    out = policy.act_step(obs, generator=_gen(0), with_value=False, with_log_prob=False)
    assert LOG_PROB in out and ACTION_PARAMS not in out
    with pytest.raises(ValueError, match="cannot recompute"):
        policy.log_prob_from_params(torch.zeros(E, 3, policy.heads.num_params), out[ACTION])
    # many actions: storing every step's logits would cost more than the log-probs it saves
    policy, obs, _ = _setup(_array(Leaf.box((4,)), Leaf.discrete(100)), PolicyConfig())
    assert policy.heads.exact_log_prob and not policy.defers_log_prob
    assert LOG_PROB in policy.act_step(obs, generator=_gen(0), with_value=False, with_log_prob=False)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_log_prob", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_the_lean_acting_path_gives_what_the_general_one_gives(deterministic, with_log_prob, masked):
    """act_step's shortcut for one flat observation and one discrete action (GroupPolicy._lean)."""
    policy, obs, _ = _setup(EXACT_TREES["discrete"], PolicyConfig())
    assert policy._lean is not None
    assert all(make_policies(tree, config)["agents"]._lean is None for tree, config in [
        (EXACT_TREES["discrete"], PolicyConfig(agent_id_input=True)), (EXACT_TREES["discrete"], CONFIGS[2]),
        (EXACT_TREES["composite"], PolicyConfig()), (TREES["dict_evalonly_multidiscrete"], PolicyConfig())])
    if masked:
        obs[ACTION_MASK] = _random_mask(EXACT_TREES["discrete"].template.action, (E, 3), _gen(5))
    lean = policy.act_step(obs, None, _gen(7), deterministic, with_value=False, with_log_prob=with_log_prob)
    policy._lean = None
    general = policy.act_step(obs, None, _gen(7), deterministic, with_value=False, with_log_prob=with_log_prob)
    assert lean.keys() == general.keys()
    assert all(torch.equal(lean[k], general[k]) for k in general)

