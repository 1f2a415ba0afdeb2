"""MLME as an injection policy: tiled attention, StripeFFN and chunked cross-entropy swapped into a model.

``mlme_policies(cfg)`` builds the policies for an :class:`~titan_ds.config.MLMEConfig`; ``apply_mlme(model, cfg)``
applies them (``titan_ds.inject.policy.apply_policies``) and returns the ``ReplacementReport``;
:class:`MLMEPillar` validates that every switched-on part matches a module (``mlme_problems``, before anything is
touched), then does that to ``ctx.model`` and publishes the report in ``ctx.reports["mlme"]``.

What is replaced (every replacement keeps the state-dict names of the module it replaces):

| model | attention (``mlme.attention``) | MLP (``mlme.stripe_ffn``) | loss (``mlme.chunked_loss``) |
|---|---|---|---|
| reference GPT (titan_ds.models.gpt) | ``blocks.{i}.attn.core`` -> ``TiledAttention`` / ``SDPAttention`` | ``blocks.{i}.mlp`` (fc, act, out) -> ``StripeFFN`` | ``lm_loss`` -> ``ChunkedLMLoss`` |
| HF GPT-2 | ``GPT2Attention``: its own config copy with ``_attn_implementation="titan_tiled"`` | ``GPT2MLP`` (c_fc, act, c_proj, dropout) -> ``StripeFFN`` | ``lm_head`` -> ``CapturingHead`` + chunked forward (titan_ds.inject.hf_loss) |
| HF Llama, Qwen2/3, Mistral, Gemma | ``*Attention`` dispatching through HF's ``AttentionInterface``, likewise | ``*MLP`` with gate/up/down_proj -> gated ``StripeFFN`` | likewise |

``attention="sdpa"`` on an HF model whose attention already runs on SDPA (the default of transformers 5) changes
nothing and counts as done (logged). ``recompute_blocks`` matches HF decoder layers (``model.layers.{i}``,
``transformer.h.{i}``). The chunked loss on an HF causal LM is in :mod:`titan_ds.inject.hf_loss`; an HF model of
another family raises, naming the supported ones.
HF attention dropout is not supported by the tiled kernel: a module with attention dropout > 0 raises at apply time.
Which kernel runs the attention (SDPA's flash or memory-efficient kernel on CUDA, PyTorch's CPU flash kernel, the
reference) is decided per call in :mod:`titan_ds.kernels.attention`; the report's ``kernel`` states the rule per
device and each distinct kind of call logs its choice once.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.attention import TiledAttention, kernels_by_device, tiled_attention
from ..kernels.chunked_ce import ChunkedLMLoss
from ..kernels.stripe_ffn import SAVES, StripeFFN
from .hf_loss import CapturingHead, HFChunkedLossPolicy
from ..pillar import Pillar, View
from .policy import ReplacementReport, apply_policies, planned
from .recompute import BlockRecomputePolicy

__all__ = ["SDPAttention", "AttentionCorePolicy", "HFAttentionPolicy", "StripeFFNPolicy", "ChunkedLossPolicy",
           "mlme_policies", "apply_mlme", "before_initialize", "HF_ATTN_IMPLEMENTATION"]
# (the chunked loss of HF causal LMs is in titan_ds.inject.hf_loss)

log = logging.getLogger("titan_ds.inject")

HF_ATTN_IMPLEMENTATION = "titan_tiled"
_ATTENTION_MODES = ("tiled", "sdpa", "off")


class SDPAttention(nn.Module):
    """Attention core on ``F.scaled_dot_product_attention`` (``mlme.attention="sdpa"``)."""

    def __init__(self, causal: bool = True):
        super().__init__()
        self.causal = causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


def _leaf_name(name: str) -> str:
    return name.rpartition(".")[2]


def _zero3_partitioned(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_numel") for p in module.parameters())


# ---------------------------------------------------------------------------------------------- attention
class AttentionCorePolicy:
    """The reference GPT's ``attn.core`` (class ``AttentionCore``, forward(q, k, v) on (B, H, T, D))."""

    def __init__(self, mode: str, tile: int):
        if mode not in ("tiled", "sdpa"):
            raise ValueError(f"unknown attention mode {mode!r} for AttentionCorePolicy; choose 'tiled' or 'sdpa'")
        self.name, self.mode, self.tile = "mlme.attention", mode, tile

    def matches(self, name: str, module: nn.Module) -> bool:
        return type(module).__name__ == "AttentionCore" and _leaf_name(name) == "core"

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        causal = bool(getattr(module, "causal", True))
        return TiledAttention(causal=causal, tile=self.tile) if self.mode == "tiled" else SDPAttention(causal)

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"mode": self.mode, "tile": self.tile if self.mode == "tiled" else None, "kernel": _kernel(self.mode)}


def _kernel(mode: str) -> str:
    """The report's "kernel": what an unmasked call runs, by device (titan_ds.kernels.attention.attention_kernel)."""
    if mode == "sdpa":
        return "torch SDPA (PyTorch's choice of backend)"
    return ", ".join(f"{dev}: {k}" for dev, k in kernels_by_device().items())


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _split_hf_mask(mask: Tensor, causal_default: bool, tq: int, tk: int):
    """HF's 4-D "may attend" mask as (causal, key_padding_mask, None) when it has that form, else (False, None, mask)."""
    if mask.dtype != torch.bool:  # an additive float mask (eager-style): 0 where allowed
        mask = mask == 0
    mask = mask.expand(mask.shape[0], 1, tq, tk) if mask.shape[1] == 1 else mask
    kpm = mask[:, 0].any(dim=1)  # (B, Tk): keys some query may see
    tril = torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril()
    for causal, pattern in ((True, tril[None, None] & kpm[:, None, None, :]), (False, kpm[:, None, None, :])):
        if tq <= tk and torch.equal(pattern.expand_as(mask), mask):
            return causal, (None if bool(kpm.all()) else kpm), None
    return False, None, mask


_MASK_READ_ON = ("cpu",)  # devices where HF's mask is read to recognise causal + key padding (_split_hf_mask)


def hf_tiled_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       is_causal: Optional[bool] = None, **kwargs: Any):
    """HF ``AttentionInterface`` function: q/k/v (B, H, T, D) -> ((B, T, H, D), None), tiled and exact."""
    if dropout:
        raise ValueError(f"titan tiled attention has no attention dropout, got p={dropout}; set the model config's "
                         f"attention dropout (attn_pdrop / attention_dropout) to 0")
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"titan tiled attention does not support {unsupported}; set titan.mlme.attention "
                             f"to \"sdpa\" for this model")
    window = kwargs.get("sliding_window")
    # A sliding window is carried by the mask HF builds (sdpa_mask, registered for titan_tiled); HF leaves the mask
    # out only when the window cannot matter (no padding and fewer keys than the window).
    if window is not None and attention_mask is None and key.shape[2] > window:
        raise ValueError(f"titan tiled attention got sliding_window={window} for {key.shape[2]} keys without a "
                         f"mask; set titan.mlme.attention to \"sdpa\" for this model")
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    tile = getattr(module, "_titan_tile", 128)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    tq, tk = query.shape[2], key.shape[2]
    if attention_mask is None:
        out = tiled_attention(query, key, value, causal=causal and tq > 1, scale=scaling, tile=tile)
    elif query.device.type not in _MASK_READ_ON:
        # off the CPU the mask goes to SDPA as it is (HF built it for SDPA): recognising its form would read it on the
        # host (a sync per layer on a GPU)
        dense = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        out = tiled_attention(query, key, value, attn_mask=dense, scale=scaling, tile=tile)
    else:
        causal, kpm, dense = _split_hf_mask(attention_mask, causal, tq, tk)
        out = tiled_attention(query, key, value, causal=causal, key_padding_mask=kpm, attn_mask=dense,
                              scale=scaling, tile=tile)
    return out.transpose(1, 2).contiguous(), None


def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_tiled_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTN_IMPLEMENTATION, sdpa_mask)


def _hf_attention_dropout(module: nn.Module) -> float:
    drop = getattr(module, "attn_dropout", None)
    if isinstance(drop, nn.Dropout):
        return float(drop.p)
    return float(getattr(module, "attention_dropout", 0.0) or 0.0)


class HFAttentionPolicy:
    """HF attention modules that dispatch through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.

    The module is kept (same parameters, same names); it gets its own shallow config copy whose attention
    implementation is ``"titan_tiled"`` (tiled) or ``"sdpa"``, and ``_titan_tile``. Reversible by restoring
    ``module.config`` (the report's detail has the previous implementation).
    """

    def __init__(self, mode: str, tile: int):
        if mode not in ("tiled", "sdpa"):
            raise ValueError(f"unknown attention mode {mode!r} for HFAttentionPolicy; choose 'tiled' or 'sdpa'")
        self.name, self.mode, self.tile = "mlme.attention", mode, tile
        self.impl = HF_ATTN_IMPLEMENTATION if mode == "tiled" else "sdpa"
        self._previous: dict[str, Any] = {}
        self.already: list[str] = []  # modules that run on self.impl already (nothing to replace; counts as done)

    def matches(self, name: str, module: nn.Module) -> bool:
        cfg = getattr(module, "config", None)
        if not (type(module).__module__.startswith("transformers.") and type(module).__name__.endswith("Attention")
                and cfg is not None and hasattr(cfg, "_attn_implementation")):
            return False
        if cfg._attn_implementation == self.impl:
            if name not in self.already:
                self.already.append(name)
            return False
        return True

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        if self.mode == "tiled":
            p = _hf_attention_dropout(module)
            if p > 0:
                raise ValueError(f"{name}: titan.mlme.attention=\"tiled\" has no attention dropout but this module "
                                 f"has p={p}; build the model with attention dropout 0 (GPT-2: attn_pdrop=0, "
                                 f"Llama: attention_dropout=0) or set titan.mlme.attention to \"sdpa\"")
            if getattr(module, "is_cross_attention", False):
                raise ValueError(f"{name}: cross-attention is not supported by titan tiled attention")
            _register_hf()
        self._previous[name] = module.config._attn_implementation
        module.config = copy.copy(module.config)
        module.config._attn_implementation = self.impl
        module._titan_tile = self.tile
        return module

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"mode": self.mode, "attn_implementation": f"{self._previous.get(name)} -> {self.impl}",
                "tile": self.tile if self.mode == "tiled" else None, "kernel": _kernel(self.mode)}


# ---------------------------------------------------------------------------------------------- MLP
def _act_of(module: nn.Module, *names: str):
    for n in names:
        act = getattr(module, n, None)
        if act is not None:
            return n, act
    gelus = [(n, m) for n, m in module.named_children() if isinstance(m, nn.GELU)]
    if len(gelus) == 1:
        return gelus[0]
    return None, None


class StripeFFNPolicy:
    """MLPs named ``*.mlp``: GPT (fc, act, out), HF GPT-2 (c_fc, act, c_proj, dropout), gated (gate/up/down_proj).

    ``verify`` (default on): the replacement is checked against the original on a few random tokens at
    replace time, so an MLP whose forward is not the assumed layout raises instead of training wrongly.
    """

    def __init__(self, stripe: Union[int, str], verify: bool = True, saves: str = "input"):
        if stripe != "budget" and not (isinstance(stripe, int) and stripe >= 1):
            raise ValueError(f"stripe must be >= 1 tokens or 'budget', got {stripe!r}")
        if saves not in SAVES:
            raise ValueError(f"unknown stripe_ffn_saves {saves!r}; choose one of {list(SAVES)}")
        self.name, self.stripe, self.verify, self.saves = "mlme.stripe_ffn", stripe, verify, saves

    def matches(self, name: str, module: nn.Module) -> bool:
        if isinstance(module, StripeFFN) or _leaf_name(name) != "mlp":
            return False
        return self._layout(module) is not None

    @staticmethod
    def _layout(module: nn.Module) -> Optional[str]:
        has = lambda *names: all(isinstance(getattr(module, n, None), nn.Module) for n in names)  # noqa: E731
        if has("gate_proj", "up_proj", "down_proj") and getattr(module, "act_fn", None) is not None:
            return "gated"
        if has("c_fc", "c_proj") and getattr(module, "act", None) is not None:
            return "gpt2"
        if has("fc", "out"):  # activation: a child module, else F.gelu (titan_ds.models.gpt.MLP); verified
            return "gpt"
        return None

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        layout = self._layout(module)
        if layout == "gated":
            new = StripeFFN.gated(module.gate_proj, module.up_proj, module.down_proj, module.act_fn, self.stripe,
                                  saves=self.saves)
        elif layout == "gpt2":
            drop = getattr(module, "dropout", None)
            new = StripeFFN.plain(module.c_fc, module.act, module.c_proj, self.stripe, names=("c_fc", "act", "c_proj"),
                                  dropout=("dropout", drop) if isinstance(drop, nn.Module) else None, saves=self.saves)
        else:
            act_name, act = _act_of(module, "act", "gelu", "activation")
            if act is None:
                act_name, act = "act", F.gelu
            new = StripeFFN.plain(module.fc, act, module.out, self.stripe, names=("fc", act_name, "out"),
                                  saves=self.saves)
        new.train(module.training)
        if self.verify and not _zero3_partitioned(module):
            self._verify(name, module, new)
        return new

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        p = next(new.parameters(), None)
        dtype = p.dtype if p is not None and p.dtype.is_floating_point else torch.float32
        return {"stripe": self.stripe, "tokens_per_stripe": new.stripe_for(dtype), "dtype": str(dtype)[6:],
                "saves": new.saves_used}

    @staticmethod
    def _verify(name: str, old: nn.Module, new: nn.Module) -> None:
        p = next(old.parameters())
        d_in = (getattr(old, "fc", None) or getattr(old, "c_fc", None) or old.gate_proj)
        d = getattr(d_in, "in_features", None) or d_in.weight.shape[0]  # Linear / TR layer, else HF Conv1D (in, out)
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(1, 3, d, generator=gen).to(device=p.device, dtype=p.dtype)
        was = old.training
        old.eval(), new.eval()
        with torch.no_grad():
            a, b = old(x), new(x)
        old.train(was), new.train(was)
        tol = 1e-4 if p.dtype == torch.float32 else 2e-2
        if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
            raise RuntimeError(f"{name}: StripeFFN does not reproduce {type(old).__name__}.forward (max diff "
                               f"{(a - b).abs().max().item():.3g}); its layout is not act(fc(x)) -> out; set "
                               f"titan.mlme.stripe_ffn to null for this model")


# ---------------------------------------------------------------------------------------------- loss
class ChunkedLossPolicy:
    """The reference GPT's ``lm_loss`` (class ``LMLoss``, forward(hidden, head, targets)) -> ``ChunkedLMLoss``."""

    def __init__(self, chunk: int, vocab_chunk: Optional[int] = None):
        self.name, self.chunk, self.vocab_chunk = "mlme.chunked_loss", chunk, vocab_chunk

    def matches(self, name: str, module: nn.Module) -> bool:
        return type(module).__name__ == "LMLoss" and _leaf_name(name) == "lm_loss"

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        if float(getattr(module, "label_smoothing", 0.0) or 0.0) != 0.0:
            raise ValueError(f"{name}: ChunkedLMLoss has no label smoothing; set titan.mlme.chunked_loss to false")
        return ChunkedLMLoss(chunk=self.chunk, vocab_chunk=self.vocab_chunk,
                             ignore_index=int(getattr(module, "ignore_index", -100)),
                             reduction=str(getattr(module, "reduction", "mean")))

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        return {"chunk": self.chunk, "vocab_chunk": self.vocab_chunk, "ignore_index": new.ignore_index}


# ---------------------------------------------------------------------------------------------- wiring
def mlme_policies(cfg: Any, model: Optional[nn.Module] = None) -> list:
    """The policies an ``MLMEConfig`` switches on, in the order they are tried.

    With ``model`` an HF causal LM, ``chunked_loss`` is :class:`~titan_ds.inject.hf_loss.HFChunkedLossPolicy` for
    it (which raises for an unsupported family); otherwise the reference GPT's :class:`ChunkedLossPolicy`.
    """
    if cfg.attention not in _ATTENTION_MODES:
        raise ValueError(f"unknown titan.mlme.attention {cfg.attention!r}; choose one of {list(_ATTENTION_MODES)}")
    policies: list = []
    if cfg.attention != "off":
        policies += [AttentionCorePolicy(cfg.attention, cfg.tile), HFAttentionPolicy(cfg.attention, cfg.tile)]
    if cfg.stripe_ffn is not None:
        policies.append(StripeFFNPolicy(cfg.stripe_ffn, saves=getattr(cfg, "stripe_ffn_saves", "input")))
    if cfg.chunked_loss:
        vchunk = getattr(cfg, "loss_vocab_chunk", None)
        if model is not None and _is_hf(model):
            if "_titan_chunked_loss" not in model.__dict__:
                policies.append(HFChunkedLossPolicy(model, cfg.loss_chunk, vchunk))
        else:
            policies.append(ChunkedLossPolicy(cfg.loss_chunk, vchunk))
    return policies


def _is_hf(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.") or hasattr(model, "config") and \
        hasattr(getattr(model, "config"), "_attn_implementation")


_OFF = {"mlme.attention": "attention (\"off\")", "mlme.stripe_ffn": "stripe_ffn (null)",
        "mlme.chunked_loss": "chunked_loss (false)"}


def _no_block(model: nn.Module) -> str:
    return (f"titan.mlme.recompute_blocks matched no block of {type(model).__name__} (names 'blocks.N', "
            f"'layers.N' or 'h.N'); set it to false")


def _unmatched(model: nn.Module, missing: list[str]) -> str:
    return (f"titan.mlme is on but {', '.join(missing)} matched no module of {type(model).__name__} (MLME knows "
            f"titan_ds.models.gpt.GPT and HF GPT-2, Llama, Qwen2/3, Mistral and Gemma causal LMs); switch off " +
            ", ".join(f"titan.mlme.{_OFF[m]}" for m in missing))


def _missing(policies: list, done: set[str]) -> list[str]:
    for p in policies:
        if getattr(p, "already", None):
            done.add(p.name)
    return list(dict.fromkeys(p.name for p in policies if p.name not in done))  # one name per key


def mlme_problems(model: nn.Module, cfg: Any) -> list[str]:
    """What :func:`apply_mlme` would refuse, found without changing ``model`` (``matches`` only)."""
    try:
        policies = mlme_policies(cfg, model)
        done = {p.name for _, _, p in planned(model, policies)}
    except ValueError as e:
        return [str(e)]
    out = []
    missing = _missing(policies, done)
    if missing:
        out.append(_unmatched(model, missing))
    if cfg.recompute_blocks:
        rec = BlockRecomputePolicy()
        if not any(n and (rec.matches(n, m) or getattr(m, "_titan_recompute", False))
                   for n, m in model.named_modules()):
            out.append(_no_block(model))
    return out


def apply_mlme(model: nn.Module, cfg: Any) -> ReplacementReport:
    """Apply the MLME policies of ``cfg`` to ``model`` in place; raises if a switched-on part replaced nothing."""
    policies = mlme_policies(cfg, model)
    report = apply_policies(model, policies)
    if getattr(cfg, "recompute_blocks", False):
        # a second pass: the first one already swapped the blocks' children (a replaced module's children are
        # not visited, so blocks must come after them)
        rec = apply_policies(model, [BlockRecomputePolicy(getattr(cfg, "recompute_ffn", "in_backward"))])
        if not any(getattr(m, "_titan_recompute", False) for m in model.modules()):
            raise ValueError(_no_block(model))
        report.entries.extend(rec.entries)
    for p in policies:
        if getattr(p, "already", None):
            log.info("titan: %s: %d modules already use %r (nothing to replace)", p.name, len(p.already), p.impl)
    missing = _missing(policies, {e.policy for e in report.entries})
    if missing:
        raise ValueError(_unmatched(model, missing))
    return report


def _register_zero3_external_params(model: nn.Module) -> int:
    """Under ZeRO-3 a module's parameters are gathered only around that module's own forward. StripeFFN reads
    its ``fc``/``out`` children's weights inside one autograd Function, and the chunked loss reads the LM head's
    weight: tell ZeRO-3 to gather those around the MLME module's forward and backward."""
    from ..deepspeed_compat import register_external_parameter
    n = 0
    for module in model.modules():
        if isinstance(module, StripeFFN):
            for child in module.children():
                for p in child.parameters():
                    register_external_parameter(module, p)
                    n += 1
        elif isinstance(module, ChunkedLMLoss) and isinstance(getattr(model, "head", None), nn.Module):
            for p in model.head.parameters():
                register_external_parameter(module, p)
                n += 1
        elif isinstance(module, CapturingHead):  # HF chunked loss: the root's forward reads lm_head's weight
            for p in module.parameters():
                register_external_parameter(model, p)
                n += 1
    return n


class MLMEPillar(Pillar):
    """``titan.mlme``: swap MLME modules into the model before DeepSpeed wraps it; report in ``reports["mlme"]``."""

    key = "mlme"

    def validate(self, view: View) -> list[str]:
        return mlme_problems(view.model, self.cfg)

    def apply(self, ctx: Any) -> None:
        ctx.reports["mlme"] = apply_mlme(ctx.model, self.cfg)
        if ctx.zero_stage() == 3:
            n = _register_zero3_external_params(ctx.model)
            log.info("titan.mlme: %d parameters registered with ZeRO-3 as used outside their module", n)


PILLAR = MLMEPillar
