"""The batched-environment protocol: what the orchestration layer consumes from every adapter.

All envs of a :class:`BatchedEnv` share one tree (``env.tree``, see :mod:`core.specs`) and step together
on TensorDicts in the layout of :mod:`core.layout`. Usage loop::

    obs = env.reset(seed=0)                        # batch [env]: groups {observation, mask, action_mask}, shared
    while training:
        actions = policy(obs)                      # batch [env]: {group: {action: [env, agent, ...]}}
        out = env.step(actions)
        transition = out["next"]                  # consequences of `actions` (the final obs when an episode ended)
        obs = out.exclude("next")                  # what to act on next (reset obs where an episode ended)
    env.close()

``step`` returns, with batch ``[env]`` (``A`` = group capacity)::

    ("next", group, "observation")    [env, A, *obs]  observation after the action (final obs at an episode end)
    ("next", group, "reward")         [env, A, 1] float32
    ("next", group, "terminated"|"truncated"|"done")   [env, A, 1] bool
    ("next", group, "mask")           [env, A] bool   agent present at the step (= root mask of the input step)
    ("next", "shared", ...)           [env, ...]      shared observation after the action, if the tree has one
    ("next", "terminated"|"truncated"|"done")          [env, 1] bool  the env's episode ended
    (group, "observation"|"mask"|"action_mask"), ("shared", ...)   next step to act on: for envs whose episode
                                                      ended this is the first observation of the new episode

Finished envs are reset inside ``step`` (no extra call, no extra transition): the final observation of the
ended episode is kept under ``"next"``, never mixed with the reset observation, and no transition with a
dummy action is ever produced (gymnasium's NEXT_STEP autoreset step is swallowed by the adapter).

The tensors of a step are read-only to consumers (they read them or stack them into fragments): they may
share memory with each other and with earlier steps (the root observation is the ``"next"`` one where no env
was reset; all-True masks are one constant tensor), which saves allocations and copies on every step.

Agents that are absent (not joined, dead, not their turn) have ``mask`` False; their actions are ignored and
never sent to the environment. ``terminated`` of an agent that leaves is True at its last step.

Counters (``env.counters``) accumulate what the adapter had to fix, for honest accounting: e.g.
``{"invalid_output_truncations": 2, "env_restarts": 0}``. An adapter that ends episodes for a fault (lenient
mode's repairs, a restarted env process) says which after each ``step`` in ``last_cut``: the env indices whose
episode that step cut (empty, or absent, when none): they train as truncated, but their partial returns are
not completed episodes and stay out of the return statistics.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tensordict import TensorDict

from core.specs import Tree


@runtime_checkable
class BatchedEnv(Protocol):
    """A batch of ``num_envs`` environments with one tree, stepped together (see the module doc)."""

    @property
    def tree(self) -> Tree:
        """The observation/action tree shared by all envs."""
        ...

    @property
    def num_envs(self) -> int:
        """Number of envs in the batch."""
        ...

    @property
    def counters(self) -> dict[str, int]:
        """Running counts of repaired or lost data (invalid outputs truncated, env restarts, ...)."""
        ...

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every env (env ``i`` seeded ``seed + i``) and returns the first step to act on, batch ``[env]``."""
        ...

    def step(self, actions: TensorDict) -> TensorDict:
        """Applies ``actions`` (batch ``[env]``) and returns ``"next"`` plus the next step to act on."""
        ...

    def close(self) -> None:
        """Releases processes and resources; idempotent."""
        ...


__all__ = ["BatchedEnv"]
