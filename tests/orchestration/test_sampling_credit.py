"""The asynchronous fleet's credit pool: a fragment per credit, credit back once every learner is done with the
fragment, a top-up when a learner waits for data while workers wait for credit."""

from __future__ import annotations

import asyncio

import torch
from tensordict import TensorDict

from orchestration.inbox import ACCEPTED, STALE, Inbox
from orchestration.sampling_credit import TOP_UP_AFTER_S, CreditLedger, CreditPool, batch_fragments


def test_the_pool_holds_max_staleness_plus_one_batches_and_a_worker_waits_for_credit_given_back():
    async def scenario():
        pool = CreditPool(batch_fragments=2, max_staleness=1)
        assert [await pool.acquire(0.01) for _ in range(5)] == [True] * 4 + [False]  # two batches, then none
        waiter = asyncio.ensure_future(pool.acquire(5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done() and pool.waiting == 1
        await pool.grant(1)  # a fragment trained on: its credit goes to the waiting worker
        assert await waiter and pool.balance == 0 and pool.waiting == 0
        await pool.grant(10)  # never above the capacity
        return pool.state()

    state = asyncio.run(scenario())
    assert state["balance"] == state["capacity"] == 4 and state["acquired"] == 5 and state["returned"] == 11


def test_a_top_up_gives_one_credit_per_waiting_worker_only_when_the_pool_is_empty():
    async def scenario():
        pool = CreditPool(batch_fragments=1, max_staleness=0)
        assert await pool.top_up() == 0  # credit left: nothing to top up
        assert await pool.acquire(0.01)
        assert await pool.top_up() == 0  # empty, but nobody waits
        waiters = [asyncio.ensure_future(pool.acquire(5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert await pool.top_up() == 3
        assert all(await asyncio.gather(*waiters)) and pool.balance == 0
        return pool.state()

    assert asyncio.run(scenario())["topped_up"] == 3


def test_a_fragment_gives_its_credit_back_once_every_learner_it_went_to_is_done_with_it():
    ledger = CreditLedger(keep=4, consumers=2)
    assert ledger.returned([1, 2], "a") == 0  # the other learner has yet to train on them
    assert ledger.returned([1, 2], "a") == 0  # a reuse by the same learner: still waiting for "b"
    assert ledger.returned([2, 1], "b") == 2
    assert ledger.returned([1, 2], "b") == 0  # given back once
    assert ledger.returned([3], "b") == 0 and ledger.returned([3], "a") == 1  # in either order
    alone = CreditLedger(keep=4)  # one learner: its first training gives the credit back
    assert alone.returned([1, 2]) == 2 and alone.returned([1, 2]) == 0 and alone.returned([2, 3, 4, 5]) == 3
    assert alone.returned([1]) == 1  # forgotten: only the newest ``keep`` ids are remembered
    assert batch_fragments(512, 256) == 2 and batch_fragments(500, 256) == 2 and batch_fragments(64, 256) == 1


def test_a_top_up_is_due_only_to_a_hungry_learner_that_trained_nothing_for_a_while():
    now = [0.0]
    ledger = CreditLedger(keep=4, clock=lambda: now[0])
    now[0] = TOP_UP_AFTER_S / 2
    assert not ledger.top_up_due(True)  # data in flight arrives sooner than this
    now[0] = TOP_UP_AFTER_S
    assert not ledger.top_up_due(False) and ledger.top_up_due(True)
    assert not ledger.top_up_due(True)  # one top-up, then another wait
    now[0] = 2 * TOP_UP_AFTER_S - 0.01
    ledger.returned([7])  # a training: the wait starts again
    now[0] = 2 * TOP_UP_AFTER_S + 0.01
    assert not ledger.top_up_due(True)
    now[0] = 3 * TOP_UP_AFTER_S
    assert ledger.top_up_due(True)


def test_a_learner_reports_each_fragment_it_dropped_as_stale_once_so_that_its_credit_comes_back():
    inbox = Inbox("p", batch_steps=4, max_staleness=0)
    fragment = TensorDict(x=torch.zeros(2, 2), batch_size=[2, 2])

    def meta(fid: int, version: int) -> dict:
        return {"fragment_id": fid, "worker_id": 0, "sequence": fid, "policy_versions": {"p": version}}

    assert inbox.add(fragment, meta(0, 0), version=1) == STALE  # lagging on arrival
    assert inbox.add(fragment, meta(1, 1), version=1) == ACCEPTED
    inbox.drop_stale(2)  # lagging by the time it would be trained
    assert inbox.take_dropped() == [0, 1] and inbox.take_dropped() == []
    assert inbox.add(fragment, meta(2, 2), version=2) == ACCEPTED
    assert [e.meta["fragment_id"] for e in inbox.take(2, take_all=True)] == [2]
    inbox.drop_stale(5)
    assert inbox.take_dropped() == []  # trained on: its training gave the credit back


def test_a_streaming_worker_waiting_for_credit_loads_the_weights_it_is_handed():
    """A league on Ray hands its fixed opponent new weights and waits (``sync_weights``) before its player trains;
    a worker out of credit never reached a fragment boundary, and the training that frees credit never came."""
    import threading

    from orchestration.builder import assignment_for, build_policies
    from orchestration.config import RolloutConfig, TrainConfig
    from orchestration.envs import make_env
    from orchestration.sampler import Sampler

    config = TrainConfig(env="builtin:cartpole", rollout=RolloutConfig(num_envs=2, fragment_length=4))
    tree = make_env(config.env, 1).tree
    policies, _ = build_policies(config, tree, assignment_for(config, tree))
    weights = {pid: (0, [TensorDict.from_module(p).detach().clone()]) for pid, p in policies.items()}
    sampler = Sampler(config, 0, 0, weights, fetch=lambda w: w, queue_size=4, threads=1, credit=lambda _: False)
    streaming = threading.Thread(target=sampler.run, args=(weights,), daemon=True)
    streaming.start()
    newer = {pid: (3, [w.apply(torch.zeros_like)]) for pid, (_, [w]) in weights.items()}
    try:
        assert sampler.sync_weights(newer, timeout_s=5.0) == {pid: 3 for pid in weights}  # not still 0
    finally:
        sampler.stop()
        done = sampler.queue.get(timeout=5.0)  # the stream's final flush: what a sender thread would answer
        done.set()
        streaming.join(5.0)
