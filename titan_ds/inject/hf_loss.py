"""Chunked LM loss for Hugging Face ``*ForCausalLM`` models (``titan.mlme.chunked_loss`` on an HF model).

An HF causal LM computes ``logits = lm_head(hidden)`` for every position inside its ``forward`` and then
``loss = self.loss_function(logits, labels, ...)``: the ``[batch, seq, vocab]`` logits are the largest activation
of the model. No module swap can avoid them, because the loss is computed by the root module's ``forward``.

:class:`HFChunkedLossPolicy` therefore does two explicit, reversible things to a model of a supported family
(:data:`HF_CAUSAL_LM_FAMILIES`):

1. its ``lm_head`` (exactly ``nn.Linear``) is replaced by a :class:`CapturingHead`, a subclass of ``nn.Linear``
   sharing the old module's ``__dict__`` (same parameters, tied weights and state-dict names). Unarmed it is ``nn.Linear``; armed
   it records its input and returns an empty ``[..., 0]`` tensor instead of the logits;
2. the model's instance gets a ``forward`` (a bound method, signature of the class's ``forward``) that, **in
   training mode with labels**, calls the class's own ``forward`` with ``labels=None`` and the head armed, then
   computes the loss from the recorded hidden states with
   :func:`titan_ds.kernels.chunked_ce.chunked_linear_cross_entropy` (chunks of ``loss_chunk`` tokens and
   ``loss_vocab_chunk`` classes). Otherwise (eval, generation, no labels) it is the class's ``forward`` unchanged.

The loss is HF's ``ForCausalLMLoss``: labels shifted left by one (or ``shift_labels`` if given), ``ignore_index``
(default -100) not counted, mean over counted tokens, or sum / ``num_items_in_batch`` when the ``Trainer`` passes
that (gradient accumulation). The returned output has ``loss`` and ``logits=None``.
:func:`remove_hf_chunked_loss` undoes both changes.

Limits: label smoothing or a ``compute_loss_func`` in the ``Trainer`` take labels away from the model, which then
runs its plain forward (full logits, correct loss). Families whose forward post-processes logits (Gemma 2/3
soft-capping, Cohere/Granite logit scaling) are not in the table and raise.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.chunked_ce import chunked_linear_cross_entropy

__all__ = ["HF_CAUSAL_LM_FAMILIES", "CapturingHead", "HFChunkedLossPolicy", "hf_causal_lm_family",
           "remove_hf_chunked_loss"]

log = logging.getLogger("titan_ds.inject")

# Class name -> family. Each forward is `hidden -> slice_logits_to_keep -> lm_head -> self.loss_function(...)`
# with nothing between the head and the loss (read in transformers 5.24's modeling_*.py; parity-tested for each
# in tests/inject/test_chunked_loss_hf.py).
HF_CAUSAL_LM_FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                         "MistralForCausalLM": "mistral", "GemmaForCausalLM": "gemma", "GPT2LMHeadModel": "gpt2"}
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
_FORWARDS: dict[type, Callable] = {}


class CapturingHead(nn.Linear):
    """``nn.Linear`` that, while ``_titan_sink`` is a list, appends its input there and returns ``x[..., :0]``."""

    _titan_sink: Optional[list] = None

    def forward(self, x: Tensor) -> Tensor:
        sink = self.__dict__.get("_titan_sink")
        if sink is None:
            return super().forward(x)
        sink.append(x)
        return x[..., :0]  # stands in for the logits; nothing reads it on this path


def hf_causal_lm_family(model: nn.Module) -> Optional[tuple[str, type]]:
    """(family, the supported class) when ``model`` is a supported class or a subclass not overriding ``forward``."""
    for cls in type(model).__mro__:
        if cls.__name__ in HF_CAUSAL_LM_FAMILIES and cls.__module__.startswith("transformers."):
            if type(model).forward is not cls.forward:
                return None  # a subclass with its own forward: we cannot know what it does to the logits
            return HF_CAUSAL_LM_FAMILIES[cls.__name__], cls
    return None


def _chunked_forward(cls: type) -> Callable:
    """The replacement ``forward`` for instances of ``cls`` (one per class; ``__wrapped__`` keeps the signature)."""
    if cls in _FORWARDS:
        return _FORWARDS[cls]
    original = cls.forward
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any):
        bound = sig.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or not self.training:
            return original(self, *args, **kwargs)
        call = {k: v for k, v in bound.arguments.items() if k not in ("self", var_kw)}
        extra = dict(bound.arguments.get(var_kw, {})) if var_kw else {}
        loss_kw = {k: extra.pop(k) for k in _LOSS_KWARGS if k in extra}
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        call["labels"] = None
        head = self.get_output_embeddings()
        sink: list = []
        head._titan_sink = sink
        try:
            out = original(self, **call, **extra, return_dict=True)
        finally:
            del head._titan_sink
        if len(sink) != 1:
            raise RuntimeError(f"{cls.__name__}.forward called its lm_head {len(sink)} times; titan's chunked loss "
                               f"needs exactly one call; set titan.mlme.chunked_loss to false")
        loss = _causal_lm_loss(sink[0], head, labels, self._titan_chunked_loss, **loss_kw)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        out = type(out)(loss=loss, **fields)
        return out if return_dict else out.to_tuple()

    _FORWARDS[cls] = forward
    return forward


def _causal_lm_loss(hidden: Tensor, head: nn.Linear, labels: Tensor, opts: dict, *,
                    num_items_in_batch: Any = None, ignore_index: int = -100,
                    shift_labels: Optional[Tensor] = None) -> Tensor:
    """HF's ForCausalLMLoss on ``head(hidden)``, fused and chunked (the logits are never built in full)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = chunked_linear_cross_entropy(hidden, head.weight, shift_labels, head.bias, ignore_index=ignore_index,
                                        reduction=reduction, chunk=opts["chunk"],
                                        vocab_chunk=opts["vocab_chunk"], out_dtype=torch.float32)  # as HF's
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch) and not (num_items_in_batch.device.type == "cpu" and
                                                        num_items_in_batch.dim() == 0):
            # a 0-d CPU tensor divides a device tensor as a scalar; copying it would be a blocking host-to-device copy
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class HFChunkedLossPolicy:
    """Matches the ``lm_head`` of a supported HF causal LM ``root``; replaces it by a :class:`CapturingHead` over
    the same parameters and gives ``root`` the chunked-loss ``forward`` (module docstring).

    Built for one root model (the policy needs the root, which ``apply_policies`` never visits). Raises at
    construction, naming the family and the supported ones, when ``root`` is an HF causal LM it cannot handle.
    """

    def __init__(self, root: nn.Module, chunk: int, vocab_chunk: Optional[int] = None):
        self.name, self.root, self.chunk, self.vocab_chunk = "mlme.chunked_loss", root, chunk, vocab_chunk
        found = hf_causal_lm_family(root)
        supported = ", ".join(f"{v} ({k})" for k, v in HF_CAUSAL_LM_FAMILIES.items())
        if found is None:
            raise ValueError(f"titan.mlme.chunked_loss does not support {type(root).__name__} (model_type "
                             f"{getattr(getattr(root, 'config', None), 'model_type', '?')!r}): supported HF "
                             f"families are {supported}, with their own forward; set titan.mlme.chunked_loss to "
                             f"false for this model")
        self.family, self.cls = found
        head = root.get_output_embeddings()
        if type(head) not in (nn.Linear, CapturingHead):
            raise ValueError(f"titan.mlme.chunked_loss needs {type(root).__name__}'s output embedding as nn.Linear, "
                             f"got {type(head).__name__}; set titan.mlme.chunked_loss to false")
        self.head = head

    def matches(self, name: str, module: nn.Module) -> bool:
        return module is self.head and type(module) is nn.Linear

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        new = CapturingHead.__new__(CapturingHead)
        new.__dict__ = module.__dict__  # same parameters (tying kept), hooks and state-dict names
        self.root._titan_chunked_loss = {"chunk": self.chunk, "vocab_chunk": self.vocab_chunk}
        self.root.forward = types.MethodType(_chunked_forward(self.cls), self.root)
        return new

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"family": self.family, "forward": f"{self.cls.__name__}.forward -> titan chunked loss in training",
                "chunk": self.chunk, "vocab_chunk": self.vocab_chunk}


def remove_hf_chunked_loss(model: nn.Module) -> bool:
    """Undo :class:`HFChunkedLossPolicy` on ``model``; returns whether there was anything to undo."""
    if "_titan_chunked_loss" not in model.__dict__:
        return False
    del model.forward
    del model._titan_chunked_loss
    head = model.get_output_embeddings()
    if type(head) is CapturingHead:
        linear = nn.Linear.__new__(nn.Linear)
        linear.__dict__ = head.__dict__
        model.set_output_embeddings(linear)
    return True
