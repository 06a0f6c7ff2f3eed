"""Image leaves get a CNN (Nature, IMPALA), chosen from the tree: shapes, uint8 scaling, gradients, export."""

from __future__ import annotations

import pytest
import torch

from core.policies import PolicyConfig, make_policies
from core.policies.export import export_policy
from core.policies.networks import ImageEncoder, image_layout
from core.specs import AgentNode, ArrayPopulation, Leaf, rand


def _tree(shape, dtype=torch.uint8, agents=2):
    high = 255 if dtype == torch.uint8 else 1.0
    observation = Leaf.box(shape, low=0, high=high, dtype=dtype)
    return ArrayPopulation(template=AgentNode(observation=observation, action=Leaf.discrete(4)), capacity=agents)


@pytest.mark.parametrize("shape, layout", [((40, 40, 3), "hwc"), ((3, 40, 40), "chw"), ((84, 84, 1), "hwc"),
                                           ((12, 12, 4), "hwc"), ((4, 3, 3), None), ((40, 40), None),
                                           ((5, 40, 40), None), ((40, 40, 7), None)])
def test_image_leaves_are_recognised_by_shape(shape, layout):
    assert image_layout(Leaf.box(shape, dtype=torch.uint8)) == layout


@pytest.mark.parametrize("shape, encoder", [((40, 40, 3), "nature"), ((3, 12, 12), "nature"),
                                            ((16, 16, 3), "impala")])
def test_a_policy_on_images_acts_trains_and_exports(shape, encoder):
    tree = _tree(shape)
    (policy,) = make_policies(tree, PolicyConfig(image_encoder=encoder, image_features=32)).values()
    assert isinstance(policy.actor_encoder.images["0"], ImageEncoder) and policy.actor_encoder.out_features == 32
    assert policy.critic_encoder is None  # the critic reads the same leaves: it shares the CNN trunk
    group = rand(tree, (5,), torch.Generator().manual_seed(0)).get("agents")
    assert group.get("observation").dtype == torch.uint8  # images stay bytes until the encoder
    out = policy.act_step(group.select("observation"), None, torch.Generator().manual_seed(1), False)
    assert out["action"].shape == (5, 2)
    batch = group.select("observation").clone()
    batch.set("action", out["action"])
    terms = policy.evaluate_terms(batch)
    (terms["log_prob"].sum() + terms["state_value"].sum()).backward()
    conv = next(policy.actor_encoder.images["0"].convs.parameters())
    assert conv.grad is not None and conv.grad.abs().sum() > 0
    program = export_policy(policy.eval(), group.select("observation"))
    exported = program.module()(group.get("observation"))
    expected = policy.act_step(group.select("observation"), None, None, True)["action"]
    assert torch.equal(exported, expected)


def test_uint8_images_are_scaled_to_unit_range_inside_the_encoder():
    torch.manual_seed(0)
    as_bytes = ImageEncoder(Leaf.box((12, 12, 3), low=0, high=255, dtype=torch.uint8), "hwc", out_features=8)
    as_floats = ImageEncoder(Leaf.box((12, 12, 3), low=0, high=1), "hwc", out_features=8)
    as_floats.load_state_dict(as_bytes.state_dict())
    pixels = torch.randint(0, 256, (2, 3, 12, 12, 3), dtype=torch.uint8)
    torch.testing.assert_close(as_bytes(pixels), as_floats(pixels.float() / 255.0))
    assert as_bytes(pixels).shape == (2, 3, 8)


def test_flatten_keeps_every_pixel_an_mlp_input():
    (policy,) = make_policies(_tree((40, 40, 3)), PolicyConfig(image_encoder="flatten")).values()
    assert not policy.actor_encoder.images and policy.actor_encoder.out_features == 40 * 40 * 3
    (cnn,) = make_policies(_tree((40, 40, 3)), PolicyConfig()).values()
    assert sum(p.numel() for p in cnn.parameters()) < sum(p.numel() for p in policy.parameters())


def test_encoders_are_overridden_per_leaf_and_bad_overrides_are_named():
    from core.specs import DictNode

    obs = DictNode({"camera": Leaf.box((16, 16, 3), low=0, high=255, dtype=torch.uint8),
                    "depth": Leaf.box((1, 12, 12), low=0, high=255, dtype=torch.uint8),
                    "speed": Leaf.box((2,))})
    tree = ArrayPopulation(template=AgentNode(observation=obs, action=Leaf.discrete(3)), capacity=1)
    config = PolicyConfig(image_features=16, leaf_encoders=(("observation/camera", "impala"),
                                                            ("observation/depth", "flatten")))
    (policy,) = make_policies(tree, config).values()
    encoder = policy.actor_encoder
    assert list(encoder.images) == ["0"] and any(isinstance(m, torch.nn.MaxPool2d) for m in encoder.images["0"].modules())
    assert encoder.out_features == 16 + 12 * 12 + 2  # camera: IMPALA CNN; depth: flattened pixels; speed as is
    (default,) = make_policies(tree, PolicyConfig(image_features=16)).values()
    assert sorted(default.actor_encoder.images) == ["0", "1"]  # without overrides both images get the Nature CNN
    with pytest.raises(ValueError, match="did you mean 'observation/camera'"):
        make_policies(tree, PolicyConfig(leaf_encoders=(("observation/camra", "impala"),)))
    with pytest.raises(ValueError, match="observation/speed the 'nature' CNN, but it is not an image"):
        make_policies(tree, PolicyConfig(leaf_encoders=(("observation/speed", "nature"),)))
    with pytest.raises(ValueError, match="leaf_encoders"):
        PolicyConfig(leaf_encoders=(("observation/camera", "resnet"),))
