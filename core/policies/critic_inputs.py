"""What a multi-agent critic reads: the per-agent input of a central critic, the per-env input of a joint one.

Shapes (``A`` agent slots, ``F`` the encoding of one agent's observation, ``S`` the encoded shared observation)::

    own      [*B, A, F]       every agent's own encoding
    present  [*B, A] bool     agents present (absent ones are zeroed), or None: all
    shared   [*B, S]          or None
    central  [*B, A, F + A * F + S]   [own, every agent's, shared] for each agent
    joint    [*B, A * F + S]          [every agent's, shared], once per env: alike for every agent
"""

from __future__ import annotations

import torch
from torch import Tensor


def every_agent(own: Tensor, present: Tensor | None) -> Tensor:
    """``[*B, A * F]``: the agents' encodings side by side, in slot order, absent agents zeroed."""
    return (own if present is None else own * present.unsqueeze(-1).to(own.dtype)).flatten(-2)


def central_input(own: Tensor, present: Tensor | None, shared: Tensor | None) -> Tensor:
    """``[*B, A, F + A * F + S]``: each agent's own encoding, then every agent's, then the shared observation."""
    lead = own.shape[:-1]
    parts = [own, every_agent(own, present).unsqueeze(-2).expand(*lead, -1)]
    if shared is not None:
        parts.append(shared.unsqueeze(-2).expand(*lead, -1))
    return torch.cat(parts, -1)


def joint_input(own: Tensor, present: Tensor | None, shared: Tensor | None) -> Tensor:
    """``[*B, A * F + S]``: every agent's encoding, then the shared observation; one row per env."""
    every = every_agent(own, present)
    return every if shared is None else torch.cat([every, shared], -1)


__all__ = ["central_input", "every_agent", "joint_input"]
