"""``shoal export`` of a checkpoint with a per-agent policy mapping: one program per policy, a manifest that maps
every agent to its program and documents every input, programs that act like the checkpoint's policies."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, MASK, OBSERVATION
from core.policies import make_policies
from core.specs import from_json
from orchestration.checkpoint import load_checkpoint
from orchestration.cli import export, train
from orchestration.run_state import load_config

ENV = "pettingzoo:classic.connect_four_v3"
OBS_SHAPE, N_ACTIONS = [6, 7, 2], 7

pytestmark = pytest.mark.slow  # trains (one short iteration) before exporting


def _train_and_export(root, *mapping: str) -> tuple[dict, dict, list[str], dict]:
    run = root / "run"
    train([ENV, "--iterations", "1", "--rollout.num-envs", "2", "--rollout.fragment-length", "8",
           "--policy-mapping", *mapping, "--run-dir", str(run), "--no-progress"])
    weights, _, state = load_checkpoint(run / "checkpoints")
    written = export(str(run / "checkpoints"), out=str(root / "exported"))
    return weights, state, written, json.loads((root / "exported" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def p1_run(tmp_path_factory):
    """player_1 -> a separately learned policy ``p1``; player_0 stays on the group policy ``player``."""
    root = tmp_path_factory.mktemp("p1")
    return (root, *_train_and_export(root, "player_1", "p1"))


def _inputs(program_entry: dict, batch: int, generator: torch.Generator) -> tuple[list, dict]:
    """Random inputs built from the manifest's documented names, dtypes and shapes only."""
    args, kwargs = [], {}
    for spec in program_entry["inputs"]:
        shape = [batch if d == "batch" else d for d in spec["shape"]]
        dtype = getattr(torch, spec["dtype"])
        if dtype == torch.bool:  # an action mask: random legal sets, never empty
            value = torch.rand(shape, generator=generator) < 0.4
            value[..., -1] |= ~value.any(-1)
        elif dtype.is_floating_point:
            value = torch.randn(shape, generator=generator, dtype=dtype)
        else:  # connect four's int8 board planes in {0, 1}
            value = torch.randint(0, 2, shape, generator=generator).to(dtype)
        if spec["kind"] == "positional":
            assert spec["position"] == len(args)
            args.append(value)
        elif not spec["path"]:
            kwargs[spec["keyword"]] = value
        else:  # a place inside one nested keyword argument (a structured action's masks)
            place = kwargs.setdefault(spec["keyword"], {})
            for key in spec["path"][:-1]:
                place = place.setdefault(key, {})
            place[spec["path"][-1]] = value
    return args, kwargs


def _checkpoint_policy(state: dict, weights: dict, pid: str, group: str = "player"):
    """The checkpoint's policy ``pid`` as the trainer builds it: its group's architecture, its own weights."""
    policy = copy.deepcopy(make_policies(from_json(state["tree"]), load_config(state).policy)[group])
    policy.load_state_dict({k.split("/", 1)[1]: v for k, v in weights.items() if k.startswith(f"{pid}/")})
    return policy.eval()


def test_every_checkpoint_policy_is_exported_and_every_agent_mapped_to_its_own(p1_run):
    root, weights, state, written, manifest = p1_run
    pids = {k.split("/", 1)[0] for k in weights}
    assert pids == set(state["learners"]) == set(manifest["policies"]) == {"player", "p1"}
    assert sorted(written) == sorted(str(root / "exported" / f"{pid}.pt2") for pid in pids)
    assert manifest["agents"] == {
        "player_0": {"policy": "player", "file": "player.pt2", "group": "player", "slot": 0},
        "player_1": {"policy": "p1", "file": "p1.pt2", "group": "player", "slot": 1},
    }
    for pid, agent in (("player", "player_0"), ("p1", "player_1")):
        entry = manifest["policies"][pid]
        assert entry["file"] == f"{pid}.pt2" and entry["agents"] == [agent] and entry["fixed"] is False
        assert entry["version"] == state["learners"][pid]["version"]
        assert entry["observation_keys"] == [OBSERVATION] and entry["action_keys"] == [ACTION]  # leaf paths, not ""
        program = manifest["programs"][entry["file"]]
        assert program["policy"] == pid and program["group"] == "player" and program["capacity"] == 2
        assert program["agents"] == {agent: manifest["agents"][agent]["slot"]}
        # every input: [batch, agents, ...obs] observation, then the group's action mask
        assert program["inputs"] == [
            {"name": OBSERVATION, "kind": "positional", "position": 0, "dtype": "int8", "shape": ["batch", 2, *OBS_SHAPE]},
            {"name": ACTION_MASK, "kind": "keyword", "keyword": ACTION_MASK, "path": [], "required": True,
             "dtype": "bool", "shape": ["batch", 2, N_ACTIONS]},
        ]
        assert program["outputs"] == [{"name": ACTION, "dtype": "int64", "shape": ["batch", 2]}]
        assert program["returns"] == "tensor"


@pytest.mark.parametrize("batch", [1, 64])
def test_programs_run_on_manifest_inputs_and_act_like_the_checkpoint_policies(p1_run, batch):
    root, weights, state, _, manifest = p1_run
    args, kwargs = _inputs(manifest["programs"]["p1.pt2"], batch, torch.Generator().manual_seed(batch))
    assert _inputs(manifest["programs"]["player.pt2"], batch, torch.Generator().manual_seed(batch))[0][0].equal(args[0])
    actions = {}
    for pid in ("player", "p1"):
        entry = manifest["programs"][manifest["policies"][pid]["file"]]
        program = torch.export.load(str(root / "exported" / manifest["policies"][pid]["file"])).module()
        with torch.no_grad():
            out = program(*args, **kwargs)
        (spec,) = entry["outputs"]
        assert out.dtype == getattr(torch, spec["dtype"])
        assert list(out.shape) == [batch if d == "batch" else d for d in spec["shape"]]
        assert kwargs[ACTION_MASK].gather(-1, out.unsqueeze(-1)).all()  # legal actions only
        # the checkpoint's policy, acting deterministically on the same observations, agrees on every slot
        step = TensorDict({OBSERVATION: args[0], ACTION_MASK: kwargs[ACTION_MASK],
                           MASK: torch.ones(batch, 2, dtype=torch.bool)}, batch_size=[batch, 2])
        expected = _checkpoint_policy(state, weights, pid).act(step, deterministic=True)[ACTION]
        assert torch.equal(out, expected)
        actions[pid] = out
    if batch > 1:  # different weights: p1's program is not the group policy's
        assert not torch.equal(actions["p1"], actions["player"])
        slot = manifest["agents"]["player_1"]["slot"]
        assert not torch.equal(actions["p1"][:, slot], actions["player"][:, slot])


def test_fixed_random_policy_is_exported_and_marked_fixed(tmp_path):
    _, state, written, manifest = _train_and_export(tmp_path, "player_1", "random")
    assert set(manifest["policies"]) == set(state["learners"]) == {"player", "random"}
    assert manifest["policies"]["random"]["fixed"] is True and manifest["policies"]["player"]["fixed"] is False
    assert manifest["agents"]["player_1"] == {"policy": "random", "file": "random.pt2", "group": "player", "slot": 1}
    args, kwargs = _inputs(manifest["programs"]["random.pt2"], 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = torch.export.load(str(tmp_path / "exported" / "random.pt2")).module()(*args, **kwargs)
    # uniform logits: the deterministic program gives the mode, the first legal action (documented)
    assert torch.equal(out, kwargs[ACTION_MASK].int().argmax(-1))


@pytest.mark.parametrize("case", ["masked_discrete", "composite_tanh", "recurrent_binary"])
def test_signature_documents_dict_observations_tuple_actions_and_recurrent_state(case, tmp_path):
    """Leaf paths name dict observations and actions; the program takes and returns what is documented."""
    from core.policies import export_policy
    from core.policies.export import deployment_signature
    from tests.core.test_export import CASES, _step

    tree, config = CASES[case]
    policy = make_policies(tree, config)["agents"]
    signature = deployment_signature(policy, _step(tree, 2, seed=0))
    torch.export.save(export_policy(policy, _step(tree, 2, seed=0)), str(tmp_path / "p.pt2"))
    args, kwargs = _inputs(signature, 5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = torch.export.load(str(tmp_path / "p.pt2")).module()(*args, **kwargs)
    outs = list(out) if signature["returns"] == "tuple" else [out]
    assert [(str(o.dtype), list(o.shape)) for o in outs] == [
        ("torch." + s["dtype"], [5 if d == "batch" else d for d in s["shape"]]) for s in signature["outputs"]]
    names = {"masked_discrete": (["observation/pos", "observation/kind", "action_mask"], ["action"]),
             "composite_tanh": (["observation"], ["action/move", "action/aim"]),
             "recurrent_binary": (["observation", "recurrent_state"], ["action", "recurrent_state"])}[case]
    assert ([s["name"] for s in signature["inputs"]], [s["name"] for s in signature["outputs"]]) == names


def test_a_structured_actions_masks_are_documented_as_places_in_one_keyword(tmp_path):
    """builtin:pick's two-stage action takes its masks as one nested ``action_mask`` dict: the manifest names
    each mask's keyword and path (it listed ``action_mask/node`` and the like as keywords the program refused)."""
    from adapters.builtin import pick_tree
    from core.policies import PolicyConfig, export_policy
    from core.policies.export import deployment_signature
    from core.specs import rand

    tree = pick_tree()
    policy = make_policies(tree, PolicyConfig())["agent"]
    example = rand(tree, (2,), torch.Generator().manual_seed(0)).get("agent")
    signature = deployment_signature(policy, example)
    masks = [s for s in signature["inputs"] if s["kind"] == "keyword"]
    assert masks and all(s["keyword"] == ACTION_MASK and s["name"] == "/".join((ACTION_MASK, *s["path"]))
                         for s in masks), masks
    torch.export.save(export_policy(policy, example), str(tmp_path / "p.pt2"))
    args, kwargs = _inputs(signature, 3, torch.Generator().manual_seed(0))
    for s in masks:  # all True allows every action (the layout's rule), whatever the random draw made
        place = kwargs[ACTION_MASK]
        for key in s["path"][:-1]:
            place = place[key]
        place[s["path"][-1]] = torch.ones_like(place[s["path"][-1]])
    with torch.no_grad():
        torch.export.load(str(tmp_path / "p.pt2")).module()(*args, **kwargs)
