"""InferenceService: concurrent callers get their own actions, batches form up to the size or the wait,
weights swap between batches only, expired requests are dropped without holding up others.

Real policies (``make_policies`` on the built-in CartPole, one agent, and Spread, four agents) built with a
large ``actor_output_gain``: logits far apart, so a batched forward and a lone one cannot pick different
modes through rounding. Nothing here asserts on time; batches are counted through ``stats()`` and each
result's ``batch`` index.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE
from core.policies import GroupPolicy, PolicyConfig, make_policies
from orchestration.envs import make_env
from orchestration.inference import InferenceConfig, InferenceService, RequestExpired, ServiceClosed

#: policy id -> (env, group)
ENVS = {"cartpole": ("builtin:cartpole", "agent"), "spread": ("builtin:spread", "agents")}
TIMEOUT = 120.0  # deadlines the tests do not mean to hit, even on a loaded machine


@functools.cache
def _policies(recurrent: bool = False) -> dict[str, GroupPolicy]:
    torch.manual_seed(0)
    config = PolicyConfig(actor_output_gain=1.0, recurrent=recurrent)
    out = {}
    for pid, (name, group) in ENVS.items():
        env = make_env(name, 1)
        out[pid] = make_policies(env.tree, config)[group]
        env.close()
    return out


def _obs(pid: str, rows: int, seed: int, with_action_mask: bool = True, with_mask: bool = False) -> dict:
    """A request ``{"observation": [rows, A, F], "action_mask"?: [rows, A, k] (>= 1 legal), "mask"?}``."""
    policy = _policies()[pid]
    g = torch.Generator().manual_seed(seed)
    a, f = policy.num_agents, policy.actor_encoder.out_features
    k = policy.heads.num_params
    obs = {OBSERVATION: 2 * torch.randn(rows, a, f, generator=g)}
    if with_action_mask:
        legal = torch.rand(rows, a, k, generator=g) < 0.5
        legal.scatter_(-1, torch.randint(k, (rows, a, 1), generator=g), True)
        obs[ACTION_MASK] = legal
    if with_mask:
        obs[MASK] = torch.ones(rows, a, dtype=torch.bool)
    return obs


def _direct(pid: str, obs: dict) -> dict:
    """The reference: this caller's observation alone, one deterministic forward of the same module."""
    return _policies()[pid].act_step(obs, deterministic=True, with_value=False)


def _threads(targets: list) -> None:
    """Runs each callable in its own thread, released together; re-raises the first error."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def run(fn):
        barrier.wait()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a caller thread hung"
    if errors:
        raise errors[0]


# -- (a) no mix-up ---------------------------------------------------------------------------------------
caller = st.tuples(st.sampled_from(sorted(ENVS)), st.integers(1, 9), st.booleans(), st.booleans(), st.booleans())


@given(callers=st.lists(caller, min_size=1, max_size=10), rounds=st.integers(1, 3), max_rows=st.integers(9, 40),
       seed=st.integers(0, 2**20))
def test_concurrent_callers_get_exactly_their_own_actions(callers, rounds, max_rows, seed):
    """Callers (threads) with random policies, row counts and masks, some sampling: a deterministic caller
    gets what a direct forward of its own observation gives; a sampling one gets actions legal under its own
    mask, with the log-probability its own observation gives them; no batch exceeds ``max_batch_rows``."""
    results: dict[tuple[int, int], tuple] = {}
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=max_rows, max_wait_s=0.002, device="cpu"))

    def call(i, pid, rows, with_action_mask, with_mask, deterministic):
        def run():
            for r in range(rounds):
                obs = _obs(pid, rows, seed + 1000 * i + r, with_action_mask, with_mask)
                results[i, r] = obs, service.act(pid, obs, timeout_s=TIMEOUT, deterministic=deterministic)
        return run

    with service:
        _threads([call(i, *c) for i, c in enumerate(callers)])

    rows_per_batch: dict[int, int] = {}
    for (i, r), (obs, got) in results.items():
        pid, rows, _, _, deterministic = callers[i]
        policy = _policies()[pid]
        assert got.action.shape == (rows, policy.num_agents) and got.log_prob.shape == (rows, policy.num_agents, 1)
        if deterministic:
            want = _direct(pid, obs)
            assert torch.equal(got.action, want[ACTION]), (i, r)
            torch.testing.assert_close(got.log_prob, want[LOG_PROB])
        else:
            if ACTION_MASK in obs:
                assert obs[ACTION_MASK].gather(-1, got.action.unsqueeze(-1)).all(), (i, r)
            with torch.no_grad():
                own = policy.evaluate_terms({**obs, ACTION: got.action})[LOG_PROB]
            torch.testing.assert_close(got.log_prob, own)
        assert got.version == 0
        rows_per_batch[got.batch] = rows_per_batch.get(got.batch, 0) + rows
    stats = service.stats()
    assert max(rows_per_batch.values()) <= max_rows and stats["max_rows"] <= max_rows
    assert stats["served"] == len(callers) * rounds and stats["dropped"] == stats["failed"] == 0
    assert stats["batches"] == len(rows_per_batch)


def test_one_batch_of_both_policies_and_mixed_masks_answers_each_caller_alone():
    """Requests of two policies, with and without action masks and presence masks, queued together: one
    batch, one forward per policy (the missing masks filled in), each caller its own direct-forward result."""
    asks = [("spread", _obs("spread", 3, 0)), ("cartpole", _obs("cartpole", 2, 1, with_mask=True)),
            ("spread", _obs("spread", 1, 2, with_action_mask=False, with_mask=True)),
            ("cartpole", _obs("cartpole", 5, 3, with_action_mask=False)), ("spread", _obs("spread", 4, 4))]
    service = InferenceService(_policies(), InferenceConfig(device="cpu"))
    futures = [service.submit(pid, obs, deterministic=True, timeout_s=TIMEOUT) for pid, obs in asks]
    with service:
        results = [f.result(TIMEOUT) for f in futures]
    for (pid, obs), got in zip(asks, results):
        want = _direct(pid, obs)
        assert got.batch == 0 and torch.equal(got.action, want[ACTION])
        torch.testing.assert_close(got.log_prob, want[LOG_PROB])
    assert (service.stats()["batches"], service.stats()["forwards"]) == (1, 2)


# -- (b) batches: up to the size, or the wait ---------------------------------------------------------------
@given(rows=st.lists(st.integers(1, 8), min_size=1, max_size=20), max_rows=st.integers(8, 24))
def test_queued_requests_pack_into_batches_of_at_most_max_rows(rows, max_rows):
    """Requests queued before the service starts are taken in arrival order, as many as fit: the batches
    are exactly the greedy packing of the row counts, none above ``max_batch_rows``."""
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=max_rows, max_wait_s=0.0, device="cpu"))
    futures = [service.submit("spread", _obs("spread", n, i), timeout_s=TIMEOUT) for i, n in enumerate(rows)]
    with service:
        got = [f.result(TIMEOUT).batch for f in futures]
    expected, batch, filled = [], 0, 0
    for n in rows:
        if filled + n > max_rows:
            batch, filled = batch + 1, 0
        expected.append(batch)
        filled += n
    assert got == expected
    stats = service.stats()
    assert stats["batches"] == batch + 1 and stats["max_rows"] <= max_rows and stats["forwards"] == batch + 1


def test_a_lone_request_is_served_after_at_most_the_wait():
    """After a large batch the service waits (``max_wait_s``) for company, but never for more than that: a
    lone request that nobody joins is served in a batch of its own."""
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=64, max_wait_s=0.05, device="cpu"))
    futures = [service.submit("cartpole", _obs("cartpole", 4, i), timeout_s=TIMEOUT) for i in range(8)]
    with service:
        assert {f.result(TIMEOUT).batch for f in futures} == {0}
        lone = service.act("cartpole", _obs("cartpole", 1, 99), timeout_s=TIMEOUT)
        stats = service.stats()
    assert lone.batch == 1 and stats["batches"] == 2 and stats["served"] == 9


def test_requests_beyond_max_batch_rows_and_malformed_ones_are_refused_by_name():
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=4, device="cpu"))
    with pytest.raises(ValueError, match="'spread'.*5 rows"):
        service.submit("spread", _obs("spread", 5, 0))
    with pytest.raises(KeyError, match="'nope'"):
        service.submit("nope", _obs("spread", 1, 0))
    with pytest.raises(ValueError, match="'cartpole'.*observation has shape \\(2, 4, 15\\)"):
        service.submit("cartpole", _obs("spread", 2, 0, with_action_mask=False))
    with pytest.raises(ValueError, match="'spread'.*action_mask"):
        service.submit("spread", {**_obs("spread", 2, 0), ACTION_MASK: torch.ones(3, 4, 5, dtype=torch.bool)})
    with pytest.raises(ValueError, match="'spread'.*unknown request entries \\['obs'\\]"):
        service.submit("spread", {**_obs("spread", 2, 0), "obs": torch.zeros(2)})
    with pytest.raises(ValueError, match="'spread' is not recurrent"):
        service.submit("spread", _obs("spread", 2, 0), recurrent_state=torch.zeros(2, 4, 64))
    with pytest.raises(ValueError, match="'spread'.*every request has a deadline"):
        service.submit("spread", _obs("spread", 2, 0), timeout_s=None)
    service.close()


# -- (c) weights swap between batches only -------------------------------------------------------------------
def _constant_weights(action: int) -> TensorDict:
    """CartPole weights whose mode is ``action`` whatever the observation (a zero output layer plus a bias)."""
    weights = TensorDict.from_module(_policies()["cartpole"]).detach().clone()
    weights["actor_out", "weight"].zero_()
    weights["actor_out", "bias"].copy_(torch.tensor([10.0, -10.0]) if action == 0 else torch.tensor([-10.0, 10.0]))
    return weights


def test_weights_swap_between_batches_only():
    """Versions alternate between two weight sets with opposite modes while callers keep asking: every result
    carries the actions of the version it reports, and every request of one batch the same version."""
    weights = [_constant_weights(0), _constant_weights(1)]
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=16, max_wait_s=0.001, device="cpu"))
    first = service.submit("cartpole", _obs("cartpole", 3, 0, with_action_mask=False), deterministic=True)
    service.set_weights("cartpole", 1, weights[1])  # staged before any batch: the first batch uses it
    last_version, seen, done = 20, threading.Condition(), threading.Event()
    observed: list = []
    versions_seen: set[int] = set()

    def caller(i):
        def run():
            r = 0
            while not done.is_set():
                got = service.act("cartpole", _obs("cartpole", 1 + (i + r) % 3, 100 * i + r, with_action_mask=False),
                                  timeout_s=TIMEOUT, deterministic=True)
                with seen:
                    observed.append(got)
                    versions_seen.add(got.version)
                    seen.notify_all()
                r += 1
        return run

    def swapper():
        try:
            for version in range(2, last_version + 1):
                service.set_weights("cartpole", version, weights[version % 2])
                with seen:  # the next version only once a caller got this one: many versions, however slow
                    assert seen.wait_for(lambda: version in versions_seen, TIMEOUT)
        finally:
            done.set()

    with service:
        assert first.result(TIMEOUT).version == 1 and (first.result().action == 1).all()
        _threads([caller(i) for i in range(4)] + [swapper])
        stats = service.stats()
    versions_of_batch: dict[int, set[int]] = {}
    for got in observed:
        assert (got.action == got.version % 2).all(), got.version
        versions_of_batch.setdefault(got.batch, set()).add(got.version)
    assert all(len(v) == 1 for v in versions_of_batch.values())
    assert versions_seen >= set(range(2, last_version + 1))
    assert 2 <= stats["weight_swaps"] <= last_version and service.versions["cartpole"] == last_version


def test_set_weights_names_the_policy_and_entry_at_fault():
    service = InferenceService(_policies(), InferenceConfig(device="cpu"))
    bad = _constant_weights(0)
    bad["actor_out", "bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'cartpole'.*'actor_out.bias'.*\\(3,\\).*\\(2,\\)"):
        service.set_weights("cartpole", 1, bad)
    with pytest.raises(KeyError, match="'nope'"):
        service.set_weights("nope", 1, bad)
    extra = _constant_weights(0)
    extra["extra_layer"] = torch.zeros(1)
    with pytest.raises(ValueError, match="'cartpole'.*extra_layer"):
        service.set_weights("cartpole", 1, extra)
    service.close()


# -- (d) deadlines, callers that go away, failures, close ------------------------------------------------------
def test_an_expired_request_is_dropped_counted_and_blocks_nobody():
    service = InferenceService(_policies(), InferenceConfig(max_batch_rows=32, device="cpu"))
    before = service.submit("spread", _obs("spread", 2, 0), timeout_s=TIMEOUT)
    expired = service.submit("spread", _obs("spread", 2, 1), timeout_s=0.0)  # past by the time it is batched
    gone = service.submit("spread", _obs("spread", 2, 2), timeout_s=TIMEOUT)
    assert gone.cancel()  # its caller went away
    after = service.submit("spread", _obs("spread", 2, 3), timeout_s=TIMEOUT)
    with service:
        assert before.result(TIMEOUT).batch == after.result(TIMEOUT).batch == 0
        with pytest.raises(RequestExpired, match="'spread'.*expired"):
            expired.result(TIMEOUT)
        assert isinstance(expired.exception(), TimeoutError)
        with pytest.raises(CancelledError):
            gone.result()
        stats = service.stats()
    assert (stats["served"], stats["dropped"], stats["cancelled"], stats["batches"]) == (2, 1, 1, 1)


def test_a_request_that_breaks_its_batch_fails_alone():
    """A request that passes the checks but not the network (a wrong feature width) fails by itself; the
    others of its batch are served."""
    service = InferenceService(_policies(), InferenceConfig(device="cpu"))
    good = [service.submit("spread", _obs("spread", 2, i), timeout_s=TIMEOUT, deterministic=True) for i in range(2)]
    bad = service.submit("spread", {OBSERVATION: torch.zeros(2, 4, 7)}, timeout_s=TIMEOUT)
    with service:
        for i, f in enumerate(good):
            assert torch.equal(f.result(TIMEOUT).action, _direct("spread", _obs("spread", 2, i))[ACTION])
        assert bad.exception(TIMEOUT) is not None
    assert service.stats()["failed"] == 1 and service.stats()["served"] == 2


def test_close_serves_what_was_queued_then_refuses_more():
    service = InferenceService(_policies(), InferenceConfig(device="cpu")).start()
    queued = [service.submit("spread", _obs("spread", 1, i), timeout_s=TIMEOUT) for i in range(3)]
    service.close()
    assert all(f.result(TIMEOUT).action.shape == (1, 4) for f in queued)
    with pytest.raises(ServiceClosed):
        service.submit("spread", _obs("spread", 1, 0))
    never_started = InferenceService(_policies(), InferenceConfig(device="cpu"))
    orphan = never_started.submit("spread", _obs("spread", 1, 0))
    never_started.close()  # nothing will ever serve it
    with pytest.raises(ServiceClosed):
        orphan.result(TIMEOUT)


# -- recurrent policies, seeded sampling, GPU -----------------------------------------------------------------
def test_recurrent_state_travels_with_each_request():
    """Recurrent policy: callers with and without a state, some starting episodes, batched together, get the
    state used and the next state of a direct forward of their own rows."""
    policy = _policies(recurrent=True)["spread"]
    service = InferenceService({"spread": policy}, InferenceConfig(device="cpu"))
    g = torch.Generator().manual_seed(0)
    asks = [(_obs("spread", 3, 0), torch.randn(3, 4, 64, generator=g), torch.tensor([True, False, False])),
            (_obs("spread", 2, 1), None, None),
            (_obs("spread", 1, 2), torch.randn(1, 4, 64, generator=g), None)]
    futures = [service.submit("spread", o, recurrent_state=s, episode_start=e, deterministic=True, timeout_s=TIMEOUT)
               for o, s, e in asks]
    with service:
        results = [f.result(TIMEOUT) for f in futures]
    assert {r.batch for r in results} == {0}
    for (obs, state, start), got in zip(asks, results):
        want = policy.act_step(obs, None, None, True, state, start, with_value=False)
        assert torch.equal(got.action, want[ACTION])
        torch.testing.assert_close(got.recurrent_state, want[RECURRENT_STATE])
        torch.testing.assert_close(got.next_recurrent_state, want[NEXT][RECURRENT_STATE])


def test_sampling_follows_the_seeded_generator():
    """Same seed, same requests one at a time: the same sampled actions; another seed: other actions."""
    def sample(seed):
        with InferenceService(_policies(), InferenceConfig(seed=seed, device="cpu")) as service:
            return torch.cat([service.act("spread", _obs("spread", 8, i), timeout_s=TIMEOUT).action for i in range(4)])

    assert torch.equal(sample(1), sample(1)) and not torch.equal(sample(1), sample(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_callers_get_the_actions_of_a_direct_forward():
    service = InferenceService(_policies(), InferenceConfig(device="cuda"))
    asks = [("spread", _obs("spread", n, n)) for n in (1, 3, 5)] + [("cartpole", _obs("cartpole", 4, 7))]
    futures = [service.submit(pid, obs, deterministic=True, timeout_s=TIMEOUT) for pid, obs in asks]
    futures.append(service.submit("spread", _obs("spread", 6, 9), timeout_s=TIMEOUT))  # samples on the device
    with service:
        results = [f.result(TIMEOUT) for f in futures]
        assert service.device.type == "cuda"
    for (pid, obs), got in zip(asks, results):
        want = _direct(pid, obs)
        assert got.action.device.type == "cpu" and torch.equal(got.action, want[ACTION])
        torch.testing.assert_close(got.log_prob, want[LOG_PROB])
    sampled = results[-1]
    assert _obs("spread", 6, 9)[ACTION_MASK].gather(-1, sampled.action.unsqueeze(-1)).all()


def test_a_waiting_caller_serves_the_queue_itself_when_no_batch_runs(monkeypatch):
    """Leader/follower: a caller about to wait serves one batch of whatever is queued in its own thread."""
    threads: list[str] = []
    act_step = GroupPolicy.act_step

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return act_step(self, *args, **kwargs)

    monkeypatch.setattr(GroupPolicy, "act_step", recording)
    service = InferenceService(_policies(), InferenceConfig(max_wait_s=0.05, device="cpu"))  # no thread yet
    first = service.submit("spread", _obs("spread", 2, 1), timeout_s=TIMEOUT)
    second = service.submit("spread", _obs("spread", 3, 2), timeout_s=TIMEOUT)
    assert service.serve_queued()  # both, in one batch, in this thread
    assert first.result().batch == second.result().batch == 0
    assert threads == [threading.current_thread().name]
    assert not service.serve_queued()  # nothing queued
    service.close()
    assert service.stats()["batches"] == 1


def test_a_caller_leaves_a_nearly_empty_queue_to_the_service_thread():
    """After a batch of 8 rows, a helping caller serves only once 3/4 of that (6 rows) are queued: many callers
    are not answered in small batches by whichever comes back first."""
    service = InferenceService(_policies(), InferenceConfig(max_wait_s=0.05, device="cpu"))  # no thread yet
    futures = [service.submit("spread", _obs("spread", 1, k), timeout_s=TIMEOUT) for k in range(8)]
    assert service.serve_queued() and all(f.result().batch == 0 for f in futures)
    futures = [service.submit("spread", _obs("spread", 1, k), timeout_s=TIMEOUT) for k in range(5)]
    assert not service.serve_queued()  # 5 rows < 6: left for the service thread's batch
    futures.append(service.submit("spread", _obs("spread", 1, 5), timeout_s=TIMEOUT))
    assert service.serve_queued() and all(f.result().batch == 1 for f in futures)
    service.close()
    assert service.stats()["batches"] == 2

