"""TRD: ``nn.Linear`` replaced by a tensor-ring (TR) layer, applied as a module-injection policy.

The weight ``W`` (out x in) of a :class:`TensorRingLinear` is never stored. The layer factors
``in = n_0 * ... * n_{p-1}`` and ``out = m_0 * ... * m_{q-1}`` and keeps one 3-way core per mode, in the
ring order ``(n_0, ..., n_{p-1}, m_0, ..., m_{q-1})``: core ``k`` has shape ``(r_k, mode_k, r_{k+1})``, with
``r_d = r_0`` closing the ring (``d = p + q``). Then

    W^T[i_0..i_{p-1}, o_0..o_{q-1}] = trace(G_0[:, i_0, :] @ ... @ G_{p-1}[:, i_{p-1}, :] @ G_p[:, o_0, :] @ ...)

Forward, step by step:

1. Merge the input cores into ``A`` (r_0, in, r_p) and the output cores into ``C`` (r_p, out, r_0) (cost about
   ``r^3 (in + out)``, independent of the number of tokens).
2. Flatten them to matrices ``Am`` (in, R) and ``Cm`` (R, out) with ``R = r_0 * r_p``, so that ``W^T = Am @ Cm``.
3. ``y = x @ Am @ Cm + b``, associated one of two ways (a matrix-chain choice):
   * ``factored``: ``(x @ Am) @ Cm`` -- forward+backward ``3 B R (in + out)`` multiply-adds, saves ``B R`` floats;
   * ``dense``:    ``x @ (Am @ Cm)`` -- forward+backward ``3 in out (B + R)`` multiply-adds, saves ``in out``.
   ``path="cheapest"`` takes the one with fewer multiply-adds, i.e. ``factored`` iff ``1/in + 1/out <= 1/R + 1/B``
   (B = tokens in the call). The rule and its measured agreement with wall time are in docs/trd.md.

:meth:`TensorRingLinear.reference_weight` builds ``W`` by contracting the whole ring in one independent
einsum chain and is the test oracle for both paths.

Initialisation: ``random`` draws every core entry from ``N(0, s_k^2)`` with
``s_k^2 = (1 / (3 in))^(1/d) / sqrt(r_k r_{k+1})``, which makes ``Var W_ij = 1/(3 in)``, the variance of
``nn.Linear``'s default init. ``tr_svd`` decomposes a dense weight with tensorly's TR-SVD (PyTorch backend); TR-SVD
needs ``r_s * r_{s+1} <= n_s`` at the edge where it starts, so it starts at the largest mode with the boundary
ranks cut to fit, and the cut-off slices are filled with small noise (``TR_SVD_PAD``) so that they can still learn.
The relative reconstruction error is kept in ``init_error``.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import deepspeed_compat as dsc
from ..config import TRD_DEFAULT_INCLUDE
from ..pillar import Pillar, View
from .policy import ReplacementReport, apply_policies, planned

__all__ = ["TensorRingLinear", "TRDPolicy", "factorize", "tr_svd", "apply_trd", "before_initialize", "path_flops",
           "is_hf_conv1d", "dense_view", "init_errors"]

log = logging.getLogger("titan_ds.trd")

Rank = Union[int, Sequence[int]]
Path = Literal["cheapest", "factored", "dense"]
_PATHS = ("cheapest", "factored", "dense")
_INITS = ("random", "tr_svd")
# Std of the noise in the rank slices that TR-SVD cannot fill, relative to each core's RMS. 1e-3 adds about
# 1e-3..1e-2 relative error to the init (measured in tests/inject/test_trd.py) and lets those slices learn.
TR_SVD_PAD = 1e-3


def factorize(n: int, mode_size: int = 4) -> list[int]:
    """Split ``n`` into about ``log(n) / log(mode_size)`` balanced factors (ascending; their product is ``n``).

    ``k = ceil(log n / log mode_size)`` factors; prime factors, largest first, each go to the currently smallest
    factor. ``factorize(768) == [3, 4, 4, 4, 4]``, ``factorize(64, 16) == [8, 8]``; a prime ``n`` stays whole.
    """
    if n < 1 or mode_size < 2:
        raise ValueError(f"factorize needs n >= 1 and mode_size >= 2, got n={n}, mode_size={mode_size}")
    primes, m, p = [], n, 2
    while p * p <= m:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    if m > 1:
        primes.append(m)
    k = max(1, math.ceil(math.log(n) / math.log(mode_size) - 1e-9)) if n > 1 else 1
    out = [1] * k
    for q in sorted(primes, reverse=True):
        out[out.index(min(out))] *= q
    return sorted(f for f in out if f > 1) or [1]


def path_flops(tokens: int, in_features: int, out_features: int, boundary: int) -> dict[str, int]:
    """Forward+backward multiply-adds of the two associations (``boundary`` = R = r_0 * r_p)."""
    return {"factored": 3 * tokens * boundary * (in_features + out_features),
            "dense": 3 * in_features * out_features * (tokens + boundary)}


def _merge(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract a chain of cores (r_a, n_i, r_b) into one (r_first, prod n, r_last)."""
    out = cores[0]
    for g in cores[1:]:
        out = torch.einsum("anc,cmd->anmd", out, g).reshape(out.shape[0], -1, g.shape[2])
    return out


class TensorRingLinear(nn.Module):
    """A linear layer whose weight is a tensor ring of 3-way cores (see the module docstring).

    Args:
        in_features, out_features: as ``nn.Linear``.
        rank: one int for every ring edge, or a list with one rank per core (edge ``k`` is the left edge of core k).
        modes: ``(in_modes, out_modes)`` with products ``in_features`` / ``out_features``; default
            ``factorize(in, mode_size)``, ``factorize(out, mode_size)``.
        bias: as ``nn.Linear``.
        mode_size: target size of the automatic modes.
        path: ``cheapest`` (fewer multiply-adds), ``factored`` or ``dense`` (see module docstring).
        init: ``random`` (variance-matched) or ``tr_svd`` (needs ``dense_weight``).
        dense_weight: (out, in) weight to decompose, only with ``init="tr_svd"``.
        dense_bias: initial bias (out,), only with ``bias=True``; default ``nn.Linear``'s init.
        core_lr_scale: ``c``. Each core is stored as ``P_k`` and used as ``G_k = c * P_k`` (``P_k`` initialised
            to ``G_k / c``, so the layer's function is unchanged). Adam-type and sign optimizers take steps of
            the same size whatever a gradient's scale, so a step on ``P_k`` moves ``G_k`` ``c`` times as far:
            a ``c``x learning rate for the cores that no lr scheduler can overwrite (DeepSpeed's schedulers
            set one lr on every param group). Decoupled weight decay keeps the base rate. 1 = plain cores.
    """

    def __init__(self, in_features: int, out_features: int, rank: Rank, modes: Optional[tuple[Sequence[int], Sequence[int]]] = None,
                 bias: bool = True, *, mode_size: int = 4, path: Path = "cheapest", init: str = "random",
                 dense_weight: Optional[torch.Tensor] = None, dense_bias: Optional[torch.Tensor] = None,
                 core_lr_scale: float = 1.0, device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not (core_lr_scale > 0 and math.isfinite(core_lr_scale)):
            raise ValueError(f"core_lr_scale must be a finite number > 0, got {core_lr_scale}")
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        if path not in _PATHS:
            raise ValueError(f"unknown path {path!r}; choose one of {list(_PATHS)}")
        if init not in _INITS:
            raise ValueError(f"unknown init {init!r}; choose one of {list(_INITS)}")
        if (init == "tr_svd") != (dense_weight is not None):
            raise ValueError("init='tr_svd' needs dense_weight=, and dense_weight= is only used by init='tr_svd'")
        if dense_bias is not None and not bias:
            raise ValueError("dense_bias= given but bias=False")
        self.in_features, self.out_features, self.path = in_features, out_features, path
        self.core_lr_scale = float(core_lr_scale)
        in_modes, out_modes = modes if modes is not None else (factorize(in_features, mode_size), factorize(out_features, mode_size))
        self.in_modes, self.out_modes = [int(n) for n in in_modes], [int(n) for n in out_modes]
        if math.prod(self.in_modes) != in_features or math.prod(self.out_modes) != out_features:
            raise ValueError(f"modes {self.in_modes} x {self.out_modes} do not multiply to in_features={in_features} "
                             f"and out_features={out_features}")
        d = len(self.in_modes) + len(self.out_modes)
        ranks = [int(rank)] * d if isinstance(rank, int) else [int(r) for r in rank]
        if len(ranks) != d:
            raise ValueError(f"rank has {len(ranks)} entries but this layer has {d} cores "
                             f"(modes {self.in_modes} + {self.out_modes}); give one int or one rank per core")
        if min(ranks) < 1:
            raise ValueError(f"every rank must be >= 1, got {ranks}")
        self.ranks = ranks
        factory = {"device": device, "dtype": dtype}
        for k, n in enumerate(self.modes):
            self.register_parameter(f"core_{k}", nn.Parameter(torch.empty(ranks[k], n, ranks[(k + 1) % d], **factory)))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.init_error: Optional[float] = None
        self.reset_parameters()
        if dense_weight is not None:
            self.init_error = self.init_from_dense(dense_weight)
        if dense_bias is not None:
            with torch.no_grad():
                self.bias.copy_(dense_bias)

    # ------------------------------------------------------------------ structure
    @property
    def modes(self) -> list[int]:
        return self.in_modes + self.out_modes

    @property
    def cores(self) -> list[nn.Parameter]:
        return [getattr(self, f"core_{k}") for k in range(len(self.modes))]

    def ring(self) -> list[torch.Tensor]:
        """The cores as the layer uses them: ``core_lr_scale * P_k`` (the parameters themselves when it is 1)."""
        c = self.core_lr_scale
        return self.cores if c == 1.0 else [g * c for g in self.cores]

    @property
    def boundary(self) -> int:
        """R = r_0 * r_p: the width of the two ring edges between the input and the output cores."""
        return self.ranks[0] * self.ranks[len(self.in_modes)]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, modes={self.in_modes}x{self.out_modes}, "
                f"ranks={self.ranks}, bias={self.bias is not None}, path={self.path}"
                + (f", core_lr_scale={self.core_lr_scale:g}" if self.core_lr_scale != 1.0 else ""))

    # ------------------------------------------------------------------ init
    def reset_parameters(self) -> None:
        """Variance-matched random init: Var W_ij = 1/(3 in), as nn.Linear's kaiming_uniform(a=sqrt(5))."""
        d = len(self.modes)
        target = 1.0 / (3.0 * self.in_features)
        with torch.no_grad():
            for k, g in enumerate(self.cores):
                std = math.sqrt(target ** (1.0 / d) / math.sqrt(self.ranks[k] * self.ranks[(k + 1) % d]))
                g.normal_(0.0, std / self.core_lr_scale)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_features)
                self.bias.uniform_(-bound, bound)

    @torch.no_grad()
    def init_from_dense(self, weight: torch.Tensor) -> float:
        """Set the cores by TR-SVD of ``weight`` (out, in) with tensorly; returns the relative error ||W - W_tr|| / ||W||."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"dense weight has shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}")
        factors = tr_svd(weight.detach().double().t().reshape(self.modes), self.ranks)
        for g, f in zip(self.cores, factors):
            pad = torch.randn(g.shape, dtype=torch.float64, device=f.device) * (TR_SVD_PAD * f.pow(2).mean().sqrt())
            pad[: f.shape[0], :, : f.shape[2]] = f
            g.copy_(pad / self.core_lr_scale)
        w = weight.detach().double()
        # W^T = Am @ Cm holds (in, out) plus the two half-rings; reference_weight's whole-ring contraction holds
        # r_0^2 * in * out values (torch asked for 21.7 GB at once for a 576x576 layer at rank 128)
        am, cm = self.merged()
        return float(((am.double() @ cm.double()).t() - w).norm() / w.norm().clamp_min(1e-300))

    # ------------------------------------------------------------------ compute
    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``Am`` (in, R) and ``Cm`` (R, out) with ``W^T = Am @ Cm`` (R index = (r_0 index, r_p index))."""
        p = len(self.in_modes)
        cores = self.ring()
        a = _merge(cores[:p])   # (r_0, in, r_p)
        c = _merge(cores[p:])   # (r_p, out, r_0)
        am = a.permute(1, 0, 2).reshape(self.in_features, -1)
        cm = c.permute(2, 0, 1).reshape(-1, self.out_features)
        return am, cm

    def reference_weight(self) -> torch.Tensor:
        """The dense (out, in) weight, contracting the whole ring in order and taking the trace (test oracle; it
        holds r_0^2 * in * out values, so it is for small rings only)."""
        full = _merge(self.ring())                                 # (r_0, in*out, r_0)
        w_t = torch.diagonal(full, dim1=0, dim2=2).sum(-1)          # (in*out,)
        return w_t.reshape(self.in_features, self.out_features).t()

    def choose_path(self, tokens: int) -> str:
        """The association used for a call with ``tokens`` rows (``path`` unless it is ``cheapest``)."""
        if self.path != "cheapest":
            return self.path
        f = path_flops(tokens, self.in_features, self.out_features, self.boundary)
        return "factored" if f["factored"] <= f["dense"] else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        am, cm = self.merged()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.choose_path(x2.shape[0]) == "factored":
            y = (x2 @ am) @ cm
        else:
            y = x2 @ (am @ cm)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` with :meth:`reference_weight`: the dense reference path."""
        return F.linear(x, self.reference_weight(), self.bias)

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_linear(cls, linear: nn.Module, rank: Rank, *, init: str = "random", modes=None, mode_size: int = 4,
                    path: Path = "cheapest", core_lr_scale: float = 1.0) -> "TensorRingLinear":
        """A TR layer for ``linear``, an ``nn.Linear`` or HF ``Conv1D`` (bias copied; cores random or TR-SVD of its
        weight, taken as (out, in): Conv1D stores the transpose)."""
        in_features, out_features, weight, bias = dense_view(linear)
        return cls(in_features, out_features, rank, modes, bias is not None, mode_size=mode_size,
                   path=path, init=init, dense_weight=weight if init == "tr_svd" else None,
                   dense_bias=bias, core_lr_scale=core_lr_scale, device=weight.device, dtype=weight.dtype)

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """The equivalent dense ``nn.Linear`` (for export or to undo TRD after training)."""
        g0 = self.cores[0]
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device=g0.device, dtype=g0.dtype)
        am, cm = self.merged()
        lin.weight.copy_((am @ cm).t())
        if self.bias is not None:
            lin.bias.copy_(self.bias)
        return lin


def is_hf_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` stored (in, out), the transpose of ``nn.Linear``."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def dense_view(module: nn.Module) -> tuple[int, int, torch.Tensor, Optional[torch.Tensor]]:
    """``(in_features, out_features, weight (out, in), bias)`` of an ``nn.Linear`` or HF ``Conv1D``."""
    if is_hf_conv1d(module):
        return int(module.nx), int(module.nf), module.weight.t(), module.bias
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.weight, module.bias
    raise TypeError(f"expected nn.Linear or transformers' Conv1D, got {type(module).__name__}")


def tr_svd(tensor: torch.Tensor, ranks: Sequence[int]) -> list[torch.Tensor]:
    """TR-SVD of ``tensor`` with tensorly (PyTorch backend), ranks at most ``ranks`` (one per core).

    tensorly's first SVD splits its rank into ``r_s * r_{s+1} <= n_s``: start at the largest mode and cut those
    two boundary ranks (balanced) to fit; later ranks are cut by tensorly where an unfolding is too small.
    """
    import tensorly as tl
    from tensorly.decomposition import tensor_ring

    shape, d = list(tensor.shape), tensor.dim()
    start = max(range(d), key=lambda k: shape[k])
    cap = min(shape[start], tensor.numel() // shape[start])
    r = list(ranks)
    a = min(r[start], max(1, math.isqrt(cap)))
    b = min(r[(start + 1) % d], max(1, cap // a))
    r[start], r[(start + 1) % d] = a, b
    previous = tl.get_backend()
    tl.set_backend("pytorch")
    try:
        factors = tensor_ring(tensor, rank=r + [r[0]], mode=start)
    finally:
        tl.set_backend(previous)
    return [torch.as_tensor(f) for f in factors]


# ====================================================================== policy
class TRDPolicy:
    """Replace ``nn.Linear`` and HF ``Conv1D`` modules whose qualified name matches ``include`` (``re.search``), not
    ``exclude``, and with ``min(in, out) >= min_features``, by :class:`TensorRingLinear`. Tracks which include
    patterns matched. A replaced ``Conv1D`` keeps its function (``x @ W + b``); its state-dict ``weight`` becomes
    the cores, as for ``nn.Linear``."""

    name = "trd"

    def __init__(self, rank: Rank = 16, include: Sequence[str] = TRD_DEFAULT_INCLUDE, exclude: Sequence[str] = (),
                 init: str = "random", min_features: int = 64, mode_size: int = 4, path: Path = "cheapest",
                 core_lr_scale: float = 1.0):
        if init not in _INITS:
            raise ValueError(f"unknown init {init!r}; choose one of {list(_INITS)}")
        ranks = [rank] if isinstance(rank, int) else list(rank)
        if not ranks or min(ranks) < 1:
            raise ValueError(f"trd rank must be an int >= 1 or a non-empty list of them, got {rank}")
        self.rank, self.init, self.min_features, self.mode_size, self.path = rank, init, min_features, mode_size, path
        self.core_lr_scale = core_lr_scale
        self.include = [re.compile(p) for p in include]
        self.exclude = [re.compile(p) for p in exclude]
        self.matched: dict[str, list[str]] = {p.pattern: [] for p in self.include}

    @classmethod
    def from_config(cls, cfg: Any) -> "TRDPolicy":
        """From a ``TRDConfig`` (titan_ds.config)."""
        return cls(rank=cfg.rank, include=cfg.include, exclude=cfg.exclude, init=cfg.init, min_features=cfg.min_features,
                   mode_size=cfg.mode_size, path=cfg.path, core_lr_scale=cfg.core_lr_scale)

    def matches(self, name: str, module: nn.Module) -> bool:
        if isinstance(module, TensorRingLinear):  # replaced earlier: counts as matched, is not replaced again
            for p in self.include:
                if p.search(name) and name not in self.matched[p.pattern]:
                    self.matched[p.pattern].append(name)
            return False
        if type(module) is not nn.Linear and not is_hf_conv1d(module):
            return False
        hits = [p for p in self.include if p.search(name)]
        if not hits or any(p.search(name) for p in self.exclude):
            return False
        if min(dense_view(module)[:2]) < self.min_features:
            return False
        for p in hits:
            self.matched[p.pattern].append(name)
        return True

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        try:
            return _gathered_from_linear(module, self.rank, init=self.init, mode_size=self.mode_size, path=self.path,
                                         core_lr_scale=self.core_lr_scale)
        except ValueError as e:
            n_in, n_out = dense_view(module)[:2]
            raise ValueError(f"titan.trd cannot replace {name!r} ({n_in} -> {n_out}): {e}") from None

    def detail(self, name: str, old: nn.Module, new: nn.Module) -> dict[str, Any]:
        out = {"modes": f"{new.in_modes}x{new.out_modes}", "ranks": list(new.ranks)}
        if new.init_error is not None:
            out["init_error"] = new.init_error
        return out

    def unmatched(self) -> list[str]:
        """Include patterns that matched no module (replaced now or by an earlier application) so far."""
        return [p for p, names in self.matched.items() if not names]


def _gathered_from_linear(linear: nn.Linear, rank: Rank, **kw: Any) -> TensorRingLinear:
    """``from_linear``, gathering a ZeRO-3-partitioned source first (its ``numel()`` is 0 otherwise)."""
    src = [p for p in linear.parameters() if dsc.is_zero_param(p)]
    if not src:
        return TensorRingLinear.from_linear(linear, rank, **kw)
    import deepspeed
    with deepspeed.zero.GatheredParameters(src, modifier_rank=None):
        return TensorRingLinear.from_linear(linear, rank, **kw)


def apply_trd(model: nn.Module, policy: TRDPolicy) -> ReplacementReport:
    """Apply ``policy`` to ``model``; warn, naming each include pattern that matched nothing."""
    report = apply_policies(model, [policy])
    for pat in policy.unmatched():
        warnings.warn(f"titan.trd.include pattern {pat!r} matched no nn.Linear (or HF Conv1D) with min(in, out) >= "
                      f"{policy.min_features} (qualified names look like 'blocks.0.mlp.fc' or "
                      f"'model.layers.0.self_attn.q_proj'); fix or remove it", UserWarning, stacklevel=2)
    replaced = [(e.name, model.get_submodule(e.name)) for e in report.entries]
    larger = [n for n, tr in replaced if _core_numel(tr) >= tr.in_features * tr.out_features]
    if larger:
        warnings.warn(f"titan.trd.rank {policy.rank} gives {len(larger)} of {len(report.entries)} replaced layers as many "
                      f"weights as their dense matrix or more (first: {larger[0]!r}): they compress nothing and cost "
                      f"more per step; lower trd.rank or exclude them", UserWarning, stacklevel=2)
    errors = init_errors(report)
    if errors:
        log.info("titan.trd: tr_svd relative reconstruction error ||W - W_tr|| / ||W|| per layer:\n%s",
                 "\n".join(f"  {n}: {err:.4g}" for n, err in errors.items()))
    return report


def _core_numel(tr: TensorRingLinear) -> int:
    return sum(g.ds_numel if hasattr(g, "ds_numel") else g.numel() for g in tr.cores)


def init_errors(report: ReplacementReport) -> dict[str, float]:
    """Layer name -> relative reconstruction error of its ``tr_svd`` init (empty for ``init="random"``)."""
    return {e.name: e.detail["init_error"] for e in report.entries if "init_error" in e.detail}


# ====================================================================== pillar hook
def _param_map(old: dict[str, nn.Module], model: nn.Module, report: ReplacementReport) -> dict[int, list[nn.Parameter]]:
    """id(old dense parameter) -> its replacements: weight -> the cores, bias -> the new bias."""
    out: dict[int, list[nn.Parameter]] = {}
    for e in report.entries:
        src, new = old[e.name], model.get_submodule(e.name)
        out[id(src.weight)] = list(new.cores)
        if src.bias is not None:
            out[id(src.bias)] = [new.bias]
    return out


def _remap(params: list[Any], mapping: dict[int, list[nn.Parameter]]) -> list[Any]:
    out = []
    for p in params:
        out.extend(mapping.get(id(p), [p]))
    return out


def _remap_parameters(given: Any, mapping: dict[int, list[nn.Parameter]]) -> Any:
    """The user's model_parameters (tensors or param-group dicts) with each replaced parameter swapped for its
    replacements, in place in the order given."""
    if given is None:
        return None
    given = list(given)
    if any(isinstance(g, dict) for g in given):
        return [dict(g, params=_remap(list(g["params"]), mapping)) if isinstance(g, dict) else g for g in given]
    return _remap(given, mapping)


def _stale_state(opt: Any, replaced: set[int]) -> list[str]:
    stale = [p for p in getattr(opt, "state", {}) if id(p) in replaced and opt.state[p]]
    if not stale:
        return []
    return [f"titan.trd replaces nn.Linear weights, but the optimizer passed to initialize already has state for "
            f"{len(stale)} of them (it has stepped); build the optimizer after titan_ds.initialize, or pass it as a "
            f"callable (params -> optimizer)"]


def _remap_optimizer(opt: torch.optim.Optimizer, mapping: dict[int, list[nn.Parameter]]) -> None:
    """Re-point an optimizer instance built over the dense weights at the TR parameters (same groups)."""
    stale = _stale_state(opt, set(mapping))
    if stale:
        raise ValueError(stale[0])
    for g in opt.param_groups:
        g["params"] = _remap(g["params"], mapping)
    for p in [p for p in opt.state if id(p) in mapping]:
        del opt.state[p]


class TRDPillar(Pillar):
    """``titan.trd``: replace the configured linears of the model by tensor-ring layers before DeepSpeed wraps it.

    Under ZeRO-3 the TR layers are built inside ``deepspeed.zero.Init`` (partitioned at birth) and partitioned
    sources are gathered first. An optimizer instance or ``model_parameters`` given by the user are re-pointed
    from each replaced weight to its cores (and bias to bias), keeping their param groups. Publishes the
    :class:`ReplacementReport` in ``reports["trd"]`` and registers the metrics ``trd_compression_ratio``
    (replaced layers) and ``trd_model_compression_ratio`` (whole model). ``validate`` refuses a passed optimizer
    that has state for a weight it would replace.
    """

    key = "trd"

    def validate(self, view: View) -> list[str]:
        try:
            policy = TRDPolicy.from_config(self.cfg)
        except ValueError as e:
            return [f"titan.trd: {e}"]
        replaced = {id(p) for _, m, _ in planned(view.model, [policy]) for p in m.parameters(recurse=False)}
        return _stale_state(view.optimizer, replaced) if view.optimizer is not None else []

    def apply(self, ctx: Any) -> None:
        policy = TRDPolicy.from_config(self.cfg)
        old = dict(ctx.model.named_modules())
        if ctx.zero_stage() == 3:
            import deepspeed
            with deepspeed.zero.Init(config_dict_or_path=ctx.ds_config, **ctx.zero_init_kwargs):
                report = apply_trd(ctx.model, policy)
        else:
            report = apply_trd(ctx.model, policy)
        mapping = _param_map(old, ctx.model, report)
        if isinstance(ctx.optimizer, torch.optim.Optimizer):
            _remap_optimizer(ctx.optimizer, mapping)
        ctx.model_parameters = _remap_parameters(ctx.model_parameters, mapping)
        ctx.reports["trd"] = report
        ratios = {"trd_compression_ratio": report.compression_ratio,
                  "trd_model_compression_ratio": report.model_compression_ratio}
        ctx.add_metrics(lambda: dict(ratios))
        log.info("titan.trd: %d linears -> tensor rings, %.2fx on them, %.2fx whole model", len(report.entries),
                 ratios["trd_compression_ratio"], ratios["trd_model_compression_ratio"])


PILLAR = TRDPillar
