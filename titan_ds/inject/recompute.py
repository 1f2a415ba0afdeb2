"""Block recomputation (``titan.mlme.recompute_blocks``): a transformer block keeps only its input for backward
and is recomputed inside backward, so one block's activations are alive at a time.

The block is not wrapped (that would rename its state-dict keys): the instance's class is swapped for a
subclass whose ``forward`` runs the original forward under ``torch.utils.checkpoint`` (reentrant mode, so the
saved block input goes through autograd's saved-tensor hooks and is counted by the activation meters). The
policy matches the reference GPT's ``blocks.{i}`` and HF decoder layers (``*.layers.{i}``, ``*.h.{i}``). In a
recomputed (training) call an HF layer's KV-cache arguments are dropped (``use_cache=False``), as HF's own gradient
checkpointing does: the replay in backward would otherwise write the cache twice.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["BlockRecomputePolicy", "recomputed"]

_BLOCK_NAME = re.compile(r"(^|\.)(blocks|layers|h)\.\d+$")
_CLASSES: dict[type, type] = {}


def recomputed(cls: type) -> type:
    """The subclass of ``cls`` whose forward is checkpointed (one per class, cached)."""
    if cls not in _CLASSES:
        sig = inspect.signature(cls.forward)

        def forward(self, *args: Any, **kwargs: Any):
            if not (torch.is_grad_enabled() and self.training):
                return cls.forward(self, *args, **kwargs)
            args, kwargs = _without_cache(sig, self, args, kwargs)
            return checkpoint(lambda *a: cls.forward(self, *a, **kwargs), *args, use_reentrant=True)
        _CLASSES[cls] = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "_titan_recompute": True})
    return _CLASSES[cls]


# HF decoder layers' KV-cache arguments (names differ by family and version). A recomputed layer would write its
# keys and values into the cache a second time in backward; HF's own gradient checkpointing drops them the same way.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(sig: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every KV-cache argument None and ``use_cache`` False (positional or keyword)."""
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:
        return args, kwargs  # let the layer's own forward report the bad call
    named = dict(bound.arguments)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    scopes = [bound.arguments] + ([named[var_kw]] if var_kw in named else [])
    if not any(sc.get(k) is not None for sc in scopes for k in _CACHE_KWARGS) and \
            not any(sc.get("use_cache") for sc in scopes):
        return args, kwargs
    for sc in scopes:
        for k in _CACHE_KWARGS:
            if sc.get(k) is not None:
                sc[k] = None
        if sc.get("use_cache"):
            sc["use_cache"] = False
    return bound.args[1:], bound.kwargs


class BlockRecomputePolicy:
    """Match transformer blocks by name; replace each by the same module with a checkpointed forward."""

    name = "mlme.recompute_blocks"

    def matches(self, name: str, module: nn.Module) -> bool:
        return bool(_BLOCK_NAME.search(name)) and not getattr(module, "_titan_recompute", False)

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        new = recomputed(type(module)).__new__(recomputed(type(module)))
        new.__dict__ = module.__dict__  # same parameters, buffers and children: state-dict names unchanged
        return new

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"checkpoint": "torch.utils.checkpoint (reentrant)"}
