"""The ``--device`` flag: its forms checked when the config is built (no torch needed), and resolved to a torch
device where the work runs (the local process, or a Ray learner on whatever node holds its GPU)."""

from __future__ import annotations

import re

_FORMS = re.compile(r"auto|(cpu|cuda|mps)(:\d+)?")


def device_problem(name: object) -> str | None:
    """Why ``name`` is not a device the run can be given, naming ``--device`` and the nearest valid form; None
    when it is one: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:<index>`` or ``mps``."""
    if isinstance(name, str) and _FORMS.fullmatch(name):
        return None
    text = str(name).strip().lower()
    index = text.rsplit(":", 1)[1] if ":" in text and text.rsplit(":", 1)[1].isdigit() else None
    kind = "cuda" if text.startswith(("cuda", "gpu", "nvidia")) else "cpu" if text.startswith("cpu") else "auto"
    nearest = f"{kind}:{index}" if index is not None and kind != "auto" else kind
    return (f"--device {name!r} is not a device: use auto (CUDA when present), cpu, cuda, cuda:<index> or mps; "
            f"did you mean {nearest!r}?")


def resolve_device(name: str):
    """The ``torch.device`` of ``name`` here: ``auto`` picks CUDA when present, else the CPU.

    Raises:
        ValueError: naming ``--device``, when this process cannot use the device (torch built without CUDA,
        no such CUDA index, no MPS).
    """
    import torch

    if problem := device_problem(name):
        raise ValueError(problem)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            why = (f"{count} CUDA device{'s' if count != 1 else ''} visible here" if torch.backends.cuda.is_built()
                   else "this torch is built without CUDA")
            raise ValueError(f"--device {name}: {why} (torch {torch.__version__}); use --device auto (CUDA when "
                             f"present){' or cuda:0' if count else ''} or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available here; use --device auto or cpu")
    return device


def check_compute_dtype(device, compute_dtype: str) -> None:
    """Raises ValueError, naming ``--ppo.compute-dtype``, when ``device`` (a ``torch.device``) cannot compute in
    ``compute_dtype``: bfloat16 on a GPU without it (before Ampere), found at the first update otherwise."""
    import torch

    if compute_dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--ppo.compute-dtype bfloat16: the GPU {device} has no bfloat16 support; use "
                         f"--ppo.compute-dtype float32 (the default)")


__all__ = ["check_compute_dtype", "device_problem", "resolve_device"]
