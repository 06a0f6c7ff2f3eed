"""Preallocated fragment storage for one large step leaf: each step is copied into its time slot as it comes.

:class:`core.buffers.steps.StepLayout` keeps a step leaf as a list of references and stacks the list at the
fragment boundary: one op per leaf and fragment, the cheapest for the small tensors of small env batches. A
large leaf (at least :data:`PREALLOCATE_BYTES` per step: a CartPole observation from 1,024 envs on) would be
held twice over at the boundary (the steps until the stack has copied them all), and the steps' tensors, kept
among the blocks the policy frees every step, fragment the allocator's heap (at 1,024 envs it kept 20 MB free
beside a 6 MB fragment). A :class:`TimeSlots` holds the fragment once: storage for ``capacity`` steps,
allocated at the first step, each step copied into its slot (the step's own tensor is freed at once and its
block reused by the next step), handed over whole at the boundary.

Layout: rows of at most 8 bytes per env (flags, actions, rewards) are stored time-major, ``[T, E, ...]``:
each step is one contiguous write, and the fragment is transposed to ``[E, T, ...]`` once at the boundary
(as :func:`core.buffers.steps._stack_time` does for lists). Wider rows (observations) are stored ``[E, T, ...]``
and written in place (what ``torch.stack(dim=1)`` writes, one step at a time).
"""

from __future__ import annotations

import torch

#: A step leaf of at least this many bytes is stored in preallocated slots (smaller ones stay lists).
PREALLOCATE_BYTES = 16 * 1024
_SMALL_ROW_BYTES = 8


class TimeSlots:
    """One leaf's steps ``[E, ...]`` in storage for ``capacity`` steps (grown by doubling past it).

    The list operations :class:`core.buffers.steps.StepLayout` uses: ``append``, ``len``, ``clear``; plus
    :meth:`truncate_` (drop steps after an error) and :meth:`stacked` (the fragment's ``[E, T, ...]``).

    Args:
        path: the leaf's key path, for error messages.
        capacity: steps the storage holds before it grows (the fragment length).
    """

    __slots__ = ("path", "capacity", "_data", "_count", "_time_major", "_shape", "_dtype")

    def __init__(self, path: tuple[str, ...], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"TimeSlots capacity must be >= 1, got {capacity}")
        self.path, self.capacity = path, capacity
        self._data: torch.Tensor | None = None
        self._count = 0
        self._time_major = False
        self._shape: torch.Size | None = None
        self._dtype: torch.dtype | None = None

    def __len__(self) -> int:
        return self._count

    def append(self, x: torch.Tensor) -> None:
        """Copies step ``x`` ``[E, ...]`` into the next slot; a shape or dtype other than the first step's
        raises ValueError naming the key (nothing is written)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"step key {self.path} holds {type(x).__name__}, expected a tensor")
        t = self._count
        if self._data is None or t >= self._data.shape[0 if self._time_major else 1]:
            self._allocate(x, t)
        if x.shape != self._shape or x.dtype != self._dtype:
            raise ValueError(f"cannot store step key {self.path}: {x.dtype} {tuple(x.shape)} at step {t}, "
                             f"the fragment's earlier steps are {self._dtype} {tuple(self._shape)}")
        (self._data[t] if self._time_major else self._data[:, t]).copy_(x)
        self._count = t + 1

    def truncate_(self, num_steps: int) -> None:
        """Keeps the first ``num_steps`` steps."""
        self._count = min(self._count, num_steps)

    def clear(self) -> None:
        """Drops every step; the next fragment gets storage of its own (the last one was handed over)."""
        self._data, self._count = None, 0

    def stacked(self, consume: bool) -> torch.Tensor:
        """The steps so far as one contiguous ``[E, T, ...]`` tensor. ``consume``: the steps go (:meth:`clear`
        follows): ``[E, T, ...]`` storage is handed over (it becomes the fragment's), time-major storage is
        dropped once transposed; else a copy (the steps stay)."""
        if self._data is None or self._count == 0:
            raise ValueError(f"no steps of key {self.path} to stack")
        t = self._count
        if self._time_major:
            part = self._data[:t]
            if consume:  # dropped now, not at clear(): a boundary holds one leaf's storage twice, not every leaf's
                self._data, self._count = None, 0
            return part.transpose(0, 1).contiguous()  # a copy either way
        whole = t == self._data.shape[1]
        if consume and whole:
            data, self._data = self._data, None
            return data
        return self._data[:, :t].clone(memory_format=torch.contiguous_format)

    def _allocate(self, x: torch.Tensor, t: int) -> None:
        if self._data is None:
            e = x.shape[0] if x.dim() else 0
            self._shape, self._dtype = x.shape, x.dtype
            self._time_major = bool(e) and 0 < x.numel() // e * x.element_size() <= _SMALL_ROW_BYTES
            size = max(self.capacity, t + 1)
        else:  # more steps than the fragment length: double (rare; only a caller that builds late)
            size = 2 * self._data.shape[0 if self._time_major else 1]
        shape = (size, *self._shape) if self._time_major else (self._shape[0], size, *self._shape[1:])
        data = torch.empty(shape, dtype=self._dtype, device=x.device)
        if self._data is not None and t:
            (data[:t] if self._time_major else data[:, :t]).copy_(
                self._data[:t] if self._time_major else self._data[:, :t])
        self._data = data


def preallocates(x: object) -> bool:
    """Whether a step leaf like ``x`` is stored in :class:`TimeSlots` (a tensor of at least
    :data:`PREALLOCATE_BYTES`) rather than a list of references."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.numel() * x.element_size() >= PREALLOCATE_BYTES


__all__ = ["PREALLOCATE_BYTES", "TimeSlots", "preallocates"]
