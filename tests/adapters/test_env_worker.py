"""EnvWorkerPool: same results as in-process stepping; a killed, hung or failing worker is restarted."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from adapters.builtin import CartPole, CartPoleConfig, Spread, SpreadConfig
from adapters.env_worker import step_template
from adapters.protocol import BatchedEnv
from core.layout import ACTION, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import validate


class FaultyCartPole(CartPole):
    """CartPole that hangs (``"hang"``) or raises (``"raise"``) in ``step`` once ``flag`` exists (``arm_fault``
    writes it; the env deletes it first, so the restarted worker behaves)."""

    def __init__(self, flag: str, num_envs: int = 4) -> None:
        super().__init__(CartPoleConfig(num_envs=num_envs))
        self._flag = flag

    def step(self, actions):
        if os.path.exists(self._flag):
            with open(self._flag) as f:
                mode = f.read()
            os.remove(self._flag)
            if mode == "hang":
                time.sleep(60)
            raise RuntimeError("injected env failure")
        return super().step(actions)


def arm_fault(flag, mode: str) -> None:
    """Makes the env watching ``flag`` fail with ``mode`` at its next step. Written aside and renamed:
    a worker stepping meanwhile must never see the file empty (it would read "" and raise instead of hang)."""
    aside = f"{flag}.tmp"
    with open(aside, "w") as f:
        f.write(mode)
    os.replace(aside, flag)


def cartpole_actions(n: int, generator) -> TensorDict:
    """Random CartPole actions, batch ``[n]``."""
    action = torch.randint(0, 2, (n, 1), generator=generator)
    return TensorDict({"agent": TensorDict({ACTION: action}, batch_size=[n, 1])}, batch_size=[n])


def test_step_template_has_the_keys_of_a_step():
    for env in (CartPole(CartPoleConfig(num_envs=3)), Spread(SpreadConfig(num_envs=3))):
        env.reset(seed=0)
        group = "agent" if isinstance(env, CartPole) else "agents"
        shape = env.reset(seed=0).get((group, MASK)).shape
        out = env.step(TensorDict({group: TensorDict({ACTION: torch.zeros(shape, dtype=torch.int64)},
                                                     batch_size=shape)}, batch_size=[3]))
        template = step_template(env.tree, 3)
        assert set(template.keys(True, True)) == set(out.keys(True, True))
        for key in template.keys(True, True):
            assert template.get(key).shape == out.get(key).shape and template.get(key).dtype == out.get(key).dtype


def test_pool_equals_in_process_stepping(pool_factory):
    config = SpreadConfig(num_envs=3, join_prob=0.1)
    pool = pool_factory([functools.partial(Spread, config)] * 2)
    assert isinstance(pool, BatchedEnv) and pool.num_envs == 6 and pool.offsets == [0, 3]
    refs = [Spread(config) for _ in range(2)]
    td = pool.reset(seed=5)
    assert (td == torch.cat([r.reset(seed=5 + 3 * k) for k, r in enumerate(refs)])).all()
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        action = torch.randint(0, 5, (6, 4), generator=generator)
        actions = TensorDict({"agents": TensorDict({ACTION: action}, batch_size=[6, 4])}, batch_size=[6])
        out = pool.step(actions)
        expected = torch.cat([r.step(actions[3 * k:3 * k + 3]) for k, r in enumerate(refs)])
        assert (out == expected).all()
    validate(out, pool.tree)
    assert not out.get(SHARED).is_shared()  # the caller owns what it gets; the buffers stay the pool's
    assert pool.counters == {"env_restarts": 0, "episodes_lost": 0, "step_timeouts": 0, "worker_crashes": 0,
                             "worker_errors": 0}


def test_pool_of_gymnasium_adapters_equals_in_process_stepping(pool_factory):
    from adapters.gymnasium_env import make_gymnasium

    pool = pool_factory([functools.partial(make_gymnasium, "CartPole-v1", 2)] * 2)
    refs = [make_gymnasium("CartPole-v1", 2) for _ in range(2)]
    assert (pool.reset(seed=0) == torch.cat([r.reset(seed=2 * k) for k, r in enumerate(refs)])).all()
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):  # several episode ends at random actions
        actions = cartpole_actions(4, generator)
        expected = torch.cat([r.step(actions[2 * k:2 * k + 2]) for k, r in enumerate(refs)])
        assert (pool.step(actions) == expected).all()
    assert "invalid_output_truncations" in pool.counters  # the workers' own counters come through


def test_killed_worker_ends_its_episodes_truncated_and_restarts(pool_factory):
    factory = functools.partial(CartPole, CartPoleConfig(num_envs=4))
    pool = pool_factory([factory, factory])
    ref = CartPole(CartPoleConfig(num_envs=4))  # stands in for worker 1, which must be unaffected
    generator = torch.Generator().manual_seed(0)
    pool.reset(seed=0)
    ref.reset(seed=4)
    for _ in range(5):
        actions = cartpole_actions(8, generator)
        last = pool.step(actions).exclude(NEXT)
        ref.step(actions[4:])
    old_pid = pool.worker_pids[0]
    os.kill(old_pid, signal.SIGKILL)
    actions = cartpole_actions(8, generator)
    out = pool.step(actions)
    assert (out[4:] == ref.step(actions[4:])).all()
    nxt = out.get((NEXT, "agent"))
    assert out.get((NEXT, TRUNCATED))[:4].all() and not out.get((NEXT, TERMINATED))[:4].any()
    assert out.get((NEXT, DONE))[:4].all() and nxt.get(TRUNCATED)[:4].all() and not nxt.get(TERMINATED)[:4].any()
    assert torch.equal(nxt.get(OBSERVATION)[:4], last.get(("agent", OBSERVATION))[:4])  # last known obs is final
    assert not nxt.get(REWARD)[:4].any() and nxt.get(MASK)[:4].all()
    assert out.get(("agent", OBSERVATION))[:4].abs().max() <= 0.05  # the restarted envs begin fresh episodes
    counters = pool.counters
    assert counters["env_restarts"] == 1 and counters["episodes_lost"] == 4 and counters["worker_crashes"] == 1
    assert pool.worker_pids[0] != old_pid
    for _ in range(3):  # the batch goes on
        validate(pool.step(cartpole_actions(8, generator)), pool.tree)


def test_workers_run_nicer_than_the_acting_process_restarted_ones_too(pool_factory):
    factory = functools.partial(CartPole, CartPoleConfig(num_envs=2))
    own = os.getpriority(os.PRIO_PROCESS, 0)
    pool = pool_factory([factory, factory], niceness=7)
    pool.reset(seed=0)
    nice = lambda: [os.getpriority(os.PRIO_PROCESS, pid) for pid in pool.worker_pids]  # noqa: E731
    assert nice() == [min(own + 7, 19)] * 2
    os.kill(pool.worker_pids[1], signal.SIGKILL)
    pool.step(cartpole_actions(4, torch.Generator().manual_seed(0)))
    assert pool.counters["env_restarts"] == 1 and nice() == [min(own + 7, 19)] * 2
    same = pool_factory([factory], niceness=0)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in same.worker_pids] == [own]
    with pytest.raises(ValueError, match="niceness must be in 0..19"):
        pool_factory([factory], niceness=-1)


def wait_until_exited(pid: int) -> None:
    """Waits until ``pid`` has exited (gone, or a zombie: its pipes are closed either way)."""
    for _ in range(500):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit")


@pytest.mark.parametrize("call", ["step", "reset"])
def test_a_worker_that_died_between_calls_is_restarted_not_a_broken_pipe(pool_factory, call):
    """The pool writes the next command into the dead worker's closed pipe: that must count as its death."""
    factory = functools.partial(CartPole, CartPoleConfig(num_envs=2))
    pool = pool_factory([factory, factory])
    pool.reset(seed=0)
    dead = pool.worker_pids[1]
    os.kill(dead, signal.SIGKILL)
    wait_until_exited(dead)
    if call == "step":
        out = pool.step(cartpole_actions(4, torch.Generator().manual_seed(0)))
        assert out.get((NEXT, TRUNCATED)).squeeze(1).tolist() == [False, False, True, True]
        assert pool.counters["episodes_lost"] == 2
    else:
        validate(pool.reset(seed=1), pool.tree)
    assert pool.counters["env_restarts"] == 1 and pool.counters["worker_crashes"] == 1
    assert dead not in pool.worker_pids


@pytest.mark.parametrize("mode, counter", [("hang", "step_timeouts"), ("raise", "worker_errors")])
def test_hung_or_failing_worker_is_restarted(pool_factory, tmp_path, mode, counter):
    flags = [str(tmp_path / f"fault{k}") for k in range(2)]
    pool = pool_factory([functools.partial(FaultyCartPole, flag) for flag in flags], step_timeout_s=1.0)
    generator = torch.Generator().manual_seed(0)
    pool.reset(seed=0)
    pool.step(cartpole_actions(8, generator))
    arm_fault(flags[1], mode)
    start = time.monotonic()
    out = pool.step(cartpole_actions(8, generator))
    elapsed = time.monotonic() - start
    # a raising worker is not waited for as a hung one: told by the counters, not the clock (its restart alone
    # can take a second on a loaded machine)
    assert (elapsed >= 1.0 if mode == "hang" else pool.counters["step_timeouts"] == 0) and elapsed < 20
    failed = out.get((NEXT, TRUNCATED)).squeeze(1)
    assert failed.tolist() == [False] * 4 + [True] * 4  # exactly the faulty worker's envs
    assert pool.counters[counter] == 1 and pool.counters["env_restarts"] == 1 and pool.counters["episodes_lost"] == 4
    validate(pool.step(cartpole_actions(8, generator)), pool.tree)


def test_a_worker_that_cannot_start_raises(pool_factory):
    with pytest.raises(RuntimeError, match="failed to start"):
        pool_factory([functools.partial(CartPole, "not a config")])


class BrokenReset(CartPole):
    """CartPole whose every reset fails (what no restart can mend)."""

    def reset(self, seed=None):
        raise RuntimeError("this env never resets")


def test_a_worker_that_fails_after_every_restart_is_named_with_its_last_failure(pool_factory):
    """Lenient restarts spent: the fault names the worker, its envs and what it raised (was a bare RuntimeError
    saying only that the restarts were used up)."""
    from adapters.env_worker import EnvWorkerFault

    pool = pool_factory([functools.partial(CartPole, CartPoleConfig(num_envs=2)),
                         functools.partial(BrokenReset, CartPoleConfig(num_envs=4))], max_restarts=2)
    with pytest.raises(EnvWorkerFault, match=r"env worker 1 \(envs 2\.\.5 of the batch\) raised RuntimeError: this env "
                                             r"never resets; the pool has no restart left \(it allows 2") as fault:
        pool.reset(seed=0)
    assert not fault.value.env_output  # the env's own error, not data that breaks its tree (a traceback helps)


class NoSecondLife(CartPole):
    """CartPole that fails its first step and cannot be built again (the flag file says it ran once)."""

    def __init__(self, flag: str) -> None:
        if os.path.exists(flag):
            raise OSError("the device this env drives is busy")
        super().__init__(CartPoleConfig(num_envs=2))
        self._flag = flag

    def step(self, actions):
        open(self._flag, "w").close()
        raise RuntimeError("injected step failure")


def test_a_spent_pool_names_the_last_failure_a_restart_that_could_not_start_included(pool_factory, tmp_path):
    from adapters.env_worker import EnvWorkerFault

    pool = pool_factory([functools.partial(NoSecondLife, str(tmp_path / "ran"))], max_restarts=2)
    pool.reset(seed=0)
    with pytest.raises(EnvWorkerFault, match=r"env worker 0 \(envs 0\.\.1 of the batch\) could not be restarted "
                                             r"\(.*OSError: the device this env drives is busy\); the pool has no "
                                             r"restart left \(it allows 2 over its life"):
        pool.step(cartpole_actions(2, torch.Generator().manual_seed(0)))


def test_close_is_idempotent_and_stops_the_processes(pool_factory):
    pool = pool_factory([functools.partial(CartPole, CartPoleConfig(num_envs=2))])
    pool.reset(seed=0)
    procs = [w.proc for w in pool._workers]
    pool.close()
    pool.close()
    assert not any(p.is_alive() for p in procs)


def test_a_worker_writes_every_leaf_of_a_step_and_fills_a_missing_action_mask():
    from adapters.env_process import _write

    env = CartPole(CartPoleConfig(num_envs=3))
    env.reset(seed=0)
    out = env.step(cartpole_actions(3, torch.Generator().manual_seed(0)))
    buffers = step_template(env.tree, 3)
    leaves = [(k if isinstance(k, tuple) else (k,), v) for k, v in buffers.items(True, True)]
    buffers.get(("agent", "action_mask")).fill_(False)  # left from a step of an env that had one
    without_mask = out.exclude(("agent", "action_mask"))
    _write(without_mask, leaves)
    assert (buffers.exclude(("agent", "action_mask")) == without_mask).all()
    assert buffers.get(("agent", "action_mask")).all()
    with pytest.raises(KeyError, match="'next', 'agent', 'reward'"):
        _write(out.exclude(("next", "agent", "reward")), leaves)


class RaisingCartPole(CartPole):
    def step(self, actions):
        raise RuntimeError("injected env failure")


def test_a_worker_whose_parent_went_away_exits_quietly():
    """A worker that cannot report its env's error (the parent closed the pipe: a Ray worker killed at the end
    of a run) returns instead of raising again from its handler, which printed a traceback per worker."""
    import multiprocessing

    from adapters.env_process import worker_main
    from core.specs import groups, zeros

    parent, child = multiprocessing.Pipe()
    errors = []

    def run():
        try:
            worker_main(child, functools.partial(RaisingCartPole, CartPoleConfig(num_envs=2)), threads=1)
        except BaseException as err:  # noqa: BLE001 - the test's finding
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    _, tree_json, n = parent.recv()
    env = CartPole(CartPoleConfig(num_envs=2))
    actions = zeros(env.tree, [n]).select(*[(g, ACTION) for g in groups(env.tree)])
    parent.send((actions, step_template(env.tree, n)))
    parent.send(("step", None))
    parent.close()  # gone before the worker's answer
    thread.join(10)
    assert not thread.is_alive() and errors == []


def test_a_worker_restarted_after_a_reset_without_seed_is_still_seeded(pool_factory):
    """An evaluation's reset continues (no seed); it made the pool forget the run's seed, so a worker restarted
    after it began unseeded episodes: two runs of the same seed no longer agreed."""
    factory = functools.partial(CartPole, CartPoleConfig(num_envs=4))
    restarted = []
    for _ in range(2):
        pool = pool_factory([factory, factory])
        pool.reset(seed=0)
        pool.reset()
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        out = pool.step(cartpole_actions(8, torch.Generator().manual_seed(0)))
        restarted.append(out.get(("agent", OBSERVATION))[:4])
    assert torch.equal(*restarted)
