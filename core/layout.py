"""The one data layout of Shoal, written down once.

A *step* is a TensorDict with batch ``[env]``; a *fragment* or *rollout* is ``[env, time]``.

Agents live in **groups**: ``td[group]`` has batch ``[env, time, agent]`` (``[env, agent]`` for one step).
A group stacks agents that share observation and action spaces, so one forward pass serves all of them.
Absent agents (not joined yet, dead, not their turn) are padded and carry ``(group, MASK) == False``.

Keys of one transition (``E`` envs, ``T`` steps, ``A`` agents of the group)::

    (group, "observation", ...)       [E, T, A, *obs]   observation tree of the agent (leaf or sub-TensorDict)
    (group, "action", ...)            [E, T, A, *act]   action tree (leaf or sub-TensorDict)
    (group, "mask")                   [E, T, A]  bool   agent present at t (acts and is trained on)
    (group, "action_mask")            [E, T, A, n] bool legal discrete actions (optional; one discrete leaf)
    (group, "action_mask", *leaf)     [E, T, A, n] bool per-leaf form, for a dict action: keyed like the action
                                                        tree, one entry per discrete (n) / multi-discrete
                                                        (sum(nvec)) leaf; a leaf conditioned on leaf X
                                                        (``DictNode.conditional``) takes a table
                                      [E, T, A, n_X, n] bool  row x = its legal values when X chose x
    (group, "action_mask", "@present", *element)
                                      [E, T, A] bool    non-atomic dict (``DictNode(atomic=False)``): the env
                                                        executes that element at t; absent ones add nothing
                                                        to log_prob and entropy (missing key: present)
    (group, "log_prob")               [E, T, A, 1]      behaviour log-probability of the action
    (group, "state_value")            [E, T, A, 1]      critic value at t (filled by the learner or actor)
    ("shared", ...)                   [E, T, *]         population-level shared observations (global state)
    ("next", group, "observation")    [E, T, A, *obs]   observation after the step (the *final* one at an end)
    ("next", group, "reward")         [E, T, A, 1]
    ("next", group, "terminated")     [E, T, A, 1] bool true end for this agent: no bootstrap
    ("next", group, "truncated")      [E, T, A, 1] bool cut (time limit, fragment end, fault): bootstrap
    ("next", group, "done")           [E, T, A, 1] bool terminated | truncated
    ("next", "terminated"|"truncated"|"done")  [E, T, 1]  the env-level flags (episode of the env ended)

Fragment metadata (root, ``[E, T]``; constant along time, so fragments concatenate along ``env``)::

    ("policy_version", group)  int64  version of the policy that acted for that group
    "worker_id"                int64
    "fragment_id"              int64  (worker_id << 32) | sequence number: unique across the run
    "episode_id"               int64  id of the env's episode at that step (unique per worker)
    "env_id"                   int64  index of the env inside its worker

``terminated``, ``truncated`` and ``done`` are never merged into one flag. Per-sample scalars keep a
trailing 1. Functions check shapes on entry instead of broadcasting.
"""

from __future__ import annotations

import torch

NEXT = "next"
OBSERVATION = "observation"
ACTION = "action"
MASK = "mask"
ACTION_MASK = "action_mask"
#: Under a per-leaf ``ACTION_MASK`` tree: the presence masks of non-atomic elements. Not a valid child name
#: (:mod:`core.specs.nodes` names are letters, digits, ``_``, ``-``), so it never collides with an action leaf.
ACTION_PRESENT = "@present"
LOG_PROB = "log_prob"
STATE_VALUE = "state_value"
REWARD = "reward"
DONE = "done"
TERMINATED = "terminated"
TRUNCATED = "truncated"
SHARED = "shared"
ADVANTAGE = "advantage"
VALUE_TARGET = "value_target"
ENTROPY = "entropy"
RECURRENT_STATE = "recurrent_state"
#: Training sequences only (:func:`core.buffers.sequences.split_sequences`), root ``[S, W]`` bool: steps whose
#: recurrent state is read from the stored one (a sequence's first step, every episode start) instead of carried.
SEQUENCE_START = "sequence_start"
#: Actor-side only: the action-head parameters an actor records per step instead of ``LOG_PROB`` when the
#: heads can compute the log-probability from them afterwards; never part of a finished fragment.
ACTION_PARAMS = "action_params"

#: Learner-side only, in a group entry ``[*B, A]`` bool: which agents are present, read by a central or joint
#: critic instead of ``MASK`` where a learner narrowed ``MASK`` to the slots its policy trains (a group split
#: between policies): the critic then sees the same agents at every step and at every next step. Never in a fragment.
CRITIC_MASK = "critic_mask"

POLICY_VERSION = "policy_version"
WORKER_ID = "worker_id"
FRAGMENT_ID = "fragment_id"
EPISODE_ID = "episode_id"
ENV_ID = "env_id"
#: Learner-side only, root ``[E, T]`` bool: rows of fragments trained on for the first time, so that running
#: statistics (observation normalisers, curiosity's moments) count a fragment reused in later batches once.
FRESH = "_shoal_fresh"
#: Learner-side only, root: group -> ``[E, T, A]`` discounted returns of a fragment's reward stream and the rows
#: reward scaling counts (:meth:`orchestration.reward_scaling.ReturnStreams.annotated`).
STREAM_RETURNS = "_shoal_stream_returns"

#: Root-level keys that are not agent groups.
RESERVED_ROOT_KEYS = frozenset(
    {NEXT, SHARED, POLICY_VERSION, WORKER_ID, FRAGMENT_ID, EPISODE_ID, ENV_ID, DONE, TERMINATED, TRUNCATED,
     SEQUENCE_START, FRESH, STREAM_RETURNS}
)


_ALL_TRUE = "_shoal_all_true"


def all_true(*shape: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A bool tensor of ``True`` marked as known all-True (:func:`is_all_true`).

    Envs hand one such constant to every step for masks that allow everything ("every action legal", "every
    agent present"); a policy then skips masking, which saves tensor ops on every acting step. Step tensors
    are read-only to consumers, so the mark stays true; copies (stacked fragments) carry no mark.
    """
    out = torch.ones(*shape, dtype=torch.bool, device=device)
    setattr(out, _ALL_TRUE, True)
    return out


def is_all_true(t) -> bool:
    """Whether ``t`` is a tensor made by :func:`all_true` (a cheap attribute test, no tensor op)."""
    return getattr(t, _ALL_TRUE, False)


def group_names(td) -> list[str]:
    """Names of the agent groups of a step/fragment TensorDict (root keys that are not reserved)."""
    return [k for k in td.keys() if k not in RESERVED_ROOT_KEYS and not isinstance(k, tuple)]


def group_of(td, group: str):
    """``td[group]``; a KeyError naming ``group`` and the groups ``td`` has when it has none of that name."""
    value = td.get(group, None)
    if value is None:
        raise KeyError(f"no agent group {group!r} in the TensorDict (its groups: {group_names(td)})")
    return value


def make_fragment_id(worker_id: int, sequence: int) -> int:
    """A run-unique fragment id: ``worker_id`` in the high 32 bits, the worker's sequence number below."""
    if not (0 <= worker_id < 2**31 and 0 <= sequence < 2**32):
        raise ValueError(f"worker_id {worker_id} or sequence {sequence} out of range for a fragment id")
    return (worker_id << 32) | sequence
