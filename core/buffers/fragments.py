"""Fragment assembly: per-step plain dicts of tensors in, one ``[env, time]`` TensorDict out.

The sampling loop hands one *step* per env step as a plain nested ``dict`` of tensors (batch ``[env]``,
groups ``[env, agent]``), laid out as in :mod:`core.layout` minus the time dim, e.g.::

    {"agents": {"observation": [E, A, *obs], "action": ..., "mask": [E, A], "log_prob": [E, A, 1]},
     "shared": {...},                                         # optional, [E, *]
     "next": {"agents": {"observation", "reward", "terminated", "truncated", "done"},
              "done": [E, 1], "terminated": [E, 1], "truncated": [E, 1]}}

A nested node may also be a plain ``TensorDict`` (e.g. an env's ``"next"`` output as it came): its own key
dict is walked, nothing is converted. No TensorDict is built per step: :class:`FragmentBuilder` appends the
leaves to per-key lists and, at the
fragment boundary, runs one ``torch.stack(dim=1)`` per key and wraps the result once in a TensorDict with
explicit group batch sizes (notes/tensordict-hot-paths.md, patterns 1-3). ``add_step_`` stores
*references*: a caller must hand fresh tensors each step, not refill the same buffers in place.

Fragment boundary (ARCHITECTURE: "a fragment boundary is not an episode end"). A fragment holds
``T`` transitions; its bootstrap step is ``fragment["next"][:, -1]`` (:func:`bootstrap_step`), the
observation after the last action. No flag is set at the boundary: ``("next", "truncated")`` stays False
when the episode goes on. GAE and V-trace (torchrl functional, ``time_dim`` = 1) end every row at ``T - 1``
anyway and bootstrap there from ``next_state_value * (1 - terminated)``, so a continuing episode is cut
with truncation *semantics* without a flag. Rows of concatenated fragments (``concat_fragments``, along
``env``) stay separate, so nothing leaks between fragments; consecutive fragments of one env joined along
time would also be correct, because ``("next", obs)`` at ``T - 1`` equals the next fragment's first obs.

Recurrent state (seed 001's ``extras``) is an ordinary per-step leaf, e.g. ``(group, "recurrent_state")``
``[E, A, *h]``: stored at every step, like seed 001's per-step extras lists, so the state at a fragment's
first step is ``fragment[group, "recurrent_state"][:, 0]``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDict

from core.buffers.steps import StepLayout
from core.buffers.tracking import EpisodeTracker
from core.layout import (
    DONE,
    ENV_ID,
    EPISODE_ID,
    FRAGMENT_ID,
    NEXT,
    POLICY_VERSION,
    TRUNCATED,
    WORKER_ID,
    make_fragment_id,
)

#: Keys that :meth:`FragmentBuilder.build` writes; a step must not carry them.
METADATA_KEYS = frozenset({POLICY_VERSION, WORKER_ID, FRAGMENT_ID, EPISODE_ID, ENV_ID})


class FragmentBuilder:
    """Accumulates steps of ``num_envs`` envs into fragments. The only stateful piece of core/buffers.

    State: per-key lists of the current fragment's leaves, the key layout captured from the first step,
    the fragment sequence number and an :class:`EpisodeTracker` (per-env episode ids and running
    returns across fragments). Everything else is a pure function.

    Args:
        num_envs: ``E``, the env batch of every step.
        worker_id: id of the owning rollout worker (fragment metadata, high bits of ``fragment_id``).
        group_sizes: agent count ``A`` per group; inferred from the first step's leaf shapes
            (``[E, A, ...]``) when None, and checked against them when given.
        track_episodes: keep episode returns/lengths and collect completed-episode records
            (:meth:`pop_completed_episodes`); episode ids are tracked either way.
        fragment_length: the steps of a fragment, if known: large step leaves (about a thousand envs and
            more) are then copied into storage preallocated for that many steps (:mod:`core.buffers.time_slots`),
            so a fragment is held once, not as references plus their stack.
    """

    def __init__(
        self,
        num_envs: int,
        *,
        worker_id: int = 0,
        group_sizes: Mapping[str, int] | None = None,
        track_episodes: bool = True,
        fragment_length: int | None = None,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        make_fragment_id(worker_id, 0)  # validates the range once
        self.num_envs = num_envs
        self.worker_id = worker_id
        self.sequence = 0
        """Sequence number of the next fragment (low 32 bits of its ``fragment_id``)."""
        self.tracker = EpisodeTracker(num_envs)
        self.track_episodes = track_episodes
        self._declared_sizes = dict(group_sizes or {})
        self.fragment_length = fragment_length
        self._layout: StepLayout | None = None
        self._num_steps = 0
        self._completed: dict[str, list[TensorDict]] = {}
        self._cut: list[tuple[int, torch.Tensor]] = []  # (step, env rows) of this fragment's cut episodes

    def __len__(self) -> int:
        """Number of steps in the current (unbuilt) fragment."""
        return self._num_steps

    @property
    def group_sizes(self) -> dict[str, int]:
        """Agent count per group (complete after the first step)."""
        return dict(self._layout.group_sizes if self._layout is not None else self._declared_sizes)

    def add_step_(self, step: Mapping) -> None:
        """Appends one step (plain nested dict of ``[E, ...]`` / ``[E, A, ...]`` tensors; see module doc).

        The key layout is captured from the first step ever added; a later step with a missing or extra
        key raises ``KeyError`` naming it and is not added. Shapes are checked in full on the first step
        only; a later shape change surfaces at :meth:`build`, naming the key.
        """
        if self._layout is None:
            nxt = step.get(NEXT)
            if not isinstance(nxt, dict) and type(nxt) is not TensorDict or DONE not in nxt.keys():
                raise KeyError(f"a step needs the env-level ({NEXT!r}, {DONE!r}) flag [E, 1]")
            if METADATA_KEYS & set(step):
                raise KeyError(f"step carries metadata keys {sorted(METADATA_KEYS & set(step))}: build sets them")
            self._layout = StepLayout(step, self.num_envs, self._declared_sizes, self.fragment_length)
        self._layout.collect_(step, self._num_steps)
        self._num_steps += 1

    def mark_cut_(self, rows) -> None:
        """Marks the episodes of env ``rows`` (indices) that the last added step ended as cut: ended by a fault
        (an env restarted, an output repaired), not by the env. They train as truncated episodes do, but they
        are not completed episodes: their partial returns stay out of :meth:`pop_completed_episodes`."""
        if self._num_steps == 0:
            raise ValueError("mark_cut_ marks the last added step's episodes: add a step first")
        self._cut.append((self._num_steps - 1, torch.as_tensor(rows, dtype=torch.int64).reshape(-1)))

    def peek(self) -> TensorDict:
        """The steps added so far, stacked to ``[E, t]``, without metadata. Changes no state."""
        if self._num_steps == 0:
            raise ValueError("no steps added since the last build")
        return self._layout.wrap(self._layout.stack(), self._num_steps)

    def build(self, policy_version: int | Mapping[str, int], *, end_episodes: torch.Tensor | None = None) -> TensorDict:
        """Stacks the current fragment into a ``[E, T]`` TensorDict with metadata, and starts a new one.

        Args:
            policy_version: version of the policy that acted, one int for all groups or one per group.
            end_episodes: optional ``[E]`` bool: envs whose episode the *caller* ends at the last step
                (a fault, a peer that vanished, seed 001's ``end_episode``). Where not already done, their
                ``("next", "truncated")`` and ``("next", "done")`` at ``T - 1`` are set, at env level and for
                every agent. Without it, the boundary sets no flag (see the module docstring).

        Returns:
            The fragment: the step keys stacked to ``[E, T, ...]`` (groups ``[E, T, A]``) plus
            ``(POLICY_VERSION, group)``, ``WORKER_ID``, ``FRAGMENT_ID``, ``EPISODE_ID``, ``ENV_ID``, all
            ``[E, T]`` int64 on the steps' device. ``EPISODE_ID`` is ``env + E * k`` for the env's ``k``-th
            episode: unique per worker, and it changes exactly after a step whose ``("next", "done")`` is set.
        """
        if self._num_steps == 0:
            raise ValueError("no steps added since the last build")
        e, t = self.num_envs, self._num_steps
        groups = self._layout.group_sizes
        if isinstance(policy_version, Mapping):  # checked before the steps are consumed
            missing = set(groups) - set(policy_version)
            if missing:
                raise KeyError(f"policy_version has no entry for groups {sorted(missing)}")
            versions = {g: policy_version[g] for g in groups}
        else:
            versions = dict.fromkeys(groups, policy_version)
        td = self._layout.wrap(self._layout.stack(consume=True), t)  # each leaf's steps dropped once stacked
        if end_episodes is not None:
            _end_episodes_(td, end_episodes.to(device=td.get((NEXT, DONE)).device, dtype=torch.bool).reshape(e))
        done = td.get((NEXT, DONE)).reshape(e, t)
        dev = done.device
        td.set(POLICY_VERSION, TensorDict({g: torch.full((e, t), int(v), device=dev) for g, v in versions.items()}, [e, t]))
        td.set(WORKER_ID, torch.full((e, t), self.worker_id, device=dev))
        td.set(FRAGMENT_ID, torch.full((e, t), make_fragment_id(self.worker_id, self.sequence), device=dev))
        td.set(EPISODE_ID, self.tracker.episode_ids(done))
        td.set(ENV_ID, torch.arange(e, device=dev).unsqueeze(1).repeat(1, t))
        if self.track_episodes:
            cut = _cut_mask(self._cut, e, t, dev) if self._cut else None  # [E, T]; a cut ends its episode
            for group, records in self.tracker.update_(td).items():
                if cut is not None:  # the records ending at a cut step of their env are left out
                    records = records[~cut[records.get(ENV_ID), records.get("end_time")]]
                self._completed.setdefault(group, []).append(records)
        else:
            self.tracker.advance_ids_(done)
        self.sequence += 1
        self.clear_()
        return td

    def clear_(self) -> None:
        """Drops the steps added since the last build (layout, sequence and episode state are kept)."""
        if self._layout is not None:
            self._layout.clear_()
        self._num_steps = 0
        self._cut = []

    def pop_completed_episodes(self) -> dict[str, TensorDict]:
        """Records (``[K]``, see ``scan_episodes``) of episodes that ended since the last pop, per group.

        Accumulates until popped: an actor should pop at its reporting cadence.
        """
        out = {g: torch.cat(parts, 0) for g, parts in self._completed.items()}
        self._completed = {}
        return out


def _cut_mask(cut: list[tuple[int, torch.Tensor]], e: int, t: int, device) -> torch.Tensor:
    """``[E, T]`` bool: True at each (env, step) that :meth:`FragmentBuilder.mark_cut_` marked."""
    mask = torch.zeros(e, t, dtype=torch.bool)
    for step, rows in cut:
        mask[rows, step] = True
    return mask.to(device)


def _end_episodes_(td: TensorDict, end: torch.Tensor) -> None:
    """Sets truncated/done at ``T - 1`` where ``end`` and not already done (env level and all agents)."""
    nxt = td.get(NEXT)
    done = nxt.get(DONE)[:, -1]  # [E, 1]; a view into the freshly stacked tensor
    cut = end.reshape(done.shape) & ~done
    if TRUNCATED in nxt.keys():
        nxt.get(TRUNCATED)[:, -1] |= cut
    done |= cut
    for key, sub in nxt.items():
        if isinstance(sub, TensorDict) and DONE in sub.keys():
            g_done = sub.get(DONE)[:, -1]  # [E, A, 1]
            g_cut = end.reshape(-1, 1, 1) & ~g_done
            if TRUNCATED in sub.keys():
                sub.get(TRUNCATED)[:, -1] |= g_cut
            g_done |= g_cut


def bootstrap_step(fragment: TensorDict) -> TensorDict:
    """The bootstrap step of a fragment: ``fragment["next"][:, -1]``, batch ``[E]`` (groups ``[E, A]``).

    Holds the observation after the last action and its flags. A learner evaluates its critic there and
    bootstraps where ``("next", group, "terminated")`` is False (a continuing episode, or a truncation).
    Critics usually run on all of ``("next", group, "observation")`` ``[E, T, A]``, which contains it.
    """
    return fragment.get(NEXT)[:, -1]
