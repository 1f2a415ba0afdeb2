"""Sparse delta export: write only the elements that changed since a base checkpoint; apply it exactly.

The file holds, per tensor that changed, the flat int64 indices and the new values (not differences), so
``apply_delta(base, save_delta(current, base))`` reproduces ``current`` bit for bit whatever the dtype.
"""
from __future__ import annotations

from typing import Mapping, Union

import torch

__all__ = ["save_delta", "apply_delta"]


def _load(base: Union[str, Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
    return torch.load(base, map_location="cpu", weights_only=True) if isinstance(base, str) else base


def save_delta(path: str, current: Mapping[str, torch.Tensor], base: Union[str, Mapping[str, torch.Tensor]]) -> dict[str, int]:
    """Write ``{name: (indices, values)}`` for the elements of ``current`` that differ from ``base``.

    Returns ``{"changed": elements written, "total": elements compared, "bytes": payload bytes}``.
    """
    base_sd = _load(base)
    missing = sorted(set(current) - set(base_sd))
    if missing:
        raise KeyError(f"base checkpoint has no tensors named {missing[:5]}; save the delta against the "
                       f"checkpoint these weights were trained from")
    out, changed, total, nbytes = {}, 0, 0, 0
    for name, t in current.items():
        cur = t.detach().reshape(-1).cpu()
        ref = base_sd[name].reshape(-1).to(cur.dtype)
        if ref.numel() != cur.numel():
            raise ValueError(f"{name}: base has {ref.numel()} elements, current {cur.numel()}")
        idx = torch.nonzero(cur != ref).reshape(-1)
        total += cur.numel()
        if idx.numel():
            vals = cur[idx].clone()
            out[name] = (idx, vals)
            changed += idx.numel()
            nbytes += idx.numel() * (8 + vals.element_size())
    torch.save({"format": "titan-asdt-delta-v1", "tensors": out}, path)
    return {"changed": changed, "total": total, "bytes": nbytes}


def apply_delta(state: Mapping[str, torch.Tensor], path: str) -> None:
    """Write the delta's values into ``state`` (a state dict or named parameters), in place."""
    d = torch.load(path, map_location="cpu", weights_only=True)
    if d.get("format") != "titan-asdt-delta-v1":
        raise ValueError(f"{path} is not a titan ASDT delta file")
    for name, (idx, vals) in d["tensors"].items():
        if name not in state:
            raise KeyError(f"delta has tensor {name!r} that the target state does not")
        flat = state[name].data.view(-1)
        flat[idx.to(flat.device)] = vals.to(flat.device, flat.dtype)
