"""The subprocess side of :mod:`adapters.env_worker`: the step buffer layout and the worker loop.

A worker builds its env from a picklable factory, announces ``(tree JSON, num_envs)``, receives its slices of the
pool's shared-memory buffers (actions; step outputs laid out by :func:`step_template`), then serves ``reset`` and
``step`` commands: it reads actions from the shared buffer and writes the env's output into it, answering
``("ok", counters)`` or ``("error", traceback)`` on the pipe.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch
from tensordict import TensorDict

from core.layout import ACTION, ACTION_MASK, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import Tree, groups, to_json, zeros

from .protocol import BatchedEnv


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


def _write(src: TensorDict, leaves: list) -> None:
    for key, buf in leaves:
        value = src.get(key, None)
        if value is None and key[-1] == ACTION_MASK:
            buf.fill_(True)  # the env has no action mask: everything is legal
            continue
        if value is None:
            raise KeyError(f"env output lacks {key}")
        buf.copy_(value)


def worker_main(conn, factory: Callable[[], BatchedEnv], threads: int) -> None:
    """Subprocess loop: build the env, then serve ``reset``/``step`` through the shared buffers."""
    torch.set_num_threads(threads)
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
            if cmd == "reset":
                _write(env.reset(seed=arg), root_leaves)
            else:
                _write(env.step(actions.clone()), leaves)
            conn.send(("ok", dict(env.counters)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent is gone or stopping us
    except BaseException:  # noqa: BLE001 - reported to the parent, which restarts us
        conn.send(("error", traceback.format_exc()))


__all__ = ["step_template", "worker_main"]
