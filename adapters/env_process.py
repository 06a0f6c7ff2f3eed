"""The subprocess side of :mod:`adapters.env_worker`: the step buffer layout, the worker loop, and the parent's
handle on a worker process (start, replies with timeouts, kill).

A worker builds its env from a picklable factory, announces ``(tree JSON, num_envs)``, receives its slices of the
pool's shared-memory buffers (actions; step outputs laid out by :func:`step_template`), then serves ``reset`` and
``step`` commands: it reads actions from the shared buffer and writes the env's output into it, answering
``("ok", counters)`` or ``("error", traceback)`` on the pipe.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
import traceback
from multiprocessing.connection import wait
from typing import Callable

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import Tree, groups, to_json, zeros
from core.tensordicts import clone_td

from .protocol import BatchedEnv


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvWorkerConfig:
    """Settings of :class:`EnvWorkerPool`."""

    step_timeout_s: float = 30.0
    """Longest wait for a worker's step or reset before it counts as hung and is restarted."""
    start_timeout_s: float = 120.0
    """Longest wait for a new worker to import, build its env and answer."""
    max_restarts: int = 100
    """Restarts allowed over the pool's life; one more raises :class:`EnvWorkerFault` with the last failure."""
    start_method: str = "forkserver"
    """Multiprocessing start method: ``"forkserver"`` (fast restarts) or ``"spawn"``."""
    torch_threads: int = 1
    """``torch.set_num_threads`` in each worker."""
    niceness: int = 10
    """Added to each worker process's niceness (``os.nice``; 0 keeps the parent's), as Sample Factory does for its
    rollout workers: the process that acts for the workers, which every one of them waits for, then never waits
    for a core behind one of them. On a loaded machine the envs step a little slower, never the acting."""
    restart: bool = True
    """Restart a failed worker (lenient); False raises :class:`EnvWorkerFault` naming the worker, its envs and
    the fault instead (strict)."""

    def __post_init__(self) -> None:
        if self.step_timeout_s <= 0 or self.start_timeout_s <= 0 or self.max_restarts < 0 or self.torch_threads < 1:
            raise ValueError("timeouts must be > 0, max_restarts >= 0 and torch_threads >= 1")
        if not 0 <= self.niceness <= 19:
            raise ValueError(f"niceness must be in 0..19 (an increment: lowering it needs privileges), "
                             f"got {self.niceness}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {self.start_method!r}")



def step_template(tree: Tree, num_envs: int) -> TensorDict:
    """Zeros in the layout of a protocol step output of ``tree`` (root keys, ``"next"``, flags), batch ``[env]``."""
    base = zeros(tree, [num_envs])
    root, nxt = TensorDict(batch_size=[num_envs]), TensorDict(batch_size=[num_envs])
    for g, spec in groups(tree).items():
        gb = (num_envs, spec.capacity)
        root.set(g, base.get(g).exclude(ACTION))
        group = TensorDict({OBSERVATION: base.get((g, OBSERVATION)).clone(), REWARD: torch.zeros(*gb, 1),
                            MASK: torch.zeros(gb, dtype=torch.bool)}, batch_size=gb)
        for flag in (TERMINATED, TRUNCATED, DONE):
            group.set(flag, torch.zeros(*gb, 1, dtype=torch.bool))
        nxt.set(g, group)
    if SHARED in base.keys():
        root.set(SHARED, base.get(SHARED))
        nxt.set(SHARED, base.get(SHARED).clone())
    for flag in (TERMINATED, TRUNCATED, DONE):
        nxt.set(flag, torch.zeros(num_envs, 1, dtype=torch.bool))
    root.set(NEXT, nxt)
    return root


def truncate_(out: TensorDict, last: TensorDict, sl: slice, tree: Tree) -> None:
    """Ends the episodes of envs ``sl`` of a step ``out`` (:func:`step_template`'s layout) as truncated, with
    ``last`` (their last returned root, batch ``[len(sl)]``) as the final observation: a restarted worker's."""
    nxt = out.get(NEXT)
    for g in groups(tree):
        present = last.get((g, MASK))
        group = nxt.get(g)
        group[sl] = TensorDict({OBSERVATION: last.get((g, OBSERVATION)), REWARD: torch.zeros(*present.shape, 1),
                                TERMINATED: torch.zeros(*present.shape, 1, dtype=torch.bool),
                                TRUNCATED: present.unsqueeze(-1), DONE: present.unsqueeze(-1), MASK: present},
                               batch_size=present.shape)
    if SHARED in last.keys():
        nxt.get(SHARED)[sl] = last.get(SHARED)
    nxt.get(TERMINATED)[sl] = False
    nxt.get(TRUNCATED)[sl] = True
    nxt.get(DONE)[sl] = True


def _write(src: TensorDict, leaves: list) -> None:
    """Copies ``src``'s leaves into the shared buffers ``leaves`` (``[(key tuple, buffer)]``).

    One walk over ``src`` instead of a nested ``get`` per buffer: about half the cost of the copy for a step.
    """
    values = {k if isinstance(k, tuple) else (k,): v for k, v in src.items(True, True)}
    for key, buf in leaves:
        value = values.get(key)
        if value is None and key[-1] == ACTION_MASK:
            buf.fill_(True)  # the env has no action mask: everything is legal
            continue
        if value is None:
            raise KeyError(f"env output lacks {key}")
        buf.copy_(value)


def worker_main(conn, factory: Callable[[], BatchedEnv], threads: int, niceness: int = 0) -> None:
    """Subprocess loop: build the env, then serve ``reset``/``step`` through the shared buffers."""
    # Ctrl-C in a terminal (and a supervisor's SIGTERM to the group) reaches every process of the group: the
    # parent stops after its iteration and closes its workers (or its end of the pipe closes); a worker dead of
    # the signal meanwhile would read as an env fault (strict mode: a traceback instead of a clean stop)
    if threading.current_thread() is threading.main_thread():  # (a test may run the loop in a thread)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if niceness:
        os.nice(niceness)
    try:
        env = factory()
        conn.send(("ready", to_json(env.tree), env.num_envs))
        message = conn.recv()
        if message[0] == "close":  # the pool gave up before sending the buffers
            return
        actions, out = message
        leaves = [(k if isinstance(k, tuple) else (k,), v) for k, v in out.items(True, True)]
        root_leaves = [(k, v) for k, v in leaves if k[0] != NEXT]
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                env.close()
                return
            cut = []  # the envs whose episode the step cut (a lenient repair: adapters.protocol)
            if cmd == "reset":
                _write(env.reset(seed=arg), root_leaves)
            else:
                _write(env.step(clone_td(actions)), leaves)  # the env may keep what it is given
                cut = [int(i) for i in getattr(env, "last_cut", ())]
            conn.send(("ok", dict(env.counters), cut))
    except (EOFError, ConnectionError, KeyboardInterrupt):
        return  # the parent is gone (its end of the pipe closed or reset) or stopping us
    except BaseException:  # noqa: BLE001 - reported to the parent, which restarts us
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass  # the parent went away meanwhile: nobody to tell


class WorkerProcess:
    """The parent's handle on one worker process: its pipe, process and incarnation."""

    def __init__(self, index: int, factory, ctx, config: EnvWorkerConfig) -> None:
        self.index, self.factory, self.incarnation = index, factory, 0
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, factory, config.torch_threads, config.niceness),
                                daemon=True,
                                name=f"shoal-env-worker-{index}")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def collect_replies(workers: list[WorkerProcess], timeout: float) -> dict[int, object]:
    """Waits for one reply per worker; returns ``{index: reply}`` with ``"timeout"``/``"dead"`` for failures."""
    deadline, replies = time.monotonic() + timeout, {}
    pending = {w.conn: w for w in workers}
    while pending:
        ready = wait([*pending, *(w.proc.sentinel for w in pending.values())], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for conn, w in list(pending.items()):
            if conn in ready or w.proc.sentinel in ready:
                try:
                    replies[w.index] = conn.recv() if conn.poll() else ("dead", None)
                except (EOFError, OSError):
                    replies[w.index] = ("dead", None)
                del pending[conn]
    for w in pending.values():
        replies[w.index] = ("timeout", None)
    return replies


def command(workers: list[WorkerProcess], message: Callable[[WorkerProcess], tuple],
            timeout: float) -> dict[int, object]:
    """Sends each worker ``message(worker)``, then waits for one reply each as :func:`collect_replies`. A worker
    whose pipe is closed already (its process died since its last reply) answers ``("dead", None)``."""
    sent, replies = [], {}
    for w in workers:
        try:
            w.conn.send(message(w))
            sent.append(w)
        except (OSError, ValueError):
            replies[w.index] = ("dead", None)
    return {**replies, **collect_replies(sent, timeout)}


def kill_all(workers: list[WorkerProcess]) -> None:
    for w in workers:
        if w.proc.is_alive():
            w.proc.kill()


class EnvWorkerFault(RuntimeError):
    """A worker hung, died or raised, and the pool was told not to restart it (``EnvWorkerConfig.restart``).

    Attributes:
        env_output: the worker's env returned data that breaks its tree (an ``EnvOutputError`` raised in the
            worker: the env's author's to mend, as in one process), else False.
    """

    env_output: bool = False


__all__ = ["EnvWorkerConfig", "EnvWorkerFault", "WorkerProcess", "collect_replies", "command", "kill_all",
           "step_template", "worker_main"]
