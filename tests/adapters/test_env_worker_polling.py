"""EnvWorkerPool's split phase (send / poll / result / root): workers advance independently, each result equals
in-process stepping, and a hung, killed or failing worker is restarted with only its envs truncated."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch

from adapters.builtin import CartPole, CartPoleConfig
from adapters.env_worker import EnvWorkerFault
from core.layout import DONE, NEXT, OBSERVATION, TERMINATED, TRUNCATED
from core.specs import validate
from tests.adapters.test_env_worker import arm_fault, cartpole_actions


class SlowCartPole(CartPole):
    """CartPole that sleeps ``delay_s`` per step; once the file ``flag`` exists (it deletes it first, so the
    restarted process behaves) it hangs (``"hang"``), raises (``"raise"``) or dies (``"exit"``)."""

    def __init__(self, delay_s: float = 0.0, num_envs: int = 2, flag: str | None = None) -> None:
        super().__init__(CartPoleConfig(num_envs=num_envs))
        self._delay, self._flag = delay_s, flag

    def step(self, actions):
        if self._flag is not None and os.path.exists(self._flag):
            with open(self._flag) as f:
                mode = f.read()
            os.remove(self._flag)
            if mode == "exit":
                os._exit(1)
            if mode == "hang":
                time.sleep(60)
            raise RuntimeError("injected env failure")
        if self._delay:
            time.sleep(self._delay)
        return super().step(actions)



def test_split_phase_steps_equal_in_process_stepping(pool_factory):
    """Workers sent at different times, results taken in any order: each equals its own env stepped in
    process, and step() keeps working afterwards (lock-step again, from where each worker is)."""
    sizes = [2, 3]
    pool = pool_factory([functools.partial(SlowCartPole, 0.0, n) for n in sizes])
    refs = [CartPole(CartPoleConfig(num_envs=n)) for n in sizes]
    assert pool.num_workers == 2 and pool.sizes == sizes and pool.offsets == [0, 2]
    first = pool.reset(seed=7)
    for k, ref in enumerate(refs):
        expected, first_k = ref.reset(seed=7 + pool.offsets[k]), first[pool.offsets[k]:pool.offsets[k] + sizes[k]]
        assert (pool.root(k) == expected).all() and (first_k == expected).all()
    generator = torch.Generator().manual_seed(0)
    counts = [0, 0]
    assert pool.poll() == [] and pool.in_flight == []
    for round_ in range(12):
        order = [1, 0] if round_ % 3 == 0 else [0, 1]  # concatenated in the order named
        actions = cartpole_actions(sum(sizes), generator)
        pool.send(actions, order)
        assert pool.in_flight == [0, 1]
        split = {order[0]: actions[:sizes[order[0]]], order[1]: actions[sizes[order[0]]:]}
        finished: set[int] = set()
        while len(finished) < 2:  # a finished worker's result waits, untaken, across the next polls
            finished |= set(pool.poll(timeout_s=None))
        assert pool.in_flight == []
        for k in (1, 0) if round_ % 2 else (0, 1):
            out = pool.result(k)
            assert out.batch_size == torch.Size([sizes[k]])
            assert (out == refs[k].step(split[k])).all()
            assert (pool.root(k) == out.exclude(NEXT)).all()
            counts[k] += 1
        with pytest.raises(ValueError, match="no finished step"):
            pool.result(0)  # each finished step is taken once
    assert counts == [12, 12]
    actions = cartpole_actions(5, generator)
    out = pool.step(actions)
    assert (out == torch.cat([refs[0].step(actions[:2]), refs[1].step(actions[2:])])).all()
    validate(out, pool.tree)
    assert pool.counters["env_restarts"] == 0


def test_misuse_is_refused(pool_factory):
    pool = pool_factory([functools.partial(SlowCartPole, 0.0, 2)] * 2)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="reset"):
        pool.send(cartpole_actions(2, generator), [0])
    pool.reset(seed=0)
    with pytest.raises(ValueError, match="batch"):
        pool.send(cartpole_actions(4, generator), [0])
    pool.send(cartpole_actions(2, generator), [0])
    with pytest.raises(ValueError, match="in flight"):
        pool.send(cartpole_actions(2, generator), [0])
    with pytest.raises(RuntimeError, match="in flight"):
        pool.step(cartpole_actions(4, generator))
    assert pool.poll(timeout_s=None) == [0]
    pool.reset(seed=1)  # drains nothing here; with a worker in flight it waits for it (next lines)
    pool.send(cartpole_actions(2, generator), [1])
    pool.reset(seed=1)
    assert pool.in_flight == [] and pool.poll() == []


def test_fast_workers_are_not_held_back_by_a_slow_one(pool_factory):
    """Worker 2 is 10x slower per step: polled, the others keep their own pace (steps counted, not time)."""
    delays = [0.01, 0.01, 0.1]
    pool = pool_factory([functools.partial(SlowCartPole, d, 2) for d in delays])
    pool.reset(seed=0)
    generator = torch.Generator().manual_seed(0)
    steps, polls = [0, 0, 0], 0
    pool.send(cartpole_actions(6, generator), [0, 1, 2])
    while steps[2] < 10:
        finished = pool.poll(timeout_s=None)
        polls += 1
        assert finished and len(set(finished)) == len(finished)
        for k in finished:
            out = pool.result(k)
            assert out.batch_size == torch.Size([2]) and not out.get((NEXT, TRUNCATED)).any()
            steps[k] += 1
        pool.send(cartpole_actions(2 * len(finished), generator), finished)
    # ~10x on idle cores; 3x leaves room for cores shared with the suite's other process (lock-step: 1x)
    assert min(steps[0], steps[1]) >= 3 * steps[2], steps
    assert polls < sum(steps) + 1  # a poll may report several workers, never none (no timeout here)
    assert pool.counters["env_restarts"] == 0


def test_a_hung_worker_times_out_from_its_own_send_while_the_others_keep_stepping(pool_factory, tmp_path):
    flag = str(tmp_path / "hang")
    pool = pool_factory([functools.partial(SlowCartPole, 0.002, 2),
                         functools.partial(SlowCartPole, 0.0, 3, flag)], step_timeout_s=1.0)
    pool.reset(seed=0)
    generator = torch.Generator().manual_seed(0)
    arm_fault(flag, "hang")
    last_root = pool.root(1)
    pool.send(cartpole_actions(5, generator), [0, 1])
    sent, fast_steps = time.monotonic(), 0
    while True:  # worker 0 is sent again and again: that must not delay worker 1's timeout
        finished = pool.poll(timeout_s=None)
        if 0 in finished:
            assert not pool.result(0).get((NEXT, TRUNCATED)).any()
            fast_steps += 1
            pool.send(cartpole_actions(2, generator), [0])
        if 1 in finished:
            break
        assert time.monotonic() - sent < 10, "the hung worker was never reported"
    elapsed = time.monotonic() - sent
    assert 1.0 <= elapsed < 5.0
    assert fast_steps >= 20  # ~1 s of 2 ms steps went on beside the hung worker
    out = pool.result(1)
    nxt = out.get(NEXT)
    assert nxt.get(TRUNCATED).all() and nxt.get(DONE).all() and not nxt.get(TERMINATED).any()
    assert torch.equal(nxt.get(("agent", OBSERVATION)), last_root.get(("agent", OBSERVATION)))
    assert out.get(("agent", OBSERVATION)).abs().max() <= 0.05  # the restarted envs begin fresh episodes
    counters = pool.counters
    assert counters["step_timeouts"] == 1 and counters["env_restarts"] == 1 and counters["episodes_lost"] == 3
    pool.send(cartpole_actions(3, generator), [1])  # the restarted worker steps on
    while 1 not in pool.poll(timeout_s=None):  # (worker 0 is still in flight too)
        pass
    assert not pool.result(1).get((NEXT, TRUNCATED)).any()


@pytest.mark.parametrize("mode, counter", [("kill", "worker_crashes"), ("raise", "worker_errors")])
def test_a_failed_worker_is_restarted_and_only_its_envs_truncated(pool_factory, tmp_path, mode, counter):
    flag = str(tmp_path / "fault")
    pool = pool_factory([functools.partial(SlowCartPole, 0.0, 2), functools.partial(SlowCartPole, 0.0, 2, flag)])
    ref = CartPole(CartPoleConfig(num_envs=2))  # stands in for worker 0, which must be unaffected
    pool.reset(seed=0)
    ref.reset(seed=0)
    generator = torch.Generator().manual_seed(0)
    old_pid = pool.worker_pids[1]
    if mode == "kill":
        os.kill(old_pid, signal.SIGKILL)
    else:
        arm_fault(flag, "raise")
    actions = cartpole_actions(4, generator)
    pool.send(actions, [0, 1])
    finished: list[int] = []
    while len(finished) < 2:
        finished += pool.poll(timeout_s=None)
    assert sorted(finished) == [0, 1]
    assert (pool.result(0) == ref.step(actions[:2])).all()
    out = pool.result(1)
    assert out.get((NEXT, TRUNCATED)).all() and not out.get((NEXT, TERMINATED)).any()
    counters = pool.counters
    assert counters[counter] == 1 and counters["env_restarts"] == 1 and counters["episodes_lost"] == 2
    assert pool.worker_pids[1] != old_pid and pool.worker_pids[0] != old_pid
    validate(pool.step(cartpole_actions(4, generator)), pool.tree)  # lock-step works after the restart


def test_strict_mode_raises_from_poll(pool_factory, tmp_path):
    flag = str(tmp_path / "fault")
    pool = pool_factory([functools.partial(SlowCartPole, 0.0, 2, flag)], restart=False)
    pool.reset(seed=0)
    arm_fault(flag, "raise")
    pool.send(cartpole_actions(2, torch.Generator().manual_seed(0)), [0])
    with pytest.raises(EnvWorkerFault, match="env worker 0"):
        pool.poll(timeout_s=None)
