"""Preallocated fragment storage for one step leaf: each step is copied into its time slot as it comes.

:class:`core.buffers.steps.StepLayout` keeps a step leaf as a list of references and stacks the list at the
fragment boundary: one op per leaf and fragment, the cheapest for the small tensors of small env batches. A
leaf of at least :data:`PREALLOCATE_BYTES` per step (from about 128 envs on) is stored here instead:

- a large leaf (observations) would be held twice over at the boundary (the steps until the stack has copied
  them all);
- the steps' tensors, kept among the blocks the policy frees every step (its activations), fragment the
  allocator's heap: each kept block splits a freed activation block, so the next step's activations no longer
  fit there and the heap grows, by an amount that changed from run to run (``benchmarks/transition_memory.py``
  measures the peak against the fragment's bytes).

A :class:`TimeSlots` holds the fragment once: storage for ``capacity`` steps, allocated when a step first
differs from the first step, each step copied into its slot (the step's own tensor is freed at once and its
block reused by the next step), handed over whole at the boundary. A leaf that is the same tensor object at
every step (constant masks and flags) is never copied: it becomes one broadcast copy at the boundary.

Layout: rows of at most 8 bytes per env (flags, actions, rewards) are stored time-major, ``[T, E, ...]``:
each step is one contiguous write, and the fragment is transposed to ``[E, T, ...]`` once at the boundary
(as :func:`core.buffers.steps._stack_time` does for lists). Wider rows (observations) are stored ``[E, T, ...]``
and written in place (what ``torch.stack(dim=1)`` writes, one step at a time).
"""

from __future__ import annotations

import torch

#: A step leaf of at least this many bytes is stored in preallocated slots (smaller ones stay lists).
PREALLOCATE_BYTES = 1024
_SMALL_ROW_BYTES = 8


class TimeSlots:
    """One leaf's steps ``[E, ...]`` in storage for ``capacity`` steps (grown by doubling past it).

    The list operations :class:`core.buffers.steps.StepLayout` uses: ``append``, ``len``, ``clear``; plus
    :meth:`truncate_` (drop steps after an error) and :meth:`stacked` (the fragment's ``[E, T, ...]``).

    Args:
        path: the leaf's key path, for error messages.
        capacity: steps the storage holds before it grows (the fragment length).
    """

    __slots__ = ("path", "capacity", "_data", "_views", "_first", "_count", "_time_major", "_shape", "_dtype")

    def __init__(self, path: tuple[str, ...], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"TimeSlots capacity must be >= 1, got {capacity}")
        self.path, self.capacity = path, capacity
        self._data: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, ...] = ()  # one view per slot: a step's write is one copy_
        self._first: torch.Tensor | None = None  # the first step, held by reference until a step differs
        self._count = 0
        self._time_major = False
        self._shape: torch.Size | None = None
        self._dtype: torch.dtype | None = None

    def __len__(self) -> int:
        return self._count

    def append(self, x: torch.Tensor) -> None:
        """Copies step ``x`` ``[E, ...]`` into the next slot; a shape or dtype other than the first step's
        raises ValueError naming the key (nothing is written).

        Until a step brings another tensor object than the first step's, no storage is allocated and nothing is
        copied: envs hand out the same constant tensor (masks, never-set flags) at every step."""
        t = self._count
        if self._data is None:
            if t == 0:
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"step key {self.path} holds {type(x).__name__}, expected a tensor")
                self._first, self._shape, self._dtype, self._count = x, x.shape, x.dtype, 1
                return
            if x is self._first:
                self._count = t + 1
                return
            self._check(x, t)
            self._allocate(x, t)
        elif t >= len(self._views):
            self._check(x, t)
            self._allocate(x, t)
        elif x.__class__ is not torch.Tensor or x.shape != self._shape or x.dtype != self._dtype:
            self._check(x, t)
        self._views[t].copy_(x)
        self._count = t + 1

    def _check(self, x: object, t: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"step key {self.path} holds {type(x).__name__}, expected a tensor")
        if x.shape != self._shape or x.dtype != self._dtype:
            raise ValueError(f"cannot store step key {self.path}: {x.dtype} {tuple(x.shape)} at step {t}, "
                             f"the fragment's earlier steps are {self._dtype} {tuple(self._shape)}")

    def truncate_(self, num_steps: int) -> None:
        """Keeps the first ``num_steps`` steps."""
        self._count = min(self._count, num_steps)
        if self._count == 0:
            self.clear()

    def clear(self) -> None:
        """Drops every step; the next fragment gets storage of its own (the last one was handed over)."""
        self._data, self._views, self._first, self._count = None, (), None, 0

    def stacked(self, consume: bool) -> torch.Tensor:
        """The steps so far as one contiguous ``[E, T, ...]`` tensor. ``consume``: the steps go (as by
        :meth:`clear`): whole ``[E, T, ...]`` storage is handed over (it becomes the fragment's), time-major storage is
        dropped once transposed; else a copy (the steps stay). A leaf that was the same tensor at every step
        becomes one broadcast copy of it."""
        t = self._count
        if t == 0:
            raise ValueError(f"no steps of key {self.path} to stack")
        if self._data is None:
            first = self._first
            if consume:
                self.clear()
            # always a copy (contiguous() of a one-step expand would alias the step's tensor)
            return first.unsqueeze(1).expand(first.shape[0], t, *first.shape[1:]).clone(
                memory_format=torch.contiguous_format)
        if self._time_major:
            part = self._data[:t]
            if consume:  # dropped now, not at clear(): a boundary holds one leaf's storage twice, not every leaf's
                self.clear()
            return part.transpose(0, 1).contiguous()  # a copy either way
        whole = t == self._data.shape[1]
        if consume and whole:
            data = self._data
            self.clear()
            return data
        part = self._data[:, :t].clone(memory_format=torch.contiguous_format)
        if consume:
            self.clear()
        return part

    def _allocate(self, x: torch.Tensor, t: int) -> None:
        """Storage for the steps: at the first step that differs from the first one (the ``t`` steps so far
        are copies of it), or twice the size when full (rare; only a caller that builds late)."""
        if self._data is None:
            e = x.shape[0] if x.dim() else 0
            self._time_major = bool(e) and 0 < x.numel() // e * x.element_size() <= _SMALL_ROW_BYTES
            size = max(self.capacity, t + 1)
        else:
            size = 2 * self._data.shape[0 if self._time_major else 1]
        shape = (size, *self._shape) if self._time_major else (self._shape[0], size, *self._shape[1:])
        data = torch.empty(shape, dtype=self._dtype, device=x.device)
        if t:
            old = data[:t] if self._time_major else data[:, :t]
            if self._data is None:
                old.copy_(self._first.unsqueeze(0 if self._time_major else 1).expand_as(old))
            else:
                old.copy_(self._data[:t] if self._time_major else self._data[:, :t])
        self._data, self._first = data, None
        self._views = data.unbind(0 if self._time_major else 1)


def preallocates(x: object) -> bool:
    """Whether a step leaf like ``x`` is stored in :class:`TimeSlots` (a tensor of at least
    :data:`PREALLOCATE_BYTES`) rather than a list of references."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.numel() * x.element_size() >= PREALLOCATE_BYTES


__all__ = ["PREALLOCATE_BYTES", "TimeSlots", "preallocates"]
