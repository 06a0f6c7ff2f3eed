"""A shared inference service's version only rises: a rollout worker that is behind never turns it back, so a
fragment's label (the version its actor was handed) never names a newer version than the one that acted."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import POLICY_VERSION
from orchestration.inference import InferenceConfig, InferenceService
from orchestration.service_policy import ServicePolicy
from tests.orchestration.test_inference import _constant_weights, _obs, _policies

TIMEOUT = 120.0


class _WorkerView:
    """A worker's handle on a shared service, as :class:`orchestration.ray_fleet.RemoteService` is: it knows only
    the versions it sent itself."""

    def __init__(self, service: InferenceService) -> None:
        self.service, self._sent = service, {}

    @property
    def versions(self) -> dict[str, int]:
        return dict(self._sent)

    def act(self, policy_id, obs, **kwargs):
        return self.service.act(policy_id, obs, **kwargs)

    def set_weights(self, policy_id: str, version: int, weights: TensorDict, force: bool = False) -> None:
        self.service.set_weights(policy_id, version, weights, force)
        self._sent[policy_id] = version


def _acting(service: InferenceService) -> tuple[int, int]:
    """``(version, mode action)`` the service acts with now."""
    got = service.act("cartpole", _obs("cartpole", 1, 0, with_action_mask=False), timeout_s=TIMEOUT,
                      deterministic=True)
    return got.version, int(got.action.flatten()[0])


def test_a_worker_that_is_behind_does_not_turn_a_shared_service_back():
    """The audit's race: worker A hands over version 5, then worker B, not yet told of 5, hands over 4. The
    service used to act with 4 while A labelled its fragment 5, so a learner at 6 with max_staleness 1 trained
    data two versions old. Now 4 is ignored; a forced load (a restored learner) still goes through."""
    service = InferenceService(_policies(), InferenceConfig(max_wait_s=0.0, device="cpu"))
    like = _policies()["cartpole"]
    a = ServicePolicy("cartpole", _WorkerView(service), like)
    b = ServicePolicy("cartpole", _WorkerView(service), like)
    with service:
        a.load_weights_(5, _constant_weights(1))
        b.load_weights_(4, _constant_weights(0))
        assert _acting(service) == (5, 1)
        b.load_weights_(5, _constant_weights(0))  # the same version again: not a newer one either
        assert _acting(service) == (5, 1)
        b.load_weights_(4, _constant_weights(0), force=True)  # a restored learner republishes its version
        assert _acting(service) == (4, 0)
        a.load_weights_(6, _constant_weights(1))
        assert _acting(service) == (6, 1)


@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=12))
def test_the_staged_version_is_the_newest_handed_over_since_the_last_forced_one(handed):
    """Any order of hand-overs, some forced: what the next batch acts with is the last forced version, or a newer
    one handed over after it (the initial weights are version 0)."""
    service = InferenceService(_policies(), InferenceConfig(device="cpu"))
    weights = TensorDict.from_module(_policies()["cartpole"]).detach().clone()
    expected = 0
    for version, force in handed:
        service.set_weights("cartpole", version, weights, force)
        expected = version if force or version > expected else expected
    assert service.latest("cartpole", weights=False)[0] == expected
    service.close()
    torch.testing.assert_close(service.latest("cartpole")[1]["actor_out", "bias"], weights["actor_out", "bias"])


def test_a_re_created_rollout_worker_does_not_turn_the_shared_service_back_with_its_starting_weights():
    """The review's race: a worker re-created from the weights of its restart (v4) starts while the others have
    handed the service v5 (asynchronous: the learner moved on). Its first load was forced, turning it back."""
    from orchestration.builder import assignment_for, policy_module
    from orchestration.config import RolloutConfig, TrainConfig
    from orchestration.envs import make_env
    from orchestration.sampler import Sampler

    config = TrainConfig(env="builtin:cartpole", seed=0, mode="async",
                         rollout=RolloutConfig(num_envs=2, fragment_length=8, num_workers=2, central_inference=True))
    env = make_env("builtin:cartpole", 1)
    policy = policy_module(config, env.tree, assignment_for(config, env.tree), "agent")
    env.close()
    service = InferenceService({"agent": policy}, InferenceConfig(device="cpu")).start()
    service.set_weights("agent", 5, TensorDict.from_module(policy).detach().clone())
    weights = TensorDict.from_module(policy).detach().clone()
    Sampler(config, 1, 1, {"agent": (4, [weights])}, fetch=lambda ref: ref, queue_size=2, threads=1, service=service)
    assert service.latest("agent", weights=False)[0] == 5
    service.close()


def test_a_fragment_acted_through_a_shared_service_is_labelled_with_the_oldest_version_that_answered_it():
    """The actor was handed 4 while the service (shared) acts with 5: its fragments were labelled 4, so fresh data
    counted a version staler than it was (the audit: 25 of 40 fragments). Now the label is the oldest version
    that answered the fragment's steps: 5, and after a swap to 6 mid-fragment still 5, then 6."""
    from orchestration.actor import Actor
    from orchestration.assignment import assign
    from orchestration.envs import make_env

    env = make_env("builtin:cartpole", 2)
    policy = _policies()["cartpole"]
    service = InferenceService({"agent": policy}, InferenceConfig(max_wait_s=0.0, device="cpu")).start()
    weights = TensorDict.from_module(policy).detach().clone()
    service.set_weights("agent", 5, weights)
    actor = Actor(env, {"agent": ServicePolicy("agent", service, policy)}, assign(env.tree), fragment_length=4, seed=0)
    actor.set_weights("agent", 4, weights)  # handed 4: the service keeps acting with 5
    labels = []
    for swap_after in (2, None, None):
        for t in range(4):
            actor.step()
            if t == swap_after:
                service.set_weights("agent", 6, weights)
        labels.append(int(actor.build_fragment().get((POLICY_VERSION, "agent")).min()))
    service.close()
    env.close()
    assert labels == [5, 6, 6] and actor.versions["agent"] == 4
