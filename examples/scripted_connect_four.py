"""A scripted connect-four player for ``shoal evaluate CKPT --opponent scripted:examples.scripted_connect_four:center_first``
(run from the repository root): win now if it can, else block the opponent's immediate win, else play the
legal column nearest the centre. Batched over envs and agents; a few torch ops per column.

PettingZoo's connect four observes ``[6, 7, 2]`` int8 planes (the player's own pieces, the opponent's; row 0
is the top) and masks full columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LINES = [torch.ones(1, 1, 1, 4), torch.ones(1, 1, 4, 1), torch.eye(4).view(1, 1, 4, 4),
          torch.eye(4).flip(-1).view(1, 1, 4, 4)]


def four_in_a_row(board: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: whether ``board`` ``[N, 6, 7]`` (0/1 floats) holds four in a row in any direction."""
    b = board.unsqueeze(1)
    return torch.stack([(F.conv2d(b, k) >= 4).flatten(1).any(1) for k in _LINES]).any(0)


def center_first(observation: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Actions ``[E, A]`` for observations ``[E, A, 6, 7, 2]`` and masks ``[E, A, 7]``."""
    shape = observation.shape[:2]
    planes = observation.reshape(-1, 6, 7, 2).float()
    mine, theirs = planes[..., 0], planes[..., 1]
    legal = action_mask.reshape(-1, 7)
    empty = (mine + theirs) == 0
    rows = torch.arange(1, 7, dtype=torch.float32)
    n = torch.arange(planes.shape[0])
    score = torch.empty(legal.shape)
    for col in range(7):
        landing = (empty[:, :, col].float() * rows).argmax(dim=1)  # the lowest empty row of the column
        score[:, col] = -abs(col - 3)  # centre first
        for board, bonus in ((mine, 100.0), (theirs, 50.0)):  # a winning move, else a block
            after = board.clone()
            after[n, landing, col] = 1.0
            score[:, col] += bonus * four_in_a_row(after).float()
    score[~legal] = -float("inf")
    return score.argmax(dim=1).reshape(shape)
