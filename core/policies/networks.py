"""Building blocks of a group policy: orthogonally initialised MLPs and the observation encoder.

The encoder turns an agent's observation tree into one float vector per agent: every leaf is encoded in
:func:`core.specs.iter_leaves` order (box: cast to float; an image box: a CNN, :class:`ImageEncoder`;
discrete: one-hot of ``n``; multi_discrete: one-hot per component, concatenated; binary: cast to float) and the
pieces are concatenated. Eval-only
leaves are skipped unless the encoder is built for a critic. One-hots are written as ``x == arange`` so the
same code runs under ``torch.export`` (``F.one_hot`` checks its input values, a data-dependent guard).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from core.layout import OBSERVATION
from core.policies.fast_tanh import Tanh
from core.policies.reward_scaling import merge_moments, merge_sums, sums_of
from core.specs import Leaf, Node, iter_leaves

Path = tuple[str, ...]

_ACTIVATIONS = {"tanh": Tanh, "relu": nn.ReLU, "elu": nn.ELU, "silu": nn.SiLU, "gelu": nn.GELU}


def init_linear_(layer: nn.Linear, gain: float) -> nn.Linear:
    """Orthogonal weights with ``gain``, zero bias (37 details, detail 2). Mutates and returns ``layer``."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class OutputLinear(nn.Linear):
    """A policy's or critic's output layer (action-head parameters, values): float32 even under
    ``torch.autocast``. A mixed-precision update (``PPOConfig.compute_dtype``) then reads log-probabilities and
    values at float32 precision, where a bfloat16 tanh-Gaussian mean moved a stored action's log-probability by
    over 10 nats, and values near 100 had steps of 0.5. Its one matmul is a small part of the network's."""

    def forward(self, x: Tensor) -> Tensor:
        device = "cpu" if x.is_cpu else "cuda" if x.is_cuda else x.device.type  # x.device: slower, every step
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return F.linear(x.float(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def mlp(in_features: int, hidden_sizes: Sequence[int], activation: str, gain: float) -> nn.Sequential:
    """``Linear -> activation`` per hidden size (an empty ``Sequential``, the identity, for no hidden layer)."""
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [init_linear_(nn.Linear(in_features, width), gain), _ACTIVATIONS[activation]()]
        in_features = width
    return nn.Sequential(*layers)


def run_layers(layers: nn.Sequential, x: Tensor) -> Tensor:
    """``layers(x)`` calling each layer's ``forward`` directly: skips ``Module.__call__`` (hook dispatch,
    ~2-4 µs per layer), which dominates a 64-wide MLP on a small acting batch. Layers here carry no hooks."""
    for layer in layers:
        x = layer.forward(x)
    return x


def read_path(container, path: Path):
    """``container[path[0]][path[1]]...``: works on TensorDicts and nested plain dicts alike."""
    for key in path:
        container = container[key]
    return container


def _leaf_width(leaf: Leaf) -> int:
    if leaf.kind == "discrete":
        return leaf.n
    if leaf.kind == "multi_discrete":
        return sum(leaf.nvec)
    return math.prod(leaf.shape)


def normalizes(leaf: Leaf, encoded_as_image: bool) -> bool:
    """Whether ``normalize_observations`` standardises ``leaf``: a float vector box, not read by a CNN."""
    return leaf.kind == "box" and leaf.dtype.is_floating_point and not encoded_as_image


def image_layout(leaf: Leaf) -> str | None:
    """``"chw"`` or ``"hwc"`` when ``leaf`` is an image: a 3-D box with 1, 3 or 4 channels first or last and both
    spatial sides >= 8 (channels last wins a tie, as gymnasium and PettingZoo images come); else None."""
    if leaf.kind != "box" or len(leaf.shape) != 3:
        return None
    if leaf.shape[2] in (1, 3, 4) and min(leaf.shape[:2]) >= 8:
        return "hwc"
    if leaf.shape[0] in (1, 3, 4) and min(leaf.shape[1:]) >= 8:
        return "chw"
    return None


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImageEncoder(nn.Module):
    """A CNN from an image leaf ``[*B, C, H, W]`` or ``[*B, H, W, C]`` (uint8 scaled by 1/255, floats as they
    are) to ``[*B, out_features]``. ``arch``: ``"nature"`` (32x8x8/4, 64x4x4/2, 64x3x3/1; 3x3 kernels with
    strides 1, 2, 1 below 36 pixels), or ``"impala"`` (three stacks of conv 3x3, max-pool 3x3/2 and two
    residual blocks, 16/32/32 channels). Images stay uint8 until here: fragments and the wire carry bytes."""

    def __init__(self, leaf: Leaf, layout: str, *, arch: str = "nature", out_features: int = 512) -> None:
        super().__init__()
        self.channels_last = layout == "hwc"
        c, h, w = (leaf.shape[2], *leaf.shape[:2]) if self.channels_last else leaf.shape
        self.scale = 1.0 / 255.0 if leaf.dtype == torch.uint8 else 1.0
        if arch == "impala":
            layers: list[nn.Module] = []
            for out in (16, 32, 32):
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), _Residual(out),
                           _Residual(out)]
                c = out
            layers.append(nn.ReLU())
        elif min(h, w) >= 36:
            layers = [nn.Conv2d(c, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 1),
                      nn.ReLU()]
        else:
            layers = [nn.Conv2d(c, 32, 3, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 1),
                      nn.ReLU()]
        self.convs = nn.Sequential(*layers)
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, c if arch != "impala" else (leaf.shape[2] if self.channels_last
                                                                         else leaf.shape[0]), h, w)).numel()
        self.head = init_linear_(nn.Linear(flat, out_features), math.sqrt(2.0))
        self.out_features = out_features

    def forward(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        lead = x.shape[:-3]
        x = x.reshape(-1, *x.shape[-3:]).to(dtype)
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        if self.scale != 1.0:
            x = x * self.scale
        return torch.relu(self.head(self.convs(x).flatten(1))).reshape(*lead, self.out_features)


class ObservationEncoder(nn.Module):
    """Flattens the leaves of one observation node into ``[*B, out_features]`` floats (module docstring).

    Attributes:
        paths: key path of every encoded leaf, in input order (``()`` for a bare-leaf node).
        leaves: the encoded leaves, same order.
        out_features: width of the encoding.
    """

    def __init__(self, node: Node, *, include_eval_only: bool, name: str = "observation",
                 image_encoder: str = "nature", image_features: int = 512, normalize: bool = False,
                 leaf_encoders: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.name = name
        """What error messages call the node (e.g. ``"group speaker_0: observation"``)."""
        kept = [(p, leaf) for p, leaf in iter_leaves(node) if include_eval_only or not leaf.eval_only]
        self.paths: list[Path] = [p for p, _ in kept]
        self.leaves: list[Leaf] = [leaf for _, leaf in kept]
        #: leaf index (as a string) -> CNN, for image leaves (PolicyConfig.image_encoder)
        self.images = nn.ModuleDict()
        for i, (path, leaf) in enumerate(kept):
            named = "/".join((OBSERVATION, *path))  # as exported programs name it (leaf_encoders' keys)
            arch = (leaf_encoders or {}).get(named, image_encoder)
            layout = image_layout(leaf)
            if named in (leaf_encoders or {}) and arch != "flatten" and layout is None:
                raise ValueError(f"{name}: PolicyConfig.leaf_encoders gives {named} the {arch!r} CNN, but it is "
                                 f"not an image (a 3-D box with 1, 3 or 4 channels and sides >= 8; shape "
                                 f"{leaf.shape}); use 'flatten'")
            if arch != "flatten" and layout is not None:
                self.images[str(i)] = ImageEncoder(leaf, layout, arch=arch, out_features=image_features)
        self.out_features = sum(self.images[str(i)].out_features if str(i) in self.images else _leaf_width(leaf)
                                for i, leaf in enumerate(self.leaves))
        #: leaf indices standardised with running statistics (float vector boxes, not images)
        self.normalized = [i for i, leaf in enumerate(self.leaves)
                           if normalize and normalizes(leaf, str(i) in self.images)]
        for i in self.normalized:  # persistent buffers: saved with the weights, travel with them, exported
            shape = self.leaves[i].shape
            self.register_buffer(f"obs_mean{i}", torch.zeros(shape, dtype=torch.float64))
            self.register_buffer(f"obs_var{i}", torch.ones(shape, dtype=torch.float64))
            self.register_buffer(f"obs_count{i}", torch.zeros((), dtype=torch.float64))
        for i, leaf in enumerate(self.leaves):
            if leaf.kind == "discrete":
                self.register_buffer(f"_arange{i}", torch.arange(leaf.n) + leaf.start, persistent=False)
            elif leaf.kind == "multi_discrete":
                offsets = torch.tensor([0, *leaf.nvec[:-1]]).cumsum(0)
                self.register_buffer(f"_offsets{i}", offsets, persistent=False)
                self.register_buffer(f"_arange{i}", torch.arange(sum(leaf.nvec)), persistent=False)
        only = self.leaves[0] if len(self.leaves) == 1 else None
        #: width of the one 1-D box leaf at the node's root (its encoding is the tensor itself), else None
        self._plain = (only.shape[0] if only is not None and self.paths[0] == () and only.kind == "box"
                       and len(only.shape) == 1 and not self.normalized else None)

    def encode(self, observation, dtype: torch.dtype = torch.float32) -> Tensor:
        """``forward(read(observation))``; a plain 1-D float observation is returned as is (no copy)."""
        if self._plain is not None and isinstance(observation, Tensor) and observation.dtype == dtype:
            if observation.dim() < 1 or observation.shape[-1] != self._plain:
                raise ValueError(f"{self.name}: shape {tuple(observation.shape)} does not end with ({self._plain},) "
                                 f"(the observation this policy was built for)")
            return observation
        return self(self.read(observation), dtype)

    def read(self, observation) -> list[Tensor]:
        """The encoded leaves of ``observation`` (a tensor for a bare leaf, else a TensorDict or nested dict).

        Raises:
            ValueError: a leaf whose trailing dims differ from its spec shape.
        """
        out = []
        for path, leaf in zip(self.paths, self.leaves):
            x = read_path(observation, path)
            nd = len(leaf.shape)
            if x.dim() < nd or (nd and tuple(x.shape[-nd:]) != leaf.shape):
                raise ValueError(f"{self.name}{''.join('/' + p for p in path)}: shape {tuple(x.shape)} does "
                                 f"not end with {leaf.shape}")
            out.append(x)
        return out

    def forward(self, leaves: Sequence[Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
        """Encodes the tensors of :meth:`read` (same order), each ``[*B, *leaf.shape]``, into ``[*B, F]``."""
        parts = []
        for i, (x, leaf) in enumerate(zip(leaves, self.leaves)):
            if leaf.kind == "discrete":
                parts.append((x.unsqueeze(-1) == getattr(self, f"_arange{i}")).to(dtype))
            elif leaf.kind == "multi_discrete":
                index = (x.long() + getattr(self, f"_offsets{i}")).unsqueeze(-1)   # [*B, K, 1]
                parts.append((index == getattr(self, f"_arange{i}")).any(-2).to(dtype))
            elif str(i) in self.images:
                parts.append(self.images[str(i)](x, dtype))
            elif i in self.normalized:
                mean, var = getattr(self, f"obs_mean{i}").to(dtype), getattr(self, f"obs_var{i}").to(dtype)
                z = ((x.to(dtype) - mean) / torch.sqrt(var + 1e-8)).clamp(-10.0, 10.0)
                parts.append(z.flatten(-len(leaf.shape)) if leaf.shape else z.unsqueeze(-1))
            elif leaf.shape:
                parts.append(x.flatten(-len(leaf.shape)).to(dtype))
            else:
                parts.append(x.unsqueeze(-1).to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


    @torch.no_grad()
    def observe_(self, observation, mask: Tensor | None = None,
                 reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """Merges the statistics of ``observation`` (``[*B, *obs]``; only rows where ``mask`` ``[*B]`` is True)
        into the running mean and variance of every normalised leaf (Chan et al.'s parallel update, float64).
        Mutates the buffers. ``reduce``: sums a tensor over the copies of this encoder that train together
        (data-parallel ranks, each on its shard), so that every copy merges the moments of the whole batch;
        it is then called once per normalised leaf on every copy (:func:`core.policies.reward_scaling.sums_of`)."""
        for i in self.normalized:
            x = read_path(observation, self.paths[i]).to(torch.float64)
            nd = len(self.leaves[i].shape)
            x = x.reshape(-1, *x.shape[x.dim() - nd:]) if nd else x.reshape(-1)
            if mask is not None:
                x = x[mask.reshape(-1)]
            stats = tuple(getattr(self, f"obs_{k}{i}") for k in ("mean", "var", "count"))
            if reduce is None:
                merged = merge_moments(*stats, x)
            else:  # the whole batch's moments from every copy's sums
                merged = merge_sums(*stats, reduce(sums_of(x)))
            for buffer, value in zip(stats, merged):
                buffer.copy_(value)


def check_group_entry(entry, group: str, method: str) -> None:
    """Raises TypeError for what is not a group's entry of a step or batch (a bare observation tensor, a whole
    step), naming ``GroupPolicy.<method>``, the group and what to pass."""
    if hasattr(entry, "keys") and OBSERVATION in entry.keys():
        return
    got = f"one with keys {sorted(map(str, entry.keys()))}" if hasattr(entry, "keys") else f"a {type(entry).__name__}"
    raise TypeError(f"GroupPolicy.{method} of group {group!r} takes the group's entry of a step or batch "
                    f"(step[{group!r}], holding {OBSERVATION!r}); got {got}")


def check_leaf_names(names: Sequence[str], paths: Sequence[Path]) -> None:
    """Raises ValueError for a name of ``PolicyConfig.leaf_encoders`` that is no observation leaf of ``paths``
    (named ``observation[/key path]``), naming the nearest one."""
    valid = sorted({"/".join((OBSERVATION, *p)) for p in paths})
    for name in names:
        if name not in valid:
            near = difflib.get_close_matches(name, valid, n=1)
            raise ValueError(f"PolicyConfig.leaf_encoders names {name!r}, which is no observation leaf of the env"
                             + (f" (did you mean {near[0]!r}?)" if near else f"; its leaves: {valid}"))


class SharedEncoder(nn.Module):
    """Encodes the shared observations a group reads: ``[*B, out_features]``.

    ``shared`` maps key paths under ``"shared"`` to nodes (:func:`core.specs.shared_observations`); the
    encoder keeps the nodes on ``population_path`` (the root's and every ancestor population's), in that
    order: for a central critic eval-only leaves included, for the actor (``include_eval_only=False``) without
    them (a node with only eval-only leaves is left out).
    """

    def __init__(self, shared: Mapping[Path, Node], population_path: str, *, include_eval_only: bool = True) -> None:
        super().__init__()
        parts = tuple(population_path.split("/")) if population_path else ()
        self.paths: list[Path] = [p for p in shared if p == parts[: len(p)] and (
            include_eval_only or any(not leaf.eval_only for _, leaf in iter_leaves(shared[p])))]
        self.encoders = nn.ModuleList(ObservationEncoder(shared[p], include_eval_only=include_eval_only)
                                      for p in self.paths)
        self.out_features = sum(e.out_features for e in self.encoders)

    def forward(self, shared) -> Tensor:
        """``shared``: the ``td["shared"]`` entry of a step (a TensorDict, nested dict or tensor)."""
        parts = [enc(enc.read(read_path(shared, p))) for p, enc in zip(self.paths, self.encoders)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


__all__ = ["ObservationEncoder", "SharedEncoder", "check_group_entry", "check_leaf_names", "init_linear_", "mlp",
           "normalizes", "read_path"]
