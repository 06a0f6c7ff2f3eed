"""Training sequences for recurrent policies: ``[E, T]`` batches cut into ``[S, W]`` windows (truncated BPTT).

A fragment row ``[T]`` is cut into chunks of ``length`` steps; each window holds its chunk plus the
``burn_in`` steps before it (R2D2, Kapturowski et al. 2019): those only warm the recurrent state up, from the
state stored with the window's first step, and are masked out of the loss. A fragment's first chunk has no
steps before it, and a last chunk shorter than ``length`` is padded: padded steps repeat a real step (so every
value stays finite) and are masked out too. Every step of the batch is trained exactly once.

Layout of the result (``W = burn_in + length``, ``S = E * ceil(T / length)``)::

    root batch [S]; every entry [S, W, ...] (groups [S, W, A])
    "sequence_start"   [S, W] bool   read the stored recurrent state here (core.layout.SEQUENCE_START)
    (group, "mask")    [S, W, A]     the agent mask and "this step is trained" (not burn-in, not padding)
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from core.layout import EPISODE_ID, MASK, SEQUENCE_START


def sequence_starts(episode_id: torch.Tensor) -> torch.Tensor:
    """Bool ``[E, T]``: True at ``t = 0`` and wherever the episode id changes (an episode starts there).

    Args:
        episode_id: int64 ``[E, T]`` (a fragment's root ``"episode_id"``, or ``[E, T, 1]``).
    """
    ids = episode_id.reshape(episode_id.shape[0], -1)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return start


def split_sequences(batch: TensorDict, length: int, burn_in: int, group: str) -> TensorDict:
    """Cuts ``batch`` ``[E, T]`` into training sequences (module docstring).

    Args:
        batch: ``[E, T]`` with a root ``"episode_id"`` (read for the episode starts) and ``batch[group]``
            ``[E, T, A]``; the entries to keep (drop ``"next"`` first: it is copied like the others).
        length: steps per sequence, >= 1 (``T`` or more: whole rows).
        burn_in: warm-up steps before each sequence, >= 0.
        group: the group whose ``"mask"`` gains the trained-step flag.

    Returns:
        ``[S]`` TensorDict of windows; ``"episode_id"`` is kept, ``"sequence_start"`` added.
    """
    if batch.batch_dims != 2:
        raise ValueError(f"split_sequences needs an [env, time] batch, got batch {list(batch.batch_size)}")
    if length < 1 or burn_in < 0:
        raise ValueError(f"sequence length must be >= 1 and burn_in >= 0, got {length} and {burn_in}")
    e, t = batch.batch_size
    length = min(length, t)
    window = burn_in + length
    chunk_starts = torch.arange(0, t, length)
    offsets = torch.arange(window)
    index = chunk_starts[:, None] - burn_in + offsets[None]  # [C, W] time index of every window step
    valid = (index >= 0) & (index < t)
    trained = valid & (offsets >= burn_in)[None]
    first_valid = (burn_in - chunk_starts).clamp_min(0)  # [C]: the window position of its first real step
    c = chunk_starts.shape[0]
    device = batch.device if batch.device is not None else batch.get(EPISODE_ID).device
    flat_index = index.clamp(0, t - 1).reshape(-1).to(device)
    windows = batch[:, flat_index].reshape(e * c, window)  # [E * C, W], env-major
    start = sequence_starts(windows.get(EPISODE_ID))
    start |= (offsets[None] <= first_valid[:, None]).to(device).repeat(e, 1)
    windows.set(SEQUENCE_START, start)
    g = windows.get(group)
    keep = trained.to(device).repeat(e, 1).unsqueeze(-1).expand(g.batch_size)
    mask = g.get(MASK, None)
    g.set(MASK, keep if mask is None else mask & keep)
    windows.batch_size = windows.batch_size[:1]
    return windows


__all__ = ["sequence_starts", "split_sequences"]
