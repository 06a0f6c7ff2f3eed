"""Structured actions (issue 15): non-atomic elements, conditional heads, per-leaf masks.

Properties: a sampled action is never illegal while a legal one exists; absent elements add exactly 0 to the
log-probability and the entropy; log-probabilities and entropies equal a plain per-row, per-element reference
loop over ``torch.distributions``; a sampled action's log-probability is recomputed bit for bit at any batch size
(deferral). Named errors for structures the heads cannot act on.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import ACTION_MASK, ACTION_PRESENT
from core.policies.composite import ActionHeads
from core.specs import (AgentNode, DictNode, Leaf, StructuredActionError, action_mask_shapes, from_json,
                        is_structured, to_composite, to_json, zeros)


def _pick_node(k: int, m: int, aim: bool = True) -> DictNode:
    children = {"node": Leaf.discrete(k, start=1), "transform": Leaf.discrete(m)}
    if aim:
        children["aim"] = Leaf.box((2,), -1.0, 1.0)
    return DictNode(children, atomic=False, conditional={"transform": "node"})


@st.composite
def pick_cases(draw):
    """A two-stage action ``node -> transform`` (+ a box element), params, masks and presence, batch ``[R]``."""
    k, m, rows = draw(st.integers(2, 5)), draw(st.integers(2, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    heads = ActionHeads(_pick_node(k, m))
    with torch.no_grad():
        for h in heads.heads:
            if hasattr(h, "log_std"):
                h.log_std.normal_(0.0, 0.5, generator=g)
    params = torch.randn(rows, heads.num_params, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0]))
    p_legal = draw(st.sampled_from([0.2, 0.5, 0.9]))
    mask = {"node": torch.rand(rows, k, generator=g) < p_legal,
            "transform": torch.rand(rows, k, m, generator=g) < p_legal,
            ACTION_PRESENT: {"node": torch.rand(rows, generator=g) < 0.7,
                             "transform": torch.rand(rows, generator=g) < 0.5,
                             "aim": torch.rand(rows, generator=g) < 0.5}}
    return heads, params, mask, seed


def _node_legal(mask: dict, r: int) -> list[int]:
    """Reference: the node values the heads may sample in row ``r`` (legal, and with a legal transform when the
    transform is executed); may be empty."""
    k = mask["node"].shape[-1]
    executed = bool(mask[ACTION_PRESENT]["transform"][r])
    return [a for a in range(k) if mask["node"][r, a] and (not executed or mask["transform"][r, a].any())]


def _categorical(logits: torch.Tensor, legal: list[int]) -> torch.distributions.Categorical:
    """The masked categorical; uniform when nothing is legal (a padded row stays finite)."""
    if not legal:
        return torch.distributions.Categorical(logits=torch.zeros_like(logits))
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[legal] = True
    return torch.distributions.Categorical(logits=logits.masked_fill(~keep, -math.inf))


def _reference(heads: ActionHeads, params, actions, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, per element: ``sum present * log p`` and ``sum present * H`` with torch.distributions."""
    k, m = heads.heads[0].num_params, heads.heads[1].leaf.n
    node_p, table_p, aim_p = params.split(heads.sizes, -1)
    lps, hs = [], []
    for r in range(params.shape[0]):
        pres = {e: bool(mask[ACTION_PRESENT][e][r]) for e in ("node", "transform", "aim")}
        legal_nodes = _node_legal(mask, r)
        d_node = _categorical(node_p[r], legal_nodes)
        a = int(actions[0][r]) - 1  # Discrete(k, start=1)
        table = table_p[r].reshape(k, m)

        def d_transform(row: int) -> torch.distributions.Categorical:
            legal = [b for b in range(m) if mask["transform"][r, row, b]]
            return _categorical(table[row], legal)

        gauss = torch.distributions.Normal(aim_p[r], heads.heads[2].log_std.exp())
        y = ((actions[2][r] - heads.heads[2].loc) / heads.heads[2].scale).clamp(-1 + 1e-6, 1 - 1e-6)
        aim_lp = (gauss.log_prob(torch.atanh(y)) - torch.log(heads.heads[2].scale * (1 - y * y))).sum()
        lp = (pres["node"] * d_node.log_prob(torch.tensor(a))
              + pres["transform"] * d_transform(a).log_prob(actions[1][r]) + pres["aim"] * aim_lp)
        probs = d_node.probs
        h_cond = sum(probs[b] * d_transform(b).entropy() for b in range(k) if probs[b] > 0)
        h = pres["node"] * d_node.entropy() + pres["transform"] * h_cond + pres["aim"] * gauss.entropy().sum()
        lps.append(lp)
        hs.append(h)
    return torch.stack(lps).unsqueeze(-1), torch.stack(hs).unsqueeze(-1)


@given(pick_cases())
def test_sampled_two_stage_actions_are_never_illegal(case):
    heads, params, mask, seed = case
    actions, _ = heads.sample(params, torch.Generator().manual_seed(seed), mask)
    modes = heads.mode(params, mask)
    for node, transform in ((actions[0], actions[1]), (modes[0], modes[1])):
        for r in range(params.shape[0]):
            a = int(node[r]) - 1
            assert 0 <= a < mask["node"].shape[-1]
            if _node_legal(mask, r) and a not in _node_legal(mask, r):
                pytest.fail(f"row {r}: node {a} is illegal (legal: {_node_legal(mask, r)})")
            row = mask["transform"][r, a]
            if row.any():
                assert bool(row[int(transform[r])]), f"row {r}: transform {int(transform[r])} illegal for node {a}"


@given(pick_cases())
def test_log_prob_and_entropy_equal_a_per_element_reference_loop(case):
    heads, params, mask, seed = case
    actions, sampled = heads.sample(params, torch.Generator().manual_seed(seed), mask)
    log_prob, entropy = heads.log_prob_entropy(params, actions, mask)
    ref_lp, ref_h = _reference(heads, params, actions, mask)
    torch.testing.assert_close(log_prob, ref_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sampled, ref_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, ref_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(heads.entropy(params, mask), ref_h, rtol=1e-4, atol=1e-4)


@given(pick_cases())
def test_absent_elements_add_exactly_zero(case):
    heads, params, mask, seed = case
    actions, _ = heads.sample(params, torch.Generator().manual_seed(seed), mask)
    none = {**mask, ACTION_PRESENT: {e: torch.zeros_like(v) for e, v in mask[ACTION_PRESENT].items()}}
    assert torch.equal(heads.log_prob(params, actions, none), torch.zeros(params.shape[0], 1))
    assert torch.equal(heads.entropy(params, none), torch.zeros(params.shape[0], 1))
    # changing what an absent element did, or its params, changes nothing
    absent = ~mask[ACTION_PRESENT]["transform"]
    other = [actions[0], torch.where(absent, (actions[1] + 1) % heads.heads[1].leaf.n, actions[1]), actions[2]]
    k = heads.sizes[0]
    noisy = params.clone()
    noisy[:, k:k + heads.sizes[1]] += torch.where(absent, 3.0, 0.0).unsqueeze(-1)
    base = heads.log_prob(params, actions, mask)
    assert torch.equal(heads.log_prob(params, other, mask), base)
    assert torch.equal(heads.log_prob(noisy, actions, mask)[absent], base[absent])
    assert torch.equal(heads.entropy(noisy, mask)[absent], heads.entropy(params, mask)[absent])


@given(pick_cases(), st.sampled_from([1, 7, 1500]))
def test_a_sampled_log_prob_is_recomputed_bit_for_bit_at_any_batch_size(case, copies):
    heads, params, mask, seed = case
    assert heads.exact_log_prob is False  # the tanh-Gaussian "aim" leaf is not exact
    exact = ActionHeads(_pick_node(heads.heads[0].num_params, heads.heads[1].leaf.n, aim=False))
    assert exact.exact_log_prob
    p = params[:, : exact.num_params]
    m = {"node": mask["node"], "transform": mask["transform"],
         ACTION_PRESENT: {e: mask[ACTION_PRESENT][e] for e in ("node", "transform")}}
    actions, sampled = exact.sample(p, torch.Generator().manual_seed(seed), m)
    assert torch.equal(exact.sample_actions(p, torch.Generator().manual_seed(seed), m)[1], actions[1])
    # a "fragment": the same rows among many others, as an actor recomputes them (log_prob_from_params)
    big = lambda x: x.repeat(copies, *([1] * (x.dim() - 1)))  # noqa: E731
    bm = {"node": big(m["node"]), "transform": big(m["transform"]),
          ACTION_PRESENT: {e: big(v) for e, v in m[ACTION_PRESENT].items()}}
    again = exact.log_prob(big(p), [big(a) for a in actions], TensorDict(bm, batch_size=[p.shape[0] * copies]))
    assert torch.equal(again, big(sampled))


def test_per_leaf_masks_of_a_plain_dict_action():
    node = DictNode({"move": Leaf.discrete(5), "keys": Leaf.multi_discrete([2, 3]), "bits": Leaf.binary(2)})
    heads = ActionHeads(node)
    assert not heads.structured and action_mask_shapes(node) is None  # a plain dict declares no mask...
    g = torch.Generator().manual_seed(0)
    params = torch.randn(64, heads.num_params, generator=g) * 3
    legal = torch.zeros(64, 5, dtype=torch.bool)
    legal[:, 3] = True
    keys = torch.tensor([True, False, False, False, True]).expand(64, 5)
    mask = {"move": legal, "keys": keys}  # ...but takes one; "bits" stays unmasked
    actions, log_prob = heads.sample(params, g, mask)
    assert bool((actions[0] == 3).all()) and bool((actions[1] == torch.tensor([0, 2])).all())
    # only the Bernoulli bits are random: log_prob is theirs alone
    bits = torch.distributions.Bernoulli(logits=params[:, -2:]).log_prob(actions[2].float()).sum(-1, keepdim=True)
    torch.testing.assert_close(log_prob, bits)
    torch.testing.assert_close(heads.entropy(params, mask),
                               torch.distributions.Bernoulli(logits=params[:, -2:]).entropy().sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="bits: a binary action leaf takes no action mask"):
        heads.log_prob(params, actions, {"bits": torch.ones(64, 2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="mvoe"):
        heads.log_prob(params, actions, {"mvoe": legal})


def test_the_single_leaf_mask_form_is_unchanged():
    heads = ActionHeads(Leaf.discrete(4))
    params = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    legal = torch.tensor([False, True, False, True]).expand(8, 4)
    actions, log_prob = heads.sample(params, torch.Generator().manual_seed(2), legal)
    assert bool(((actions[0] == 1) | (actions[0] == 3)).all())
    ref = torch.distributions.Categorical(logits=params.masked_fill(~legal, -math.inf))
    torch.testing.assert_close(log_prob.squeeze(-1), ref.log_prob(actions[0]))
    with pytest.raises(ValueError, match="single discrete or multi_discrete"):
        ActionHeads(DictNode({"a": Leaf.box((1,))})).sample(torch.zeros(8, 1), None, legal)


def test_the_tree_declares_and_serialises_its_structure():
    node = _pick_node(4, 3)
    tree = AgentNode(observation=Leaf.box((3,)), action=node)
    assert is_structured(node) and from_json(to_json(tree)) == tree
    assert from_json(to_json(tree)).action.conditional == {"transform": "node"}
    assert action_mask_shapes(node) == {("node",): (4,), ("transform",): (4, 3), (ACTION_PRESENT, "node"): (),
                                        (ACTION_PRESENT, "transform"): (), (ACTION_PRESENT, "aim"): ()}
    step = zeros(tree, (2,))
    spec = to_composite(tree, (2,))
    assert step.get(("agent", ACTION_MASK, "transform")).shape == (2, 1, 4, 3)
    assert bool(step.get(("agent", ACTION_MASK, ACTION_PRESENT, "aim")).all())
    assert spec[("agent", ACTION_MASK, "transform")].shape == (2, 1, 4, 3)
    assert set(spec["agent", ACTION_MASK].keys(True, True)) == set(step.get(("agent", ACTION_MASK)).keys(True, True))
    assert not is_structured(DictNode({"a": Leaf.discrete(2)}))


@pytest.mark.parametrize("children, conditional, match", [
    ({"node": Leaf.box((2,)), "transform": Leaf.discrete(3)}, {"transform": "node"},
     r"action/transform: .*conditioned on action/node, a box node.*put a discrete leaf before it"),
    ({"pos": Leaf.box((2,)), "node": Leaf.discrete(4), "transform": Leaf.discrete(3)}, {"transform": "pos"},
     r"action/transform: .*a box node.*\['node'\]"),
    ({"transform": Leaf.discrete(3), "node": Leaf.discrete(4)}, {"transform": "node"},
     r"action/transform: .*does not come before it"),
    ({"node": Leaf.discrete(4), "transform": Leaf.box((3,))}, {"transform": "node"},
     r"action/transform: only a discrete leaf can be conditioned, this is a box"),
    ({"node": Leaf.discrete(4), "transform": Leaf.discrete(3)}, {"transform": "nod"},
     r"action/transform: is conditioned on 'nod', not a sibling.*\['node'\]"),
    ({"node": Leaf.discrete(4)}, {"transform": "node"}, r"action/transform: conditional names no child"),
])
def test_unsupported_structures_raise_a_named_error(children, conditional, match):
    node = DictNode(children, conditional=conditional)
    with pytest.raises(StructuredActionError, match=match):
        AgentNode(observation=Leaf.box((1,)), action=node)
    with pytest.raises(StructuredActionError, match=match):
        ActionHeads(node)


def test_conditional_is_an_action_tag_only():
    obs = DictNode({"a": Leaf.discrete(2), "b": Leaf.discrete(2)}, conditional={"b": "a"})
    with pytest.raises(ValueError, match="observation: conditional is an action tag"):
        AgentNode(observation=obs, action=Leaf.discrete(2))


def test_a_mask_tensor_for_a_structured_action_is_refused():
    heads = ActionHeads(_pick_node(3, 2, aim=False))
    with pytest.raises(ValueError, match="as a tree keyed like the action"):
        heads.sample(torch.zeros(4, heads.num_params), torch.Generator(), torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"conditional action mask \(4, 2, 3\)"):
        heads.entropy(torch.zeros(4, heads.num_params), {"transform": torch.ones(4, 2, 3, dtype=torch.bool)})


def test_a_policy_defers_structured_log_probs_and_recomputes_them_per_fragment():
    from adapters.builtin import Pick, PickConfig
    from core.policies import make_policies

    env = Pick(PickConfig(num_envs=16))
    policy = make_policies(env.tree)["agent"]
    assert policy.defers_log_prob  # categorical leaves and a conditional table: exact
    obs, params, actions, masks, sampled = env.reset(seed=1), [], [], [], []
    for t in range(5):
        group = obs.get("agent")
        # what an actor records (params, no log-prob) and what a plain sample returns, from the same draws
        out = policy.act_step(group, generator=torch.Generator().manual_seed(t), with_value=False,
                              with_log_prob=False)
        plain = policy.act_step(group, generator=torch.Generator().manual_seed(t), with_value=False)
        assert "log_prob" not in out and torch.equal(out["action"]["transform"], plain["action"]["transform"])
        params.append(out["action_params"])
        actions.append(TensorDict(out["action"], batch_size=[16, 1]))
        masks.append(group.get(ACTION_MASK))
        sampled.append(plain["log_prob"])
        rows = torch.arange(16)
        node, transform = out["action"]["node"].view(-1), out["action"]["transform"].view(-1)
        assert bool(env.available[rows, node].all()) and bool(env.legal[rows, node, transform].all())
        obs = env.step(TensorDict({"agent": TensorDict({"action": actions[-1]}, [16, 1])}, [16]))
    fragment = policy.log_prob_from_params(torch.stack(params, 1), torch.stack(actions, 1), torch.stack(masks, 1))
    assert torch.equal(fragment, torch.stack(sampled, 1))
    batch = TensorDict({"observation": torch.zeros(16, 5, 1, 32), "action": torch.stack(actions, 1),
                        ACTION_MASK: torch.stack(masks, 1)}, [16, 5])
    terms = policy.evaluate_terms(batch)
    assert terms["log_prob"].shape == terms["entropy"].shape == (16, 5, 1, 1)
