"""The inference service's queue: the wait for more requests (orchestration.inference_waits.get_within),
the order of the service thread's work when the next batch is queued already, and how a batch that does not
form is served."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

import orchestration.inference as inference
from core.policies import GroupPolicy, PolicyConfig, make_policies
from orchestration.envs import make_env
from orchestration.inference import InferenceConfig, InferenceService
from orchestration.inference_waits import get_within


def test_a_timed_wait_ends_when_another_consumer_takes_its_wake_up():
    """The hang of issue 13's benchmark: the service thread waits at most ``max_wait_s`` for more requests; a
    put wakes it, but a helping caller (``serve_queued``) takes the item first and keeps the interpreter past
    the wait's deadline. CPython's ``SimpleQueue.get(timeout=...)`` then waits for ever (its remaining time
    turns negative, read as "no timeout"), and so did every caller whose request the service thread held."""
    for _ in range(20):
        waiting: queue.SimpleQueue = queue.SimpleQueue()
        ended = threading.Event()

        def wait_for_more() -> None:
            with pytest.raises(queue.Empty):
                get_within(waiting, 0.002)
            ended.set()

        waiter = threading.Thread(target=wait_for_more, daemon=True)
        waiter.start()
        time.sleep(0.0005)
        waiting.put("request")
        waiting.get_nowait()  # another consumer takes it before the woken waiter runs
        spin_until = time.monotonic() + 0.01  # and holds the interpreter past the waiter's deadline
        while time.monotonic() < spin_until:
            pass
        assert ended.wait(2.0), "the timed wait never ended"


def test_a_timed_wait_returns_an_item_that_comes_in_time():
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    threading.Timer(0.01, waiting.put, args=("request",)).start()
    assert get_within(waiting, 5.0) == "request"
    with pytest.raises(queue.Empty):
        get_within(waiting, 0.001)


def test_the_next_queued_batch_is_formed_before_the_last_ones_callers_are_woken(monkeypatch):
    """Nine one-row requests, all queued before the service starts: batches of four, four and one. The service
    thread concatenates batch k+1 before it hands back batch k's answers (woken then, their callers run while
    batch k+1's forward releases the GIL instead of holding up its concatenation), and hands them back before
    that forward: no answer waits for a forward after its own. The last batch is one row, below the "nearly
    empty" threshold (3 rows after a batch of 4): whoever is queued is served, not kept waiting for company
    while others' answers are held. Counts of answered requests at each step tell."""
    env = make_env("builtin:cartpole", 1)
    policy = make_policies(env.tree, PolicyConfig())["agent"]
    env.close()
    service = InferenceService({"p": policy}, InferenceConfig(max_batch_rows=4, max_wait_s=0.05, device="cpu"))
    futures = [service.submit("p", {"observation": torch.randn(1, 1, 4)}, timeout_s=120.0) for _ in range(9)]
    seen: list[tuple[str, int]] = []
    prepare, act_step = inference.try_prepare, GroupPolicy.act_step

    def recording(step, real):
        def call(*args, **kwargs):
            seen.append((step, sum(f.done() for f in futures)))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(inference, "try_prepare", recording("form", prepare))
    monkeypatch.setattr(GroupPolicy, "act_step", recording("forward", act_step))
    service.start()
    assert [f.result(timeout=60).batch for f in futures] == [0] * 4 + [1] * 4 + [2]
    service.close()
    assert seen == [("form", 0), ("forward", 0), ("form", 0), ("forward", 4), ("form", 4), ("forward", 8)]


def test_a_batch_of_two_policies_answers_the_first_before_the_second_forward(monkeypatch):
    """One batch, two policies: one forward each. The first policy's callers are answered before the second
    forward runs, not held with the second's for the next batch."""
    env = make_env("builtin:cartpole", 1)
    policy = make_policies(env.tree, PolicyConfig())["agent"]
    env.close()
    service = InferenceService({"a": policy, "b": policy}, InferenceConfig(max_batch_rows=4, device="cpu"))
    futures = [service.submit(pid, {"observation": torch.randn(1, 1, 4)}, timeout_s=120.0) for pid in "aabb"]
    answered: list[int] = []
    act_step = GroupPolicy.act_step

    def recording(*args, **kwargs):
        answered.append(sum(f.done() for f in futures))
        return act_step(*args, **kwargs)

    monkeypatch.setattr(GroupPolicy, "act_step", recording)
    service.start()
    assert [f.result(timeout=60).batch for f in futures] == [0, 0, 0, 0]
    service.close()
    assert answered == [0, 2]


def test_a_group_that_does_not_concatenate_is_answered_one_by_one_without_a_forward_of_the_whole():
    """Three requests of one policy and mode, one with the wrong feature width: they cannot form one batch, so
    each is answered alone (three forwards, not a fourth try of the whole group); only the culprit fails."""
    env = make_env("builtin:cartpole", 1)
    policy = make_policies(env.tree, PolicyConfig())["agent"]
    env.close()
    service = InferenceService({"p": policy}, InferenceConfig(device="cpu"))
    widths = [4, 7, 4]
    futures = [service.submit("p", {"observation": torch.randn(1, 1, w)}, timeout_s=120.0) for w in widths]
    with service:
        failed = [f.exception(timeout=60) is not None for f in futures]
    assert failed == [False, True, False]
    stats = service.stats()
    assert (stats["batches"], stats["forwards"], stats["served"], stats["failed"]) == (1, 3, 2, 1)
