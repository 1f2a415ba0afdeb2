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
config builds exactly that. With BSPS (``plasticity``) each unit also has a mode from its block:
Growth (the steps above, ``lr_scale`` 1), Elastic (no momentum: ``c = g``, ``lr_scale = elastic_lr_scale``,
then ``w[M] += elastic_pull * (a[M] - w[M])`` toward the block's weights ``a`` at entry, kept in one
``state_dtype`` buffer instead of the momentum), Frozen and Sleeping (nothing: no update, no state).

Works on what DeepSpeed hands it: at stage 0 the parameters; under ZeRO-1/2/3 flat fp32 partitions whose
:class:`~titan_ds.optim.layout.Layout` (units held, units split across ranks) is attached by
``titan_ds.optim.install.after_initialize`` (or :meth:`ASDT.attach_layouts`). A unit split across ranks gets
its exact k-th largest score by a collective bisection over the float bit patterns (``_kth_largest``), so
ZeRO-1/2/3 take the same steps as stage 0. State is created lazily in ``step()``, lives in ``self.state[t]``
(``step``, ``momentum``, ``anchor``, and the unit lists they cover), and only covers units that are active.

:func:`reference_step` is the plain per-unit loop of the steps above, the oracle for the flat path.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import torch

from ..utils import get_logger

from .layout import Layout, Piece, Unit, build_units, param_layout
from ..comm.tgss import CountMinSketch

__all__ = ["ASDT", "reference_step", "GROWTH", "ELASTIC", "FROZEN", "SLEEPING"]

log = get_logger("titan_ds.optim")

FROZEN, GROWTH, ELASTIC, SLEEPING = 0, 1, 2, 3
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_IMPORTANCE = ("momentum", "grad_weight", "sketch")


# ---------------------------------------------------------------------------------------------- math
def _scores(importance: str, c: torch.Tensor, g: torch.Tensor, w: torch.Tensor,
            sketch_est: Optional[torch.Tensor]) -> torch.Tensor:
    if importance == "momentum":
        return c.abs()
    if importance == "grad_weight":
        return (g * w).abs()
    if importance == "sketch":
        return sketch_est
    raise ValueError(f"unknown importance {importance!r}; choose one of {list(_IMPORTANCE)}")


def _k(density: float, numel: int) -> int:
    return max(1, min(numel, math.ceil(density * numel)))


def reference_step(units: list[tuple[torch.Tensor, torch.Tensor, dict]], *, lr: float, betas: tuple[float, float],
                   density: float, weight_decay: float, importance: str, state_dtype: torch.dtype,
                   modes: Optional[list[int]] = None, lr_scales: Optional[list[float]] = None,
                   elastic_pull: float = 0.0, sketch_est: Optional[list[torch.Tensor]] = None) -> None:
    """The docstring's steps, one unit at a time: ``units`` is ``[(w_view, g, state)]`` (1-D fp32 views).

    ``state`` holds ``momentum`` (Growth) or ``anchor`` (Elastic), created here on first use.
    """
    b1, b2 = betas
    for i, (w, g, st) in enumerate(units):
        mode = GROWTH if modes is None else modes[i]
        scale = 1.0 if lr_scales is None else lr_scales[i]
        if mode in (FROZEN, SLEEPING):
            continue
        if mode == GROWTH:
            m = st.setdefault("momentum", torch.zeros_like(w, dtype=state_dtype)).float()
            c = m * b1 + g * (1 - b1)
        else:
            st.setdefault("anchor", w.detach().clone().to(state_dtype))
            c = g.clone()
        s = _scores(importance, c, g, w, None if sketch_est is None else sketch_est[i])
        tau = torch.topk(s, _k(density, s.numel())).values[-1]
        mask = (s >= tau) & (s > 0)
        w[mask] = w[mask] - (torch.sign(c[mask]) + weight_decay * w[mask]) * (lr * scale)
        if mode == GROWTH:
            st["momentum"] = (m * b2 + g * (1 - b2)).to(state_dtype)
        else:
            a = st["anchor"].float()
            w[mask] = w[mask] + (a[mask] - w[mask]) * elastic_pull


def _bits(x: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns of non-negative floats: monotone in the value (IEEE-754)."""
    return x.float().contiguous().view(torch.int32)


def _kth_largest(scores: list[torch.Tensor], ks: list[int], pieces: list[Piece], layout: Layout) -> list[torch.Tensor]:
    """The k-th largest score of each piece's unit: local ``topk``, or a collective bisection when split."""
    taus: list[Optional[torch.Tensor]] = [None] * len(pieces)
    split_pos = {u: j for j, u in enumerate(layout.split_units)}
    local_split = []
    for i, (s, k, pc) in enumerate(zip(scores, ks, pieces)):
        if pc.unit in split_pos:
            local_split.append(i)
        else:
            taus[i] = torch.topk(s, k).values[-1]
    if layout.split_units:
        found = _bisect_split(scores, ks, pieces, layout, local_split, split_pos)
        for i in local_split:
            taus[i] = found[split_pos[pieces[i].unit]]
    return taus  # type: ignore[return-value]


def _bisect_split(scores, ks, pieces, layout: Layout, local_split: list[int], split_pos: dict[int, int]) -> torch.Tensor:
    """Exact k-th largest over units spread across ranks: bisect the int32 bit pattern (31 all-reduces of counts).

    Finds, per split unit, the largest pattern ``t`` with ``count(bits >= t) >= k`` summed over ranks, which is
    the pattern of the k-th largest value. Every rank calls this with the same ``layout.split_units``.
    """
    import deepspeed.comm as dist

    n = len(layout.split_units)
    kvec = torch.zeros(n, dtype=torch.int64)
    for i in local_split:
        kvec[split_pos[pieces[i].unit]] = ks[i]
    dist.all_reduce(kvec, op=dist.ReduceOp.MAX, group=layout.group)
    bits = {i: _bits(scores[i]) for i in local_split}
    lo = torch.zeros(n, dtype=torch.int64)
    hi = torch.full((n,), 0x7F800000, dtype=torch.int64)  # +inf
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        counts = torch.zeros(n, dtype=torch.int64)
        for i in local_split:
            j = split_pos[pieces[i].unit]
            counts[j] += int((bits[i] >= mid[j]).sum())
        dist.all_reduce(counts, group=layout.group)
        ok = counts >= kvec
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    return lo.to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------------- optimizer
class ASDT(torch.optim.Optimizer):
    """Sparse sign-momentum optimizer; see the module docstring for the algorithm.

    ``params``: tensors, ``(name, tensor)`` pairs (names are used by BSPS and delta export), or param group
    dicts whose ``params`` are such lists (per-group ``lr``/``weight_decay``/``density``/``betas``). Works unchanged under DeepSpeed ZeRO 0-3 once layouts are attached (``attach_layouts``).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 density: float = 0.1, weight_decay: float = 0.0, importance: str = "momentum",
                 state_dtype: str = "fp32", granularity: str = "tensor", block_size: int = 4096,
                 sketch_width: int = 1 << 16, sketch_depth: int = 3, sketch_seed: int = 0):
        groups = self._groups(params)
        named = [np for g in groups for np in g["params"]]
        errors = []
        if not lr > 0:
            errors.append(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            errors.append(f"betas must be in [0, 1), got {list(betas)}")
        if not 0.0 < density <= 1.0:
            errors.append(f"density must be in (0, 1], got {density}")
        if weight_decay < 0:
            errors.append(f"weight_decay must be >= 0, got {weight_decay}")
        if importance not in _IMPORTANCE:
            errors.append(f"unknown importance {importance!r}; choose one of {list(_IMPORTANCE)}")
        if state_dtype not in _DTYPES:
            errors.append(f"unknown state_dtype {state_dtype!r}; choose one of {sorted(_DTYPES)}")
        if block_size < 1:
            errors.append(f"block_size must be >= 1, got {block_size}")
        if errors:
            raise ValueError("; ".join(errors))
        defaults = dict(lr=lr, betas=tuple(betas), density=density, weight_decay=weight_decay)
        super().__init__([{**g, "params": [p for _, p in g["params"]]} for g in groups], defaults)
        self.importance, self.state_dtype = importance, _DTYPES[state_dtype]
        self.names = [n for n, _ in named]
        self.units: list[Unit] = build_units(named, granularity, block_size)
        self.units_by_param: dict[str, list[Unit]] = {}
        for u in self.units:
            self.units_by_param.setdefault(u.param, []).append(u)
        self._layouts: dict[int, tuple[torch.Tensor, Layout]] = {
            id(p): (p, param_layout(self.units_by_param[n])) for n, p in named}
        self._zero = False
        self.plasticity = None                 # a bsps.Plasticity, set by attach_plasticity
        self._block_of_unit: Optional[list[int]] = None
        self._engine_step = 0                  # last engine step begun (ZeRO: from the per-tensor step counters)
        self.sketch = CountMinSketch(sketch_width, sketch_depth, sketch_seed) if importance == "sketch" else None
        self.last_selected = 0                 # elements changed by the last engine step (sparse delta size)
        self.grad_bytes = 0                    # gradient bytes handed to the last engine step (held at step time)
        self.grad_bytes_peak = 0
        self._grad_acc = 0
        self._selected_acc = 0

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
    def attach_layouts(self, layouts: dict[int, tuple[torch.Tensor, Layout]]) -> None:
        """Use the flat-partition layouts of a ZeRO optimizer (``layout.zero_layouts``)."""
        self._layouts = dict(layouts)
        self._zero = True

    def attach_plasticity(self, plasticity: Any, block_of_unit: list[int]) -> None:
        """Drive unit modes from a :class:`~titan_ds.optim.bsps.Plasticity` (``block_of_unit[u]``: its block)."""
        if len(block_of_unit) != len(self.units):
            raise ValueError(f"block_of_unit has {len(block_of_unit)} entries for {len(self.units)} units")
        self.plasticity, self._block_of_unit = plasticity, list(block_of_unit)

    def _layout(self, t: torch.Tensor) -> Layout:
        hit = self._layouts.get(id(t))
        if hit is None or hit[0] is not t:
            raise RuntimeError(
                f"ASDT was handed a tensor of shape {tuple(t.shape)} it has no layout for. Under ZeRO-1/2/3 "
                f"DeepSpeed passes flat partitions: build the engine with titan_ds.initialize (which attaches "
                f"the layout), or call titan_ds.optim.install.attach_zero_layout(engine, optimizer)")
        return hit[1]

    def unit_mode(self, u: int) -> int:
        if self.plasticity is None:
            return GROWTH
        return self.plasticity.mode(self._block_of_unit[u])

    def unit_lr_scale(self, u: int) -> float:
        return 1.0 if self.plasticity is None else self.plasticity.lr_scale(self._block_of_unit[u])

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
                layout = self._layout(t)
                st = self.state[t]
                if not st:
                    st.update(step=0, momentum_units=[], anchor_units=[], momentum_lens={}, anchor_lens={})
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
        return loss

    def _begin_engine_step(self, step: int) -> None:
        if self._zero and self._engine_step > 0:
            self._end_engine_step()  # ZeRO: step() runs once per group/sub-group; close the previous step now
        self._engine_step = step
        if self.sketch is not None and self._zero:
            self.sketch.decay_(self.param_groups[0]["betas"][1])

    def _end_engine_step(self) -> None:
        self.last_selected, self._selected_acc = self._selected_acc, 0
        self.grad_bytes, self._grad_acc = self._grad_acc, 0
        self.grad_bytes_peak = max(self.grad_bytes_peak, self.grad_bytes)
        if self.plasticity is not None:
            self.plasticity.end_step(self._engine_step, self._distributed_group())
            if not self._zero:
                self._stage0_plasticity()
        if self.sketch is not None and not self._zero:
            self.sketch.decay_(self.param_groups[0]["betas"][1])

    def _stage0_plasticity(self) -> None:
        """Stage 0: free the state of blocks that left Growth/Elastic now, and set ``requires_grad`` for the
        next step (Frozen/Sleeping blocks compute no gradient, except at probe steps). Under ZeRO
        ``requires_grad`` is fixed at engine init, so this runs only when the optimizer holds the parameters."""
        nxt = self._engine_step + 1
        for name, p in zip(self.names, [q for g in self.param_groups for q in g["params"]]):
            units = self.units_by_param[name]
            st = self.state.get(p)
            if st:
                layout = self._layout(p)
                modes = [self.unit_mode(pc.unit) for pc in layout.pieces]
                w_flat = p.data.view(-1)
                self._resize(st, "momentum", [pc for pc, md in zip(layout.pieces, modes) if md == GROWTH], w_flat, True)
                self._resize(st, "anchor", [pc for pc, md in zip(layout.pieces, modes) if md == ELASTIC], w_flat, False)
            need = any(self.plasticity.needs_grad(self._block_of_unit[u.index], nxt) for u in units)
            p.requires_grad_(need)
            if not need:
                p.grad = None  # a frozen/sleeping block holds no gradient

    def _distributed_group(self):
        for _, lay in self._layouts.values():
            if lay.group is not None:
                return lay.group
        return None

    def _update(self, t: torch.Tensor, st: dict, layout: Layout, group: dict) -> None:
        w_flat, g_flat = t.data.view(-1), t.grad.view(-1)
        modes = [self.unit_mode(pc.unit) for pc in layout.pieces]
        self._observe(layout, modes, g_flat)
        grow = [pc for pc, md in zip(layout.pieces, modes) if md == GROWTH]
        elas = [pc for pc, md in zip(layout.pieces, modes) if md == ELASTIC]
        self._resize(st, "momentum", grow, w_flat, zero=True)
        self._resize(st, "anchor", elas, w_flat, zero=False)
        if grow or layout.split_units:
            self._apply(w_flat, g_flat, st, layout, grow, GROWTH, group)
        if elas or layout.split_units:
            self._apply(w_flat, g_flat, st, layout, elas, ELASTIC, group)

    def _observe(self, layout: Layout, modes: list[int], g_flat: torch.Tensor) -> None:
        p = self.plasticity
        if p is None:
            return
        probe = p.is_probe(self._engine_step if self._zero else self._engine_step + 1)
        for pc, md in zip(layout.pieces, modes):
            if probe or md in (GROWTH, ELASTIC):
                g = g_flat[pc.start:pc.start + pc.length]
                p.observe(self._block_of_unit[pc.unit], float(g.float().pow(2).sum()))

    def _resize(self, st: dict, key: str, pieces: list[Piece], w_flat: torch.Tensor, zero: bool) -> None:
        """Make ``st[key]`` cover exactly ``pieces`` (kept units keep their values; new ones start at 0 / w)."""
        want = [pc.unit for pc in pieces]
        have = st[f"{key}_units"]
        if want == have and key in st:
            return
        old, lens = st.get(key), {pc.unit: pc.length for pc in pieces}
        lens.update(st.get(f"{key}_lens", {}))
        pos, cur = {}, 0
        for u in have:
            pos[u] = cur
            cur += lens[u]
        parts = []
        for pc in pieces:
            if old is not None and pc.unit in pos:
                parts.append(old[pos[pc.unit]:pos[pc.unit] + pc.length])
            elif zero:
                parts.append(torch.zeros(pc.length, dtype=self.state_dtype, device=w_flat.device))
            else:
                parts.append(w_flat[pc.start:pc.start + pc.length].to(self.state_dtype))
        st.pop(key, None)  # drop our reference to the old buffer before building the new one (peak memory)
        st[key] = torch.cat(parts) if parts else torch.zeros(0, dtype=self.state_dtype, device=w_flat.device)
        st[f"{key}_units"] = want
        st[f"{key}_lens"] = {pc.unit: pc.length for pc in pieces}

    def _apply(self, w_flat, g_flat, st, layout: Layout, pieces: list[Piece], mode: int, group: dict) -> None:
        lr, (b1, b2), density, wd = group["lr"], group["betas"], group["density"], group["weight_decay"]
        buf = st["momentum"] if mode == GROWTH else st["anchor"]
        ws = [w_flat[pc.start:pc.start + pc.length] for pc in pieces]
        gs = [g_flat[pc.start:pc.start + pc.length].float() for pc in pieces]
        offs = [0]
        for pc in pieces:
            offs.append(offs[-1] + pc.length)
        bufs = [buf[offs[i]:offs[i + 1]] for i in range(len(pieces))]
        if mode == GROWTH:
            cs = [bm.float() * b1 + g * (1 - b1) for bm, g in zip(bufs, gs)]
        else:
            cs = [g.clone() for g in gs]
        est = self._sketch_scores(pieces, gs, layout, b2) if self.importance == "sketch" else [None] * len(pieces)
        scores = [_scores(self.importance, c, g, w, e) for c, g, w, e in zip(cs, gs, ws, est)]
        ks = [_k(density, self.units[pc.unit].numel) for pc in pieces]
        # split units in this mode: BSPS modes are the same on every rank, so every rank gets the same list
        lay = Layout(layout.pieces, [u for u in layout.split_units if self.unit_mode(u) == mode], layout.group)
        taus = _kth_largest(scores, ks, pieces, lay)
        for i, pc in enumerate(pieces):
            w, g, c, s = ws[i], gs[i], cs[i], scores[i]
            mask = (s >= taus[i]) & (s > 0)
            self._selected_acc += int(mask.sum())
            scale = lr * self.unit_lr_scale(pc.unit)
            new = w - (torch.sign(c) + wd * w) * scale
            if mode == ELASTIC:
                a = bufs[i].float()
                new = new + (a - new) * self.plasticity.elastic_pull
            w.copy_(torch.where(mask, new, w))
            if mode == GROWTH:
                bufs[i].copy_((bufs[i].float() * b2 + g * (1 - b2)).to(self.state_dtype))

    def _sketch_scores(self, pieces: list[Piece], gs: list[torch.Tensor], layout: Layout, b2: float) -> list[torch.Tensor]:
        """Add this call's ``(1 - beta2) * |g|`` to the TGSS sketch (all-reduced when split), then query it."""
        delta = CountMinSketch(self.sketch.width, self.sketch.depth, self.sketch.seed)
        idx = [self.units[pc.unit].global_offset + pc.unit_offset + torch.arange(pc.length) for pc in pieces]
        for i, g in zip(idx, gs):
            delta.update_at(i, g.abs() * (1 - b2))
        if layout.group is not None:
            import deepspeed.comm as dist
            dist.all_reduce(delta.table, group=layout.group)
        self.sketch.merge_(delta)
        return [self.sketch.query(i) for i in idx]

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (momentum + anchor buffers, and the TGSS table)."""
        n = sum(v.numel() * v.element_size() for st in self.state.values() for k, v in st.items()
                if isinstance(v, torch.Tensor))
        return n + (self.sketch.nbytes if self.sketch is not None else 0)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["asdt"] = {"engine_step": self._engine_step, "last_selected": self.last_selected,
                      "sketch": self.sketch.state_dict() if self.sketch is not None else None,
                      "plasticity": self.plasticity.state_dict() if self.plasticity is not None else None}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("asdt")
        if extra is None:
            raise KeyError("not an ASDT optimizer state (no 'asdt' entry); resume with the optimizer it was saved with")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "asdt"})
        for st in self.state.values():  # torch casts floating state to the param dtype: restore state_dtype
            for key in ("momentum", "anchor"):
                if key in st:
                    st[key] = st[key].to(self.state_dtype)
        self._engine_step = int(extra["engine_step"])
        self.last_selected = int(extra["last_selected"])
        if self.sketch is not None:
            self.sketch.load_state_dict(extra["sketch"])
        if (extra.get("plasticity") is None) != (self.plasticity is None):
            raise ValueError("checkpoint and optimizer disagree on BSPS (titan.plasticity): resume with the same "
                             "titan section the checkpoint was saved with")
        if self.plasticity is not None:
            self.plasticity.load_state_dict(extra["plasticity"])
            if not self._zero:
                self._restore_requires_grad()

    def _restore_requires_grad(self) -> None:
        nxt = self._engine_step + 1
        for name, p in zip(self.names, [q for g in self.param_groups for q in g["params"]]):
            p.requires_grad_(any(self.plasticity.needs_grad(self._block_of_unit[u.index], nxt)
                                 for u in self.units_by_param[name]))

    # ------------------------------------------------------------------ sparse delta
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The (name, parameter) pairs ASDT was built with (stage 0: the live weights)."""
        if self._zero:
            raise RuntimeError("under ZeRO the optimizer holds flat partitions; export deltas from the gathered "
                               "model state (titan_ds.optim.delta.save_delta(path, engine.module.state_dict(), base))")
        return list(zip(self.names, [p for g in self.param_groups for p in g["params"]]))

    def save_delta(self, path: str, base: Union[str, dict]) -> dict[str, int]:
        """Write the elements that differ from ``base`` (a state dict or its torch.save path); see delta.py."""
        from .delta import save_delta
        return save_delta(path, dict(self.named_parameters()), base)
