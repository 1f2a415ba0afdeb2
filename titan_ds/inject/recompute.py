"""Block recomputation (``titan.mlme.recompute_blocks``): a transformer block keeps only its input for backward
and is recomputed inside backward, so one block's activations are alive at a time.

The block is not wrapped (that would rename its state-dict keys): the instance's class is swapped for a
subclass whose ``forward`` runs the original forward under ``torch.utils.checkpoint`` (reentrant mode, so the
saved block input goes through autograd's saved-tensor hooks and is counted by the activation meters). The
policy matches the reference GPT's ``blocks.{i}`` and HF decoder layers (``*.layers.{i}``, ``*.h.{i}``). In a
recomputed (training) call an HF layer's KV-cache arguments are dropped (``use_cache=False``), as HF's own gradient
checkpointing does: the replay in backward would otherwise write the cache twice.

**The replay skips StripeFFN's forward** (``titan.mlme.recompute_ffn: "in_backward"``, the default). In backward the
block is run again only to rebuild its autograd graph; the values it computes are thrown away, except those its
ops save. A StripeFFN output that only enters the block's residual sum is never read there, so in the replay the
StripeFFN returns zeros and saves its input (:func:`titan_ds.kernels.stripe_ffn.lazy_replay`), and its backward
computes the MLP once from that input: the replay's MLP forward (both projections) is not run, and nothing more is
kept than with ``stripe_ffn_saves: "input"``. Whether the output's value is read is checked on the replay's graph
(:func:`_values_unread`): from each skipped output up to the block's outputs, every op must be one whose backward
does not read its input's value (a sum, a view, dropout, a product with a constant), each with one consumer. Where it is not (a LayerScale
``gamma * mlp(x)``, a norm after the sum), the block class is marked, the RNG states are restored and the replay
runs again with StripeFFN computing its forward (a warning, once per class). Not seen by this check: a value
read outside autograd inside the block (``.item()``, a forward hook that records it), which sees zeros in the
replay.
"""
from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.stripe_ffn import lazy_replay

__all__ = ["BlockRecomputePolicy", "recomputed", "RECOMPUTE_FFN"]

log = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"(^|\.)(blocks|layers|h)\.\d+$")
_CLASSES: dict[type, type] = {}
RECOMPUTE_FFN = ("in_backward", "replay")  # titan.mlme.recompute_ffn (module docstring)
# autograd nodes whose backward does not read their input's value: a skipped StripeFFN output may pass through them
_VALUE_FREE = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "NativeDropoutBackward0", "ViewBackward0",
                         "ReshapeAliasBackward0", "UnsafeViewBackward0", "CloneBackward0", "ToCopyBackward0",
                         "TransposeBackward0", "PermuteBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
                         # DeepSpeed ZeRO-3's wrapper of a module's outputs (deepspeed/runtime/zero/
                         # parameter_offload.py, 0.19.8): forward returns outputs.detach(), backward runs the
                         # pre-backward hook and passes the gradients through
                         "PreBackwardFunctionForModuleBackward"})
_VALUES_READ: set[type] = set()  # block classes whose replay read a skipped StripeFFN output: replay them in full


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def _passes_unread(node: Any, child: Any) -> bool:
    """Whether ``node``'s backward does not read the value of its input produced by ``child``: a node of
    :data:`_VALUE_FREE`, or a product (dropout on a CPU is one, by its mask) that did not save that factor."""
    name = type(node).__name__
    if name in _VALUE_FREE:
        return True
    if name != "MulBackward0":
        return False
    slots = [i for i, (c, _) in enumerate(node.next_functions) if c is child]
    return len(slots) == 1 and slots[0] < 2 and getattr(node, ("_saved_self", "_saved_other")[slots[0]]) is None


def _values_unread(out: Any, skipped: list) -> bool:
    """Whether no op of the replay's graph (from the block's outputs ``out`` back to its detached inputs) reads the
    value of an output whose autograd node is in ``skipped``: the path from each up to an output of the block goes
    through nodes that do not read it (:func:`_passes_unread`), one consumer each."""
    roots = {t.grad_fn for t in _tensors(out) if t.grad_fn is not None}
    consumers: dict[Any, list] = {}
    seen, todo = set(roots), list(roots)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    for node in skipped:
        cur = node
        while True:
            users = consumers.get(cur, [])
            if not users:
                if cur in roots:
                    break  # reached an output of the block through value-free ops only (its value is thrown away)
                return False  # not on the way to an output: a value used outside the graph is not ruled out
            if len(users) != 1 or not _passes_unread(users[0], cur):
                return False
            cur = users[0]
    return True


def _rng_states(args: tuple) -> tuple:
    devs = {t.device for t in _tensors(args) if t.device.type not in ("cpu", "meta")}
    return torch.get_rng_state(), [(d, torch.get_device_module(d.type).get_rng_state(d)) for d in devs]


def _set_rng_states(states: tuple) -> None:
    cpu, devs = states
    torch.set_rng_state(cpu)
    for d, st in devs:
        torch.get_device_module(d.type).set_rng_state(st, d)


def _run(cls: type, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The block's forward; in the replay (grad enabled inside checkpoint's backward) with StripeFFN's forward
    skipped where ``recompute_ffn`` is ``"in_backward"`` and the replay's graph shows it safe (module docstring)."""
    if not (torch.is_grad_enabled() and getattr(module, "_titan_recompute_ffn", "replay") == "in_backward"
            and cls not in _VALUES_READ):
        return cls.forward(module, *args, **kwargs)
    rng = _rng_states(args)
    with lazy_replay() as skipped:
        out = cls.forward(module, *args, **kwargs)
    if not skipped or _values_unread(out, skipped):
        return out
    _VALUES_READ.add(cls)
    log.warning("titan: mlme.recompute_ffn \"in_backward\": %s reads its MLP's output in more than the residual "
                "sum; its replay computes the MLP's forward again (as recompute_ffn \"replay\")", cls.__name__)
    del out
    _set_rng_states(rng)
    return cls.forward(module, *args, **kwargs)


def recomputed(cls: type) -> type:
    """The subclass of ``cls`` whose forward is checkpointed (one per class, cached)."""
    if cls not in _CLASSES:
        sig = inspect.signature(cls.forward)

        def forward(self, *args: Any, **kwargs: Any):
            if not (torch.is_grad_enabled() and self.training):
                return cls.forward(self, *args, **kwargs)
            args, kwargs = _without_cache(sig, self, args, kwargs)
            return checkpoint(lambda *a: _run(cls, self, a, kwargs), *args, use_reentrant=True)
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

    def __init__(self, recompute_ffn: str = "in_backward"):
        if recompute_ffn not in RECOMPUTE_FFN:
            raise ValueError(f"unknown recompute_ffn {recompute_ffn!r}; choose one of {list(RECOMPUTE_FFN)}")
        self.recompute_ffn = recompute_ffn

    def matches(self, name: str, module: nn.Module) -> bool:
        return bool(_BLOCK_NAME.search(name)) and not getattr(module, "_titan_recompute", False)

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        new = recomputed(type(module)).__new__(recomputed(type(module)))
        new.__dict__ = module.__dict__  # same parameters, buffers and children: state-dict names unchanged
        new._titan_recompute_ffn = self.recompute_ffn
        return new

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"checkpoint": "torch.utils.checkpoint (reentrant)", "recompute_ffn": self.recompute_ffn}
