"""The built-in image task Spot: protocol outputs, the quadrant rule, exact resume, the env id."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from adapters.builtin import Spot, SpotConfig
from adapters.protocol import BatchedEnv
from core.layout import ACTION, DONE, NEXT, OBSERVATION, REWARD, TERMINATED
from core.policies.networks import image_layout
from core.specs import iter_leaves, validate


def _act(action: torch.Tensor) -> TensorDict:
    return TensorDict({"agent": TensorDict({ACTION: action.view(-1, 1)}, [action.shape[0], 1])}, [action.shape[0]])


def _quadrant(image: torch.Tensor) -> torch.Tensor:
    """The answer read off the pixels: the quadrant of the (only) 255 pixel of channel 0."""
    n, _, s, _ = image.shape
    cell = (image[:, 0].reshape(n, -1) == 255).int().argmax(1)
    return 2 * (cell // s >= s // 2).long() + (cell % s >= s // 2).long()


def test_spot_steps_validate_and_reward_exactly_the_quadrant_of_the_bright_pixel():
    env = Spot(SpotConfig(num_envs=32, channels=3, noise=100, episode_length=2))
    assert isinstance(env, BatchedEnv)
    ((_, leaf),) = list(iter_leaves(env.tree.observation))
    assert leaf.dtype == torch.uint8 and image_layout(leaf) == "chw"  # policies give it a CNN
    obs = env.reset(seed=0)
    validate(obs, env.tree)
    hits = 0
    for t in range(4):
        image = obs.get(("agent", OBSERVATION)).squeeze(1)
        assert torch.equal(_quadrant(image), env.target) and int((image == 255).all(1).sum()) == 32  # one spot each
        guess = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(t))
        out = env.step(_act(guess))
        validate(out, env.tree)
        nxt = out.get((NEXT, "agent"))
        assert torch.equal(nxt.get(OBSERVATION).squeeze(1), image)  # the image the answer was about
        assert torch.equal(nxt.get(REWARD).view(-1), (guess == _quadrant(image)).float())
        assert bool(out.get((NEXT, TERMINATED)).all()) == (t % 2 == 1) and torch.equal(out.get((NEXT, DONE)),
                                                                                          out.get((NEXT, TERMINATED)))
        hits += int(nxt.get(REWARD).sum())
        obs = out
    assert 0 < hits < 4 * 32  # random guesses are right about a quarter of the time


def test_spot_resumes_exactly_from_its_state_dict():
    a, b = Spot(SpotConfig(num_envs=8)), Spot(SpotConfig(num_envs=8))
    a.reset(seed=3)
    a.step(_act(torch.zeros(8, dtype=torch.long)))
    b.reset(seed=99)
    b.load_state_dict(a.state_dict())
    action = _act(torch.arange(8) % 4)
    assert (a.step(action) == b.step(action)).all()


def test_spot_is_a_builtin_env_id():
    from orchestration.envs import imports_code, make_env

    env = make_env("builtin:spot", 4, kwargs={"size": 16})
    assert isinstance(env, Spot) and env.image.shape == (4, 1, 16, 16) and imports_code("builtin:spot") is None
