"""Whether weights handed to a policy fit it (:func:`check_weights`): the same keys, shapes and dtypes, all
finite. A league or a user swapping frozen weights in gets the key at fault named, not a tensordict error deep
in an update (or, for an empty TensorDict, a new version with nothing loaded)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


def check_weights(expected: TensorDictBase, given: TensorDictBase, what: str = "the weights") -> None:
    """Raises ValueError naming the first key of ``given`` that does not fit ``expected`` (a policy's
    ``TensorDict.from_module``): one missing or unknown, another shape or dtype, a NaN or infinite value."""
    want = {k: v for k, v in expected.items(include_nested=True, leaves_only=True)}
    got = {k: v for k, v in given.items(include_nested=True, leaves_only=True)}
    missing, unknown = sorted(map(str, set(want) - set(got))), sorted(map(str, set(got) - set(want)))
    if missing or unknown:
        raise ValueError(f"{what} do not fit the policy: missing {missing[:3]}{'...' * (len(missing) > 3)}, unknown "
                         f"{unknown[:3]}{'...' * (len(unknown) > 3)} (TensorDict.from_module of a policy built for "
                         f"the same tree and PolicyConfig has every key)")
    for key, value in want.items():
        other = got[key]
        if other.shape != value.shape or other.dtype != value.dtype:
            raise ValueError(f"{what} do not fit the policy: {key} is {other.dtype} {list(other.shape)}, the policy's "
                             f"is {value.dtype} {list(value.shape)}")
        if other.is_floating_point() and not bool(torch.isfinite(other).all()):
            raise ValueError(f"{what} hold a NaN or infinite value at {key}")


__all__ = ["check_weights"]
