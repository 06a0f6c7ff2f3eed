"""Simulators that act with their own copies of the policies (local policies) and upload what happened: what
the server records of the uploads, and asynchronous PPO learning from them off-policy."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.external.client import ExternalError, SimulatorClient
from orchestration.config import ExternalConfig, RolloutConfig, TrainConfig
from tests.orchestration.test_external_server import MEASURED_WITH, OBS, SIM, TREE, _wait, served  # noqa: F401


def test_a_simulator_acting_with_its_own_policy_uploads_what_a_server_would_have_recorded(served):
    """LocalPolicy: the policy fetched as arrays acts here; the uploaded steps become fragments whose actions,
    behaviour log-probabilities and version label are what the local copy produced."""
    import external_sim
    import torch

    from adapters.external.local_policy import LocalPolicy
    from core.layout import ACTION, LOG_PROB, MASK, OBSERVATION

    server, lanes, out = served
    read = []  # the counters as a fragment is delivered: in the middle of an upload of 5 steps (T=4)
    lanes.deliver = lambda *item: (read.append((server.counters["uploaded_steps"], lanes.counters["steps_recorded"])),
                                   out.append(item))
    with SimulatorClient(server.url, "secret", TREE, "robot") as client:
        local = LocalPolicy(client, TREE, seed=3, upload_every=5)
        assert local.versions == {"agents": 0}
        rng = np.random.default_rng(0)
        for k in range(3):
            external_sim.run_episode(local, f"r{k}", rng)
        with pytest.raises(ExternalError, match="outside its discrete space"):
            client.upload("bad", {"agents": 0}, [{"agents": {"agents_0": {"observation": OBS, "action": 7,
                                                                          "log_prob": -1.0}}}])
        step = [{"agents": {"agents_0": {"observation": OBS, "action": 1, "log_prob": -1.0}}}]
        # a version the server never published would pass any staleness rule: refused, naming what was published
        with pytest.raises(ExternalError, match=r"group 'agents' acted with version 999.*versions 0 to 0"):
            client.upload("future", {"agents": 999}, step)
        with pytest.raises(ExternalError, match=r"version -5.*never published"):
            client.upload("past", {"agents": -5}, step)
        with pytest.raises(ExternalError, match=r"no steps, and no such episode is running") as error:
            client.upload("never", {"agents": 0}, [], end={"outcome": "terminated"})  # accepted, as 0 steps
        assert error.value.code == "unknown_episode" and not error.value.fatal  # as a plain end for it is
        with pytest.raises(ExternalError, match=r"log_prob 5.0 is above 0.*discrete"):
            client.upload("certain", {"agents": 0}, [{"agents": {"agents_0": {"observation": OBS, "action": 1,
                                                                              "log_prob": 5.0}}}])
        # the steps before a refused one are kept (docs/external-protocol.md), so they count as uploaded: the
        # first two recorded, the third, whose consequences never came, lost
        with pytest.raises(ExternalError, match="outside its discrete space"):
            client.upload("partly", {"agents": 0}, [*step * 3, {"agents": {"agents_0": {
                "observation": OBS, "action": 7, "log_prob": -1.0}}}])
    _wait(lambda: lanes.counters["episodes_completed"] == 3)
    c = lanes.counters
    assert c["steps_lost"] == 1 and server.counters["uploaded_steps"] == c["steps_recorded"] + 1 >= 3
    assert read and all(uploaded >= recorded for uploaded, recorded in read), read
    assert out  # fragments of T=4 steps
    policy = local.policies["agents"]
    for fragment, meta, _ in out:
        assert meta["policy_versions"] == {"agents": 0}
        g = fragment["agents"]
        with torch.no_grad():
            recomputed = policy.evaluate_terms({OBSERVATION: g[OBSERVATION], MASK: g[MASK], ACTION: g[ACTION]})[LOG_PROB]
        present = g[MASK]
        torch.testing.assert_close(g[LOG_PROB][present], recomputed[present])


@pytest.mark.slow
def test_simulators_with_local_policies_learn_off_policy(tmp_path):
    """Launched simulators that act with their own policy copies (refreshed every 2 episodes) upload their
    steps; asynchronous PPO learns from them through the staleness rule and the recorded log-probabilities."""
    from orchestration.builder import build_trainer

    from orchestration.config import RayConfig

    config = TrainConfig(env="external", iterations=12, seed=0, mode="async", max_staleness=3, **MEASURED_WITH,
                         ray=RayConfig(iteration_timeout_s=120),  # fail fast if the uploads stopped being trainable
                         rollout=RolloutConfig(num_envs=1, fragment_length=16), train_batch_size=512,
                         external=ExternalConfig(command=SIM + " --local-policy 2", instances=2, start_timeout_s=60))
    trainer = build_trainer(config)
    returns = []
    try:
        for _ in range(config.iterations):
            metrics = trainer.train()
            returns.append(metrics["episode_return_mean"])
    finally:
        trainer.close()
    assert metrics["env/external_uploaded_steps"] > 0 and metrics["env/external_requests"] == 0
    assert returns[-1] > returns[0] + 5, returns  # 12 iterations: 8 were enough alone, not always under load


def test_the_welcome_tells_the_versions_the_next_batch_acts_with_as_get_policy_does():
    """A resumed run stages its restored weights before any batch ran: the welcome said version 0 (what the
    service had acted with) while get_policy said 30, until the first batch."""
    import io
    import json

    from adapters.external.codec import TreeCodec
    from core.policies import PolicyConfig, make_policies
    from core.specs import from_json
    from orchestration.assignment import assign
    from orchestration.external_episodes import Lanes
    from orchestration.external_server import ExternalServer
    from orchestration.inference import InferenceService
    from tensordict import TensorDict

    tree = from_json(json.dumps(TREE))
    policy = make_policies(tree, PolicyConfig())["agents"]
    service = InferenceService({"agents": policy}).start()
    service.set_weights("agents", 30, TensorDict.from_module(policy).detach().clone(), force=True)  # as restored
    server = ExternalServer(ExternalConfig(token="secret"), tree, log=io.StringIO()).start()
    server.attach(service, Lanes(TreeCodec(tree), assign(tree, {}), 4, lambda *item: None))
    try:
        with SimulatorClient(server.url, "secret", TREE, "robot") as client:
            assert client.welcome["policy_versions"] == {"agents": 30}
            assert client.get_policy()["agents"]["version"] == 30
    finally:
        server.close()
        service.close()
