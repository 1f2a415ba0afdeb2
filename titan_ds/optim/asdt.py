"""ASDT: Adaptive Sparse Delta Training, a sparse sign-momentum optimizer with one state buffer.

Algorithm (per *unit*: a parameter, or a ``block_size`` block of one when ``granularity="block"``; ``g`` the
gradient, ``w`` the weight, ``m`` the momentum, all fp32 in the arithmetic; ``m`` stored in ``state_dtype``):

1. ``c = beta1 * m + (1 - beta1) * g``                        (interpolated direction, as in Lion)
2. score ``s``: ``|c|`` (``importance="momentum"``), ``|g * w|`` (``"grad_weight"``), or the TGSS Count-Min
   estimate of the EMA of ``|g|`` (``"sketch"``, decayed by ``beta2`` once per step).
3. ``k = ceil(density * numel(unit))``; ``tau`` = the k-th largest score of the unit;
   mask ``M = (s >= tau) & (s > 0)``  (ties at ``tau`` are all kept; zero scores are never selected).
4. ``w[M] -= lr * lr_scale * (sign(c[M]) + weight_decay * w[M])``   (bounded change: at most
   ``lr * lr_scale * (1 + weight_decay * |w|)`` per element; decoupled decay on the selected elements only,
   so the applied change is a sparse delta with at most ~``density`` of the elements).
5. ``m = beta2 * m + (1 - beta2) * g``                        (every element of the unit, stored rounded to
   ``state_dtype``).

``density=1`` is Lion (Chen et al. 2023) with decoupled weight decay; ``optimizer.name="lion"`` in the titan
config builds exactly that.

``update="adaptive"`` (the sign step costs quality; docs/log.md (ASDT) has the measurements) replaces steps 1,
4 and 5 of a Growth unit by an Adam step whose second moment is *one number per unit* (Adam-mini's idea; with
``granularity="row"`` a unit is one output channel of a linear layer or one token of an embedding):

1'. ``m = beta1 * m + (1 - beta1) * g``;  ``v_u = beta2 * v_u + (1 - beta2) * mean_u(g^2)``;  ``t_u += 1``
    (``v_u`` and ``t_u``, the unit's own step count for the bias corrections, are two fp32 numbers per unit,
    in the ``second`` buffer; ``mean_u`` is over the whole unit, summed across ranks when it is split);
    ``c = (m / (1 - beta1^t_u)) / (sqrt(v_u / (1 - beta2^t_u)) + eps)``; the score of ``importance="momentum"``
    is ``|c|``.
4'. ``w[M] -= lr * lr_scale * (c[M] + weight_decay * w[M])``;  ``m`` is stored rounded to ``state_dtype``.

State: ``state_dtype`` bytes per element (the momentum) plus 8 bytes per unit. With BSPS (``plasticity``) each unit also has a mode from its block:
Growth (the steps above, ``lr_scale`` 1), Elastic (no momentum: ``c = g``, ``lr_scale = elastic_lr_scale``,
then ``w[M] += elastic_pull * (a[M] - w[M])`` toward the block's weights ``a`` at entry, kept in one
``state_dtype`` buffer instead of the momentum), Frozen and Sleeping (nothing: no update, no state).

Works on what DeepSpeed hands it: at stage 0 the parameters; under ZeRO-1/2/3 flat fp32 partitions whose
:class:`~titan_ds.optim.layout.Layout` (units held, units split across ranks) is attached by
``titan_ds.optim.install.after_initialize`` (or :meth:`ASDT.attach_layouts`). A unit split across ranks gets
its exact k-th largest score by a collective bisection over the float bit patterns
(:func:`~titan_ds.optim.layout.kth_largest`), so ZeRO-1/2/3 take the same steps as stage 0. State is created
lazily in ``step()`` and only covers units that are active: ``self.state[t]`` holds ``step``, the
``momentum`` and ``anchor`` buffers, and ``units``, one :class:`~titan_ds.optim.layout.UnitState` record per
active unit saying where its slice of a buffer lies.

**Step in backward** (:meth:`ASDT.attach_backward_steps`, ``titan.optimizer.step_in_backward``; stage 0 only): each
parameter is updated in its post-accumulate-grad hook, as soon as autograd has its whole gradient, and the
gradient is freed at once, so at most one parameter's gradient exists at a time instead of all of them. The
per-tensor update is the one ``step()`` runs, so the steps are bit-identical to ``step()``'s when nothing
needs every gradient first: no accumulation over micro-batches, no BSPS, no sketch, and no gradient clipping.
Clipping needs the global norm before the first update; with ``max_norm`` the hooks clip by the *previous*
step's global norm instead (the norm of this step is summed as the gradients arrive). ``step()`` then only
closes the engine step and sets the next step's clipping coefficient.

**On a GPU** the step makes its tensors on the parameters' device and reads nothing back to the host: the
elements changed (:attr:`ASDT.last_selected`) and step in backward's gradient norm (:attr:`ASDT.last_grad_norm`)
stay device tensors until read, the clipping coefficient is computed on the device, and BSPS's signals are
summed there and read once per engine step, when BSPS decides its transitions. ``tests/optim/test_meta_device.py``
runs every update with its tensors on the ``meta`` device, where a mixed-device op or a host read raises.

**Where the steps run** (:meth:`ASDT._update` dispatches each tensor): density 1 with no BSPS and no sketch on
the chunked dense core (:mod:`~titan_ds.optim.core`); otherwise, unless a unit is split across ZeRO ranks, on
the sparse strategy over the same chunks (:mod:`~titan_ds.optim.sparse`: each unit's top-k threshold by a
chunked exact selection; the sketch's scores from :mod:`~titan_ds.optim.sketch`); a tensor with split units on
the flat path (:mod:`~titan_ds.optim.flat`: :func:`~titan_ds.optim.asdt_math.asdt_update` on its whole fp32
state, with the collectives), the oracle of the chunked strategies. :func:`reference_step` is an independent
plain per-unit loop of the same steps, the oracle of all. :class:`ASDT` does the bookkeeping around them (which
units, their layout in what DeepSpeed hands over, metrics); BSPS's step side (modes, the buffers that follow
them, signals, ``requires_grad`` at stage 0) is in :mod:`~titan_ds.optim.bsps_step` and the checkpoint format in
:mod:`~titan_ds.optim.asdt_state`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..utils import get_logger

from ..comm.tgss import CountMinSketch
from .bsps import ELASTIC, FROZEN, GROWTH, SLEEPING
from . import core, sparse
from .asdt_math import IMPORTANCE, asdt_update, local_kth_largest, reference_step
from .asdt_state import _BUFFER, _SECOND, _VARIANCE, CheckpointState, _from_saved
from .bsps_step import PlasticitySteps
from .flat import FlatPath
from .layout import Layout, LayoutMap, Piece, Unit, build_units, param_layout
from .sketch import SketchScores

__all__ = ["ASDT", "asdt_update", "local_kth_largest", "reference_step", "GROWTH", "ELASTIC", "FROZEN", "SLEEPING"]

log = get_logger("titan_ds.optim")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_QUANT = ("8bit", "4bit")  # block-wise quantized state (qstate.py): codes + one fp32 absmax per block
_UPDATES = ("sign", "adaptive")
_ROUNDINGS = ("stochastic", "nearest")  # how bf16 weights are written (fp32 weights: exact either way)
_SECOND_MOMENTS = ("unit", "coordinate")


def _clip_(grad: torch.Tensor, coef: Union[float, torch.Tensor]) -> None:
    """``grad *= coef`` (step in backward's clipping) as ``grad.mul_(float(coef))`` computes it, the product in fp32
    rounded to the gradient's dtype, without reading a tensor ``coef`` back to the host."""
    if not isinstance(coef, torch.Tensor):
        if coef < 1.0:
            grad.mul_(coef)
    elif grad.dtype == torch.float32:
        grad.mul_(coef.float())
    else:  # a 0-dim tensor operand would be rounded to the gradient's dtype first (bf16); a float is not
        grad.copy_(grad.float().mul_(coef.float()))


def _device_generator(device: Union[str, torch.device], seed: int) -> torch.Generator:
    """The seeded generator of ``device`` that stochastic rounding draws from (CPU and accelerators have their own;
    the ``meta`` device of the GPU-readiness tests has none, so they replace this one function)."""
    return torch.Generator(device=device).manual_seed(seed)


# ---------------------------------------------------------------------------------------------- optimizer
def _check(lr: float, betas: tuple[float, float], density: float, weight_decay: float, importance: str,
           state_dtype: str, block_size: int, update: str = "sign", eps: float = 1e-8,
           update_clip: Optional[float] = None, second_moment: str = "unit",
           second_dtype: str = "fp32") -> None:
    errors = []
    if second_moment not in _SECOND_MOMENTS:
        errors.append(f"unknown second_moment {second_moment!r}; choose one of {list(_SECOND_MOMENTS)}")
    elif second_moment == "coordinate" and update != "adaptive":
        errors.append("second_moment=\"coordinate\" needs update=\"adaptive\" (the sign update has no second moment)")
    if second_dtype not in (*_DTYPES, *_QUANT):
        errors.append(f"unknown second_dtype {second_dtype!r}; choose one of {[*_DTYPES, *_QUANT]}")
    elif second_dtype != "fp32" and second_moment != "coordinate":
        errors.append(f"second_dtype={second_dtype!r} needs second_moment=\"coordinate\" (the per-unit second "
                      f"moment is two fp32 numbers per unit)")
    if update_clip is not None and (update != "adaptive" or not update_clip > 0):
        errors.append(f"update_clip={update_clip} needs update=\"adaptive\" and a value > 0 (None: off)")
    if update not in _UPDATES:
        errors.append(f"unknown update {update!r}; choose one of {list(_UPDATES)}")
    if not eps >= 0:
        errors.append(f"eps must be >= 0, got {eps}")
    if not lr > 0:
        errors.append(f"lr must be > 0, got {lr}")
    if not all(0.0 <= b < 1.0 for b in betas):
        errors.append(f"betas must be in [0, 1), got {list(betas)}")
    if not 0.0 < density <= 1.0:
        errors.append(f"density must be in (0, 1], got {density}")
    if weight_decay < 0:
        errors.append(f"weight_decay must be >= 0, got {weight_decay}")
    if importance not in IMPORTANCE:
        errors.append(f"unknown importance {importance!r}; choose one of {list(IMPORTANCE)}")
    if state_dtype not in (*_DTYPES, *_QUANT):
        errors.append(f"unknown state_dtype {state_dtype!r}; choose one of {[*_DTYPES, *_QUANT]}")
    if block_size < 1:
        errors.append(f"block_size must be >= 1, got {block_size}")
    if errors:
        raise ValueError("; ".join(errors))


class ASDT(CheckpointState, PlasticitySteps, FlatPath, torch.optim.Optimizer):
    """Sparse sign-momentum optimizer; see the module docstring for the algorithm.

    ``params``: tensors, ``(name, tensor)`` pairs (names are used by BSPS and delta export), or param group
    dicts whose ``params`` are such lists (per-group ``lr``/``weight_decay``/``density``/``betas``). Works
    unchanged under DeepSpeed ZeRO 0-3 once layouts are attached (``attach_layouts``).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 density: float = 0.1, weight_decay: float = 0.0, importance: str = "momentum",
                 state_dtype: str = "fp32", granularity: str = "tensor", block_size: int = 4096,
                 sketch_width: int = 1 << 16, sketch_depth: int = 3, sketch_seed: int = 0, update: str = "sign",
                 eps: float = 1e-8, update_clip: Optional[float] = None, second_moment: str = "unit",
                 second_dtype: str = "fp32", rounding: str = "stochastic", rounding_seed: int = 0,
                 compile: bool = False):
        groups = self._groups(params)
        named = [np for g in groups for np in g["params"]]
        _check(lr, betas, density, weight_decay, importance, state_dtype, block_size, update, eps, update_clip,
               second_moment, second_dtype)
        self.update, self.eps, self.update_clip = update, eps, update_clip
        self.compile = bool(compile)  # the dense step's chunks on core's compiled graphs (else TITAN_CORE_COMPILE)
        if rounding not in _ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}: choose one of {list(_ROUNDINGS)}")
        # bf16 weights (no fp32 master copy) are written with stochastic rounding from these generators, one per
        # device, seeded alike on every rank (stage 0 data parallel: every rank must take the same step)
        self.rounding, self.rounding_seed = rounding, int(rounding_seed)
        self._generators: dict[str, torch.Generator] = {}
        self._runs: dict[Any, Any] = {}  # update="adaptive": the runs of consecutive units of each tensor
        self._slices: dict[Any, Any] = {}  # the chunked core's plan of each tensor (core.plan), with its layout
        defaults = dict(lr=lr, betas=tuple(betas), density=density, weight_decay=weight_decay)
        super().__init__([{**g, "params": [p for _, p in g["params"]]} for g in groups], defaults)
        # quantized kinds ("8bit"/"4bit") are stored packed between steps and worked on in fp32 (qstate.py); an
        # Elastic unit's anchor (a copy of its weights) is then kept in bf16
        self.quant = state_dtype if state_dtype in _QUANT else None
        self.second_moment = second_moment
        self.second_quant = second_dtype if second_dtype in _QUANT else None
        self.importance = importance
        self.state_dtype = torch.float32 if self.quant else _DTYPES[state_dtype]
        self.anchor_dtype = torch.bfloat16 if self.quant else self.state_dtype
        self.second_dtype = torch.float32 if self.second_quant else _DTYPES[second_dtype]
        if self.quant or self.second_quant:
            from . import qstate
            qstate.qmap(self.quant or self.second_quant, True)  # fail now, with the fix, if torchao is missing
        self.names = [n for n, _ in named]
        self.units: list[Unit] = build_units(named, granularity, block_size)
        self.units_by_param: dict[str, list[Unit]] = {}
        for u in self.units:
            self.units_by_param.setdefault(u.param, []).append(u)
        self._layouts = LayoutMap({id(p): (p, param_layout(self.units_by_param[n])) for n, p in named}, zero=False)
        self.plasticity = None                 # a bsps.Plasticity, set by attach_plasticity
        self._block_of_unit: Optional[list[int]] = None
        self._engine_step = 0                  # last engine step begun (ZeRO: from the per-tensor step counters)
        self.sketch = CountMinSketch(sketch_width, sketch_depth, sketch_seed) if importance == "sketch" else None
        # elements changed by the last engine step (sparse delta size): a device tensor until read (last_selected)
        self._last_selected: Union[int, torch.Tensor] = 0
        self.grad_bytes = 0                    # gradient bytes handed to the last engine step (held at step time)
        self.grad_bytes_peak = 0
        self._grad_acc = 0
        self._selected_acc = 0
        self.step_in_backward = False          # attach_backward_steps: update each tensor in its grad hook
        self._clip_max = 0.0                   # step in backward: clip at this global norm (0: off) ...
        # ... with the coefficient of the previous step's norm: 1.0, then a 0-dim fp64 tensor on the gradients'
        # device (computed there, so that no step reads the norm back to the host)
        self._clip_coef: Union[float, torch.Tensor] = 1.0
        self._grad_sq: Optional[torch.Tensor] = None  # the sum of squares of this step's gradients so far
        self._grad_norm: Optional[torch.Tensor] = None  # step in backward: the last step's norm (last_grad_norm)
        self._signal_sq: Optional[torch.Tensor] = None  # BSPS: each block's sum of squared gradients this step
        self._hooks: list[Any] = []
        self._stepped: set[int] = set()        # tensors updated by a hook in the engine step under way
        self._grad_scales: dict[int, Any] = {}  # id(tensor) -> the factor its next step reads its gradient by

    @property
    def last_selected(self) -> int:
        """Elements changed by the last engine step (the size of its sparse delta). Reading it waits for the step's
        updates (a host sync on a GPU): nothing titan runs every step reads it; its per-step metric is
        :attr:`last_selected_lazy`, read when it is logged."""
        return int(self._last_selected)

    @property
    def last_selected_lazy(self) -> Union[int, torch.Tensor]:
        """:attr:`last_selected` as it is held, without reading it: a 0-dim tensor on the parameters' device after
        a step (an int before the first). The ``asdt_changed_elements`` metric; ``int()`` of it is the sync."""
        return self._last_selected

    @last_selected.setter
    def last_selected(self, value: int) -> None:
        self._last_selected = int(value)

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Step in backward: the global gradient norm of the last step (None before one); a host sync, like
        :attr:`last_selected` (nothing titan runs every step reads it)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @staticmethod
    def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
        """Param groups with ``(name, tensor)`` lists: from tensors, (name, tensor) pairs, or group dicts."""
        items = list(params)
        dicts = items if items and all(isinstance(it, dict) for it in items) else [{"params": items}]
        out, i = [], 0
        for d in dicts:
            named = []
            for it in d["params"]:
                if isinstance(it, tuple):
                    named.append((str(it[0]), it[1]))
                elif isinstance(it, torch.Tensor):
                    named.append((f"param{i}", it))
                else:
                    raise TypeError(f"ASDT params must be tensors or (name, tensor) pairs, got {type(it).__name__}")
                i += 1
            out.append({**d, "params": named})
        if i == 0:
            raise ValueError("ASDT got an empty parameter list")
        return out

    # ------------------------------------------------------------------ wiring (install.py)
    @property
    def _zero(self) -> bool:
        return self._layouts.zero

    def attach_layouts(self, layouts: dict[int, tuple[torch.Tensor, Layout]]) -> None:
        """Use the flat-partition layouts of a ZeRO optimizer (``layout.zero_layouts``)."""
        self._layouts = LayoutMap(layouts, zero=True)

    def attach_plasticity(self, plasticity: Any, block_of_unit: list[int]) -> None:
        """Drive unit modes from a :class:`~titan_ds.optim.bsps.Plasticity` (``block_of_unit[u]``: its block)."""
        if len(block_of_unit) != len(self.units):
            raise ValueError(f"block_of_unit has {len(block_of_unit)} entries for {len(self.units)} units")
        self.plasticity, self._block_of_unit = plasticity, list(block_of_unit)

    def unit_mode(self, u: int) -> int:
        if self.plasticity is None:
            return GROWTH
        return self.plasticity.mode(self._block_of_unit[u])

    def unit_lr_scale(self, u: int) -> float:
        return 1.0 if self.plasticity is None else self.plasticity.lr_scale(self._block_of_unit[u])

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, [p for g in self.param_groups for p in g["params"]]))

    def fold_grad_scale(self, t: torch.Tensor, scale: Any) -> None:
        """``t``'s next step reads its gradient times ``scale`` (a float or a 0-dim fp32 tensor): bit for bit the
        step after ``t.grad.mul_(scale)``, without that pass where the dense core folds it (titan HMS hands ZeRO-3's
        unscale and clip factor over here instead of letting ZeRO-3 scale the gradient in place:
        titan_ds/hms/install.py, ``fold_unscale``). Other update paths scale the gradient first, as the pass
        would. ``t.grad``'s values after the step are unspecified (scaled or not)."""
        self._grad_scales[id(t)] = scale

    # ------------------------------------------------------------------ step in backward
    def attach_backward_steps(self, all_reduce: Optional[Callable[[torch.Tensor], None]] = None,
                              max_norm: float = 0.0) -> None:
        """Update each parameter in its post-accumulate-grad hook and free its gradient (see the module
        docstring). ``all_reduce``, when given, averages a gradient across data-parallel ranks in place before
        its update (every rank's backward fires the hooks in the same order). ``max_norm > 0``: clip by the
        *previous* step's global gradient norm (the current one is known only when backward ends). Stage 0
        only; refuses BSPS and the sketch, which need every gradient of the step before the first update."""
        if self._zero:
            raise ValueError("step in backward needs the parameters themselves (ZeRO stage 0); under ZeRO 1-3 "
                             "the optimizer steps on flat partitions after the reduction")
        if self.plasticity is not None or self.sketch is not None:
            raise ValueError("step in backward cannot run with BSPS or importance=\"sketch\": both need every "
                             "gradient of the step before the first update")
        if self.step_in_backward:
            return
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0: no clipping), got {max_norm}")
        self._clip_max = float(max_norm)
        for group in self.param_groups:
            for t in group["params"]:
                self._hooks.append(t.register_post_accumulate_grad_hook(
                    lambda t, group=group: self._backward_step(t, group, all_reduce)))
        self.step_in_backward = True

    def detach_backward_steps(self) -> None:
        """Remove the hooks of :meth:`attach_backward_steps`; ``step()`` updates from ``.grad`` again."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.step_in_backward = [], False

    @torch.no_grad()
    def _backward_step(self, t: torch.Tensor, group: dict[str, Any],
                       all_reduce: Optional[Callable[[torch.Tensor], None]]) -> None:
        if t.grad is None:
            return
        if id(t) in self._stepped:
            raise RuntimeError("titan.optimizer.step_in_backward: a parameter got its gradient twice in one step "
                               "(gradient accumulation, a second backward, or a weight shared across reentrant "
                               "recompute segments); set step_in_backward=false for this model")
        self._stepped.add(id(t))
        if all_reduce is not None:
            all_reduce(t.grad)
        # the global norm of this step's (unclipped, averaged) gradients, summed as they arrive; it sets the
        # clipping of the next step (DeepSpeed's formula: coef = max_norm / (norm + 1e-6), applied when < 1)
        if self._clip_max > 0:  # one more pass over the gradient, only when something clips with it
            sq = torch.linalg.vector_norm(t.grad.float()).double() ** 2
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq
        _clip_(t.grad, self._clip_coef)
        st = self._tensor_state(t)
        st["step"] = self._engine_step + 1
        # gradient bytes held at once: one tensor's, freed below before the next hook runs
        self._grad_acc = max(self._grad_acc, t.grad.numel() * t.grad.element_size())
        self._update(t, st, self._layouts.of(t), group)
        t.grad = None

    def held_grad_bytes(self) -> int:
        """Step in backward: the largest gradient held at once in the current (or, after ``step()``, the last)
        engine step; the gradients are gone by the time ``step()`` runs. 0 otherwise."""
        return max(self._grad_acc, self.grad_bytes) if self.step_in_backward else 0

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for t in group["params"]:
                if t.grad is None:
                    continue
                layout = self._layouts.of(t)
                st = self._tensor_state(t)
                st["step"] += 1
                if self._zero:  # every flat partition has a gradient every step: counters run in lockstep
                    if st["step"] > self._engine_step:
                        self._begin_engine_step(st["step"])
                else:  # stage 0: a parameter that was frozen has skipped steps; its step is the engine step
                    st["step"] = self._engine_step + 1
                self._grad_acc += t.grad.numel() * t.grad.element_size()  # after a new step was begun
                self._update(t, st, layout, group)
        if not self._zero:
            self._begin_engine_step(self._engine_step + 1)
            self._end_engine_step()
        if self._grad_sq is not None:  # step in backward: this step's norm clips the next step
            self._grad_norm = self._grad_sq.sqrt()
            if self._clip_max > 0:  # min(1, max_norm / (norm + 1e-6)) in fp64, on the device: no host sync
                norm = self._grad_norm
                coef = torch.full_like(norm, self._clip_max) / (norm + 1e-6)  # (not max_norm / t: a reciprocal)
                self._clip_coef = torch.where(coef < 1.0, coef, torch.ones_like(coef))  # NaN norm: 1, as min()
            self._grad_sq = None
        self._stepped.clear()
        self._grad_scales.clear()  # (a factor for a tensor that had no gradient this step is not kept)
        return loss

    def _tensor_state(self, t: torch.Tensor) -> dict[str, Any]:
        st = self.state[t]
        if not st:
            st.update(step=0, units=[])
        elif "units" not in st:  # the saved form, put back directly (HMS restores optimizer state itself)
            _from_saved(st)
        return st

    def _begin_engine_step(self, step: int) -> None:
        if self._zero and self._engine_step > 0:
            self._end_engine_step()  # ZeRO: step() runs once per group/sub-group; close the previous step now
        self._engine_step = step
        if self.sketch is not None and self._zero:
            self.sketch.decay_(self.param_groups[0]["betas"][1])

    def _end_engine_step(self) -> None:
        self._last_selected, self._selected_acc = self._selected_acc, 0
        self.grad_bytes, self._grad_acc = self._grad_acc, 0
        self.grad_bytes_peak = max(self.grad_bytes_peak, self.grad_bytes)
        if self.plasticity is not None:
            group = self._layouts.group()
            if group is not None:
                self._sum_signals(group)
            self._hand_signals()
            self.plasticity.end_step(self._engine_step)
            if not self._zero:
                self._stage0_plasticity()
        if self.sketch is not None and not self._zero:
            self.sketch.decay_(self.param_groups[0]["betas"][1])

    def _generator(self, t: torch.Tensor) -> Optional[torch.Generator]:
        """The stochastic-rounding generator for ``t``'s device, when ``t`` is bf16 (else None: nothing to round)."""
        if self.rounding != "stochastic" or t.dtype != torch.bfloat16:
            return None
        key = str(t.device)
        if key not in self._generators:
            self._generators[key] = self._new_generator(t.device, self.rounding_seed)
        return self._generators[key]

    @staticmethod
    def _new_generator(device: Union[str, torch.device], seed: int) -> torch.Generator:
        return _device_generator(device, seed)  # (looked up at each call: the meta-device tests replace it)

    def _dense(self, group: dict[str, Any]) -> bool:
        """Whether a tensor of ``group`` steps on the chunked core (core.py): density 1, no BSPS modes, no sketch
        (and, checked per tensor, no unit split across ranks for the per-unit second moment)."""
        return group["density"] >= 1.0 and self.plasticity is None and self.sketch is None

    def _dense_update(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, group: dict[str, Any],
                      grad_scale: Any = None) -> None:
        """``t``'s step on :func:`core.dense_step`, chunk by chunk on the stored (quantized) state."""
        fresh = "momentum" not in st
        if fresh:  # the first step works on zeros made in the working form (fp32), stored quantized after it
            self._place(t, st, layout)  # (a zero stored 4-bit unsigned decodes to 1/16 of a tiny absmax, not 0)
        key = id(t)
        slices = self._slices.get(key)
        if slices is None or slices[0] is not layout:  # per layout, not per step: a row-unit embedding has ~50k
            slices = self._slices[key] = (layout, core.plan(layout.pieces),  # units (core.block_starts caches
                                          tuple(pc.length for pc in layout.pieces),  # their blocks per lengths)
                                          [self.units[pc.unit].numel for pc in layout.pieces])
        lengths = slices[2]
        adaptive = self.update == "adaptive"
        coordinate = self.second_moment == "coordinate"
        acc = self._selected_acc  # the fused op (core_triton) adds into it on the device: no op of its own
        count = acc if isinstance(acc, torch.Tensor) and acc.device == t.device and acc.dtype == torch.int64 \
            and acc.dim() == 0 else None
        selected = core.dense_step(
            t.data.view(-1), t.grad.view(-1), slices[1],
            core.StateBuffer.of(st, "momentum", self.quant, True, lengths),
            variance=core.StateBuffer.of(st, _VARIANCE, self.second_quant, False, lengths)
            if adaptive and coordinate else None,
            unit_numels=slices[3] if adaptive and not coordinate else None,
            seconds=st[_SECOND].view(-1, 2) if adaptive else None, lr=group["lr"], betas=group["betas"],
            weight_decay=group["weight_decay"], importance=self.importance, update=self.update, eps=self.eps,
            update_clip=self.update_clip if adaptive else None, generator=self._generator(t),
            compiled=None if fresh or not self.compile else True,  # fresh: the one step on fp32 working state
            count=count, grad_scale=grad_scale)
        if selected is not count:
            self._selected_acc = selected if isinstance(acc, int) and acc == 0 else acc + selected
        if fresh:
            self._pack(st)

    def _update(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, group: dict[str, Any]) -> None:
        scale = self._grad_scales.pop(id(t), None)
        if self._dense(group) and not (layout.split_units and self.update == "adaptive"
                                       and self.second_moment == "unit"):
            self._dense_update(t, st, layout, group, scale)
            return
        if scale is not None:
            t.grad.mul_(scale)
        if not layout.split_units:
            self._sparse_update(t, st, layout, group)
            return
        self._flat_update(t, st, layout, group)

    def _sparse_update(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, group: dict[str, Any]) -> None:
        """``t``'s step on :func:`sparse.sparse_step` (density < 1, BSPS modes, the sketch; no unit split across
        ranks), chunk by chunk on the stored (quantized) state. When BSPS changed which units hold state (and on
        the first step), the buffers are re-placed in their working form (fp32) and stored quantized after it."""
        self._observe(layout, t.grad.view(-1))
        by_mode = self._pieces_by_mode(layout)
        replace = not self._placed(st, by_mode)
        if replace:
            self._unpack(st)
            self._place(t, st, layout)
        for mode in (GROWTH, ELASTIC):
            if by_mode[mode]:
                self._sparse_mode(t, st, layout, by_mode[mode], mode, group)
        if replace:
            self._pack(st)

    def _sparse_mode(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, pieces: list[Piece], mode: int,
                     group: dict[str, Any]) -> None:
        """The units of one mode held in ``t`` on :func:`sparse.sparse_step`."""
        key = (id(t), mode)
        plan = self._slices.get(key)
        if plan is None or plan[0] is not pieces:  # cached while the pieces are the layout's (no BSPS)
            plan = (pieces, core.plan(pieces, parts=sparse.PARTS, least=min(core.CHUNK, sparse.CHUNK)),
                    tuple(pc.length for pc in pieces),
                    [self.units[pc.unit].numel for pc in pieces])
            if pieces is layout.pieces:
                self._slices[key] = plan
        _, slices, lengths, numels = plan
        w_flat, g_flat = t.data.view(-1), t.grad.view(-1)
        adaptive = self.update == "adaptive" and mode == GROWTH
        coordinate = adaptive and self.second_moment == "coordinate"
        state = core.StateBuffer.of(st, _BUFFER[mode], self.quant if mode == GROWTH else None, True, lengths)
        scores = None
        if self.sketch is not None:
            scores = SketchScores(self.sketch, self.units, pieces, t.device)
            scores.add(slices, g_flat, group["betas"][1], layout.group)
        self._selected_acc += sparse.sparse_step(
            w_flat, g_flat, slices, lr=group["lr"], betas=group["betas"], density=group["density"],
            weight_decay=group["weight_decay"], unit_numels=numels, importance=self.importance, update=self.update,
            momentum=state if mode == GROWTH else None, anchor=state if mode == ELASTIC else None,
            variance=core.StateBuffer.of(st, _VARIANCE, self.second_quant, False, lengths) if coordinate else None,
            seconds=st[_SECOND].view(-1, 2) if adaptive else None, eps=self.eps,
            update_clip=self.update_clip if adaptive else None,
            lr_scales=None if self.plasticity is None else [self.unit_lr_scale(pc.unit) for pc in pieces],
            elastic_pull=self.plasticity.elastic_pull if self.plasticity is not None else 0.0, scores=scores,
            generator=self._generator(t))

    def _quantized(self) -> list[tuple[str, str, bool]]:
        """(buffer, kind, signed) of the buffers stored quantized."""
        out = [("momentum", self.quant, True)] if self.quant else []
        return out + ([(_VARIANCE, self.second_quant, False)] if self.second_quant else [])

    def _unpack(self, st: dict[str, Any]) -> None:
        """Quantized buffers to their fp32 working form, for one tensor's update (qstate.py)."""
        from . import qstate
        for key, kind, signed in self._quantized():
            if f"{key}_absmax" in st:
                lens = [r.length for r in st["units"] if r.buffer == key]
                st[key] = qstate.dequantize(st[key], st.pop(f"{key}_absmax"), lens, kind, signed)

    def _pack(self, st: dict[str, Any]) -> None:
        """Back to codes + block absmax; blocks restart at each unit's record (see qstate.py)."""
        from . import qstate
        for key, kind, signed in self._quantized():
            if key in st and f"{key}_absmax" not in st:
                lens = [r.length for r in st["units"] if r.buffer == key]
                st[key], st[f"{key}_absmax"] = qstate.quantize(st[key], lens, kind, signed)

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (momentum + anchor buffers, and the TGSS table)."""
        n = sum(v.numel() * v.element_size() for st in self.state.values() for k, v in st.items()
                if isinstance(v, torch.Tensor))
        return n + (self.sketch.nbytes if self.sketch is not None else 0)

    # ------------------------------------------------------------------ sparse delta
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The (name, parameter) pairs ASDT was built with (stage 0: the live weights)."""
        if self._zero:
            raise RuntimeError("under ZeRO the optimizer holds flat partitions; export deltas from the gathered "
                               "model state (titan_ds.optim.delta.save_delta(path, engine.module.state_dict(), base))")
        return self._params()

    def save_delta(self, path: str, base: Union[str, dict]) -> dict[str, int]:
        """Write the elements that differ from ``base`` (a state dict or its torch.save path); see delta.py."""
        from .delta import save_delta
        return save_delta(path, dict(self.named_parameters()), base)
