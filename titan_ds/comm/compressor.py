"""``GradientReducer``: one compressor with residuals, warm-up and byte accounting, for DeepSpeed's reduce path.

A compressor turns the error-compensated gradient of one bucket into a small payload that crosses a
collective, and reconstructs the sum over ranks from what came back. ``GradientReducer`` wraps one
compressor with the pieces every method shares:

1. ``acc = flat + residual``: residuals are kept **per parameter and offset** (``Segment.key`` /
   ``Segment.param_offset``), never per bucket, because DeepSpeed's bucket composition depends on hook
   order and ``reduce_bucket_size``. With ``precondition`` (``precondition.py``) ``flat`` is first divided by
   the RMS of this rank's own gradients (``rms``: a local Adam second moment) or by this rank's estimate of the
   RMS of the ranks' mean gradient (``rms_mean``), or by its own RMS shape at the level of the ranks' mean gradient,
   per tensor, from an all-reduced sign projection (``rms_sketch``). With DGC's options (``topk`` only,
   ``dgc.py``) ``flat`` is first clipped per parameter and turned into velocity, ``acc = residual + (m u + flat)``.
2. ``summed, sent = compressor.reduce(acc, comm, seed, layout=, ratio=)``: ``summed`` is the sum over ranks
   of what each rank sent, identical on all ranks; ``sent`` is this rank's own contribution (dense, mostly
   zeros, or a ``SparseSent``: values at indices, for top-k). ``ratio`` is the target, or during the sparsity
   warm-up (``ratio_warmup_steps``) the ramped one.
3. ``residual = acc - sent`` (error feedback) or zero (``error_feedback=False``).
   Invariant (tested): ``sent + new_residual == flat + old_residual``; with one rank ``summed == sent``
   (bit for bit for the sparse methods, whose ``sent`` is a copy of ``acc`` on the selected coordinates).
4. Bytes handed to collectives are counted (``CountingCollective``) next to the dense bytes an
   uncompressed all-reduce of ``flat`` would have handed over.

Every per-parameter state (residuals, DGC's momentum, a compressor's ``stores`` such as PowerSGD's ``Q``) is
a journaled :class:`~titan_ds.comm.base.ResidualStore`: rolled back together when a step is skipped, saved
together in checkpoints.

``none`` sends the dense bucket (the uncompressed path through the same code, for byte accounting).
The pieces live in ``base.py`` (collectives, residuals, the ``Compressor`` protocol, byte budgets), the
methods in ``dense.py``, ``topk.py`` (+ ``dgc.py``), ``qtopk.py``, ``randk.py``, ``tgss.py``, ``hge.py`` and
``powersgd.py``, and their one list in ``registry.py``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .base import (CountingCollective, ResidualStore, Segment, check_layout, nonfinite, subtract_sent_, workspace_zeros,
                   zero_where_sent_)
from .dgc import DGCOptions, clip_segments_, ratio_at
from .precondition import (RMSOptions, rms_mean_normalize_, rms_normalize_, rms_sketch_normalize_, sketch_key,
                           sketch_projections, sketch_signs)
from .qtopk import DEFAULT_BITS, DEFAULT_CHUNK
from .registry import build_compressor

__all__ = ["GradientReducer"]

log = logging.getLogger("titan_ds.comm")


def _read_verdict(bad: torch.Tensor) -> bool:
    """The reducer's one host read, once per step (a sync on a GPU, after the optimizer step): whether a sum of
    the step was non-finite. A seam of its own: the meta-device tests (no data to read) replace it."""
    return bool(bad)


class GradientReducer:
    """One compressor plus residuals, warm-up and byte accounting: what the DeepSpeed seams call.

    ``reduce(flat, layout, comm, step)`` returns the **sum over ranks** of the (compressed) gradient, in
    ``flat``'s dtype; the seams divide where DeepSpeed would. Steps ``< warmup_steps`` go dense; the next
    ``ratio_warmup_steps`` ramp the ratio from ``ratio_warmup_start`` to ``ratio`` (:func:`~titan_ds.comm.dgc.ratio_at`).
    ``rank``, ``min_compression`` (and ``seed``) configure ``powersgd``, ``bits``, ``chunk``, ``scale_dtype``, ``exchange`` and ``gather_share`` ``qtopk``; ``dgc`` holds DGC's momentum
    correction, masking and local clipping (``topk``).

    Non-finite gradients: every compressor returns a non-finite sum on **every** rank when any rank's gradient
    holds NaN/Inf (dense and sketch sums carry it; top-k sends NaN/Inf first; PowerSGD's summed ``P`` carries
    it). DeepSpeed then skips the step on all ranks, and the reducer rolls every store (residuals, momentum, a
    compressor's state) back to the step's start, so a skipped step leaves them unchanged (and later steps are
    not poisoned by a NaN kept in a residual). The verdict is kept on the device while the step runs (a host
    read per bucket would stall the backward on a GPU) and read once, in :meth:`end_step`, which rolls back or
    keeps the step's writes (the journal holds every store's value at the step's start either way).
    """

    def __init__(self, method: str, ratio: float, *, error_feedback: bool = True, warmup_steps: int = 0,
                 rows: int = 3, seed: int = 0, rank: int = 1, min_compression: float = 2.0,
                 dgc: Optional[DGCOptions] = None, ratio_warmup_steps: int = 0, ratio_warmup_start: float = 2.0,
                 precondition: Optional[RMSOptions] = None, bits: int = DEFAULT_BITS, chunk: int = DEFAULT_CHUNK,
                 exchange: str = "all_gather", gather_share: float = 0.5, residuals_follow_lr: bool = True,
                 scale_dtype: str = "fp32"):
        self.compressor = build_compressor(method, ratio, rows, rank=rank, min_compression=min_compression, seed=seed,
                                           bits=bits, chunk=chunk, exchange=exchange, gather_share=gather_share,
                                           scale_dtype=scale_dtype)
        self.method, self.ratio = method, ratio
        self.error_feedback, self.warmup_steps, self.seed = error_feedback, warmup_steps, seed
        if ratio_warmup_steps > 0 and not 1.0 <= ratio_warmup_start < ratio:
            raise ValueError(f"ratio_warmup_start must be in [1, ratio={ratio}) to ramp up to ratio, "
                             f"got {ratio_warmup_start}")
        self.ratio_warmup_steps, self.ratio_warmup_start = ratio_warmup_steps, ratio_warmup_start
        self.dgc = dgc if dgc is not None else DGCOptions()
        self.precondition = precondition
        # with a precondition the sum is an update direction that SGD scales by the lr: error feedback in the
        # update's units (reduce(lr=...)); the lr the last applied step used, and this step's
        self.lr_follows = residuals_follow_lr and precondition is not None and error_feedback
        self._lr_prev: Optional[float] = None
        self._lr_step: Optional[float] = None
        if precondition is not None and (self.dgc.momentum > 0 or warmup_steps > 0):
            raise ValueError("precondition='rms' hands the compressor an Adam-scaled update: it takes neither DGC's "
                             "momentum (error feedback is the accumulation) nor dense warmup_steps (their raw "
                             "gradients would reach an SGD optimizer); use ratio_warmup_steps to ramp instead")
        self.residuals = ResidualStore()
        self.momentum = ResidualStore() if self.dgc.momentum > 0 else None
        # every journaled per-parameter state: rolled back, committed and checkpointed together
        self.stores: dict[str, ResidualStore] = {"residuals": self.residuals}
        if self.momentum is not None:
            self.stores["momentum"] = self.momentum
        self.second = ResidualStore() if precondition is not None else None
        self.first = ResidualStore() if precondition is not None and precondition.kind == "rms_mean" else None
        # rms_sketch: per tensor piece, [EMA of the mean gradient's mean square, its update count]
        self.sketch = ResidualStore() if precondition is not None and precondition.kind == "rms_sketch" else None
        if self.sketch is not None:
            self.stores["mean_square_sketch"] = self.sketch
        if self.first is not None:  # rms_mean's d is not rms's v: a distinct name, so a checkpoint of one is refused
            self.stores["first_moment"] = self.first
            self.stores["mean_second_moment"] = self.second  # type: ignore[assignment]
        elif self.second is not None:
            self.stores["second_moment"] = self.second
        for name, store in getattr(self.compressor, "stores", {}).items():
            if name in self.stores:
                raise RuntimeError(f"compressor {method!r} names a store {name!r} that the reducer already has")
            self.stores[name] = store
        self.dense_bytes = 0    # bytes an uncompressed all-reduce would have handed over, since last take
        self.wire_bytes = 0     # bytes actually handed to collectives, since last take
        self.total_dense = 0
        self.total_wire = 0
        self.calls = 0
        self.nonfinite_steps = 0
        self._step, self._call_in_step = -1, 0
        self._bad: Optional[torch.Tensor] = None  # this step's verdict: some sum non-finite (0-dim bool, device)

    def end_step(self) -> None:
        """After the optimizer step: keep this step's writes, or put every store back to the step's start when a
        sum of the step was non-finite (DeepSpeed skipped the step on every rank)."""
        self._settle()
        for store in self.stores.values():
            store.commit()

    def _settle(self) -> None:
        """Read the step's non-finite verdict (the reducer's one host read, once per step) and, when it is set,
        roll every store back (the step's writes go; the same verdict on every rank)."""
        bad, self._bad = self._bad, None
        if bad is None or not _read_verdict(bad):
            if self._lr_step is not None:  # the step stands: its lr is the one its residuals are scaled to
                self._lr_prev = self._lr_step
            return
        self._lr_step = None
        self.nonfinite_steps += 1
        log.warning("titan compression: non-finite gradients at step %d; compression state rolled back to "
                    "the step's start (DeepSpeed skips the step on every rank)", self._step + 1)
        for store in self.stores.values():
            store.rollback()

    def ratio_now(self, step: int) -> float:
        """This step's target ratio: ``ratio``, or the sparsity warm-up's ramp towards it."""
        return ratio_at(step, ratio=self.ratio, warmup_steps=self.warmup_steps, ramp_steps=self.ratio_warmup_steps,
                        start=self.ratio_warmup_start)

    def _call_seed(self, step: int) -> int:
        if step != self._step:
            self.end_step()  # a new step and no end_step was called: settle the previous one
            self._step, self._call_in_step = step, 0
        self._call_in_step += 1
        # identical on all ranks: same config seed, same step, same call order (collectives are ordered)
        return (self.seed * 1_000_003 + step * 7_919 + self._call_in_step) & 0x7FFFFFFF

    def reduce(self, flat: torch.Tensor, layout: list[Segment], comm: Any, step: int, *,
               prescale: float = 1.0, consume: bool = False, lr: Optional[float] = None) -> torch.Tensor:
        """``prescale``: ``flat`` is this rank's gradient times ``prescale`` (ZeRO 1-3 pre-divide by the number of
        ranks); only ``local_clip`` needs it, so that its threshold bounds the rank's own gradient at every stage.
        ``consume``: ``flat`` is the caller's scratch (DeepSpeed's flattened bucket, overwritten by the sum
        afterwards): an fp32 ``flat`` becomes the working buffer instead of being copied. ``lr``: the lr the
        optimizer will apply this step's sum with (a host float; :meth:`follow_lr`)."""
        check_layout(layout, flat.numel())
        counting = CountingCollective(comm)
        dense = flat.numel() * flat.element_size()
        seed = self._call_seed(step)
        if self._call_in_step == 1:
            self.follow_lr(lr)
        if step < self.warmup_steps:
            summed = flat if consume else flat.clone()
            counting.all_reduce_sum(summed)
        else:
            summed = self._compressed(flat, layout, counting, seed, step, prescale, consume)
        self.calls += 1
        self.dense_bytes += dense
        self.wire_bytes += counting.bytes
        self.total_dense += dense
        self.total_wire += counting.bytes
        return summed

    def follow_lr(self, lr: Optional[float]) -> None:
        """At a step's first reduce (``residuals_follow_lr``, with a precondition and error feedback): when the
        lr differs from the last applied step's, every error-feedback residual (the reducer's and a compressor's
        ``residual_stores``) is multiplied by ``lr_prev / lr``. The residuals then hold what was not yet applied
        *in units of the parameter update* (EF-SGD's ``e + lr g``, divided by this step's lr): a coordinate left
        unsent at lr ``a`` moves the parameter by ``a`` times it when it is sent at lr ``b``, not by ``b`` times.
        Under a constant lr nothing changes (bit for bit); under a warm-up the residuals of tiny-lr steps no
        longer land at the full lr. An lr of 0 (or none yet) leaves them as they are. Journaled: a skipped step
        puts them back, and its lr is not taken."""
        if not self.lr_follows or lr is None:
            return
        lr = float(lr)
        self._lr_step = lr
        prev = self._lr_prev
        if prev is None or prev <= 0.0 or lr <= 0.0 or prev == lr:
            return
        factor = prev / lr
        for name in ("residuals", *getattr(self.compressor, "residual_stores", ())):
            self.stores[name].scale_(factor)

    def _compressed(self, flat: torch.Tensor, layout: list[Segment], comm: Any, seed: int, step: int,
                    prescale: float, consume: bool = False) -> torch.Tensor:
        if consume and flat.dtype == torch.float32:
            acc = flat.detach()  # the caller's scratch becomes the working buffer (and then the residual)
        else:  # the caller keeps flat, or it is bf16/fp16: an fp32 copy (base.workspace_zeros: its own mapping)
            acc = workspace_zeros(flat.numel(), flat.device).copy_(flat.detach().reshape(-1))
        if self.dgc.local_clip is not None:
            clip_segments_(acc, layout, self.dgc.local_clip * prescale)
        if self.second is not None:  # local RMS preconditioning (precondition.py): acc <- g / sqrt(v_hat) * prescale
            t, opts = step - self.warmup_steps + 1, self.precondition
            # in place on the stored moments (journaled: a skipped step rolls them back with the residuals)
            if self.sketch is not None:  # rms_sketch: one all-reduced projection per tensor piece first
                self._sketch_normalize(acc, layout, comm, seed, t, prescale)
            elif self.first is None:
                self.second.update_(acc, layout, lambda v, a: rms_normalize_(a, v, t, opts, prescale))  # type: ignore[arg-type]
            else:  # rms_mean: the ranks' mean gradient's RMS, estimated from this rank's two moments
                for s in layout:
                    rms_mean_normalize_(acc[s.flat_offset:s.flat_offset + s.numel], self.first.slice_(s, acc.device),
                                        self.second.slice_(s, acc.device), t, opts, comm.world_size, prescale)  # type: ignore[arg-type]
        velocity = None
        if self.momentum is not None:  # DGC momentum correction: u <- m u + g; the residual accumulates u
            velocity = torch.zeros_like(acc)
            self.momentum.add_into(velocity, layout)
            velocity.mul_(self.dgc.momentum).add_(acc)
            acc.copy_(velocity)
        if self.error_feedback:
            self.residuals.add_into(acc, layout)
        summed, sent = self.compressor.reduce(acc, comm, seed, layout=layout, ratio=self.ratio_now(step))
        bad = nonfinite(summed)  # the same verdict on every rank; read in end_step, which rolls back
        self._bad = bad if self._bad is None else self._bad | bad
        if self.error_feedback:
            # acc becomes the new residual: no temporary, and the store adopts it (no copy)
            self.residuals.write(subtract_sent_(acc, sent), layout)
        if velocity is not None:
            if self.dgc.momentum_masking:  # DGC momentum factor masking: no stale push after a send
                zero_where_sent_(velocity, sent)
            self.momentum.write(velocity, layout)  # type: ignore[union-attr]
        return summed.to(flat.dtype)

    def _sketch_normalize(self, acc: torch.Tensor, layout: list[Segment], comm: Any, seed: int, t: int,
                          prescale: float) -> None:
        """``precondition="rms_sketch"`` (precondition.py): the ranks' mean gradient's projection per segment (one
        all-reduce of ``len(layout)`` floats), its mean square's EMA per segment, then each segment normalized."""
        opts, world = self.precondition, comm.world_size
        assert opts is not None and self.sketch is not None and self.second is not None
        s1, s2 = sketch_signs(acc.numel(), seed, acc.device)
        proj = sketch_projections(acc, layout, s1, s2)
        comm.all_reduce_sum(proj)
        mean = proj / (world * prescale)  # the sum of the ranks' g * prescale, as the mean of their g
        b2 = opts.beta2
        self.second.journal_(layout, acc.device)
        for i, seg in enumerate(layout):
            key = sketch_key(seg)
            old = self.sketch.get(key)
            if old is None:
                old = acc.new_zeros(2, dtype=torch.float32)
            ms, count = old[0] * b2 + (1.0 - b2) * mean[i] * mean[i] / seg.numel, old[1] + 1.0
            self.sketch.put(key, torch.stack([ms, count]))
            level = ms / (1.0 - torch.pow(b2, count))
            rms_sketch_normalize_(acc[seg.flat_offset:seg.flat_offset + seg.numel], self.second.slice_(seg, acc.device),
                                  t, opts, level, world, prescale)

    def take_metrics(self) -> dict[str, Any]:
        """Bytes since the previous call (one optimizer step when called per step), then reset the window.
        The non-finite count includes a step whose verdict is still pending (read here).

        ``wire_compression_ratio`` is that window's dense/wire bytes (the steady state once warm-up is over);
        ``wire_compression_ratio_run`` counts every byte since the run began, warm-up included, across resumes
        (the totals are checkpointed). ``hge_compression_ratio`` is the seed's name for the first."""
        self._settle()
        ratio = self.dense_bytes / self.wire_bytes if self.wire_bytes else None
        run = self.total_dense / self.total_wire if self.total_wire else None
        out = {"wire_compression_ratio": ratio, "hge_compression_ratio": ratio, "wire_compression_ratio_run": run,
               "wire_bytes": self.wire_bytes, "dense_grad_bytes": self.dense_bytes,
               "wire_bytes_run": self.total_wire, "dense_grad_bytes_run": self.total_dense,
               "compression_method": self.method,
               "compression_state_bytes": sum(st.nbytes() for st in self.stores.values()),
               "compression_nonfinite_steps": self.nonfinite_steps}
        self.dense_bytes = self.wire_bytes = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """Residuals, the other stores (DGC's momentum, PowerSGD's ``Q``), byte totals."""
        self._settle()  # a skipped step's writes are never saved
        extra = {name: st.state_dict() for name, st in self.stores.items() if name != "residuals"}
        return {"residuals": self.residuals.state_dict(), "stores": extra, "total_dense": self.total_dense,
                "total_wire": self.total_wire, "calls": self.calls, "method": self.method,
                "lr_prev": self._lr_prev}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise RuntimeError(f"checkpoint holds residuals of compressor {state.get('method')!r} but "
                               f"titan.compression.method is {self.method!r}; resume with the same method")
        saved, wanted = set(state.get("stores", {})), set(self.stores) - {"residuals"}
        if saved != wanted:
            raise RuntimeError(f"checkpoint holds compression state {sorted(saved)} but this titan.compression "
                               f"needs {sorted(wanted)} (momentum is there only with momentum > 0); resume with "
                               f"the same titan.compression settings")
        self._bad = None
        self.residuals.load_state_dict(state["residuals"])
        for name in wanted:
            self.stores[name].load_state_dict(state["stores"][name])
        self.total_dense, self.total_wire = int(state["total_dense"]), int(state["total_wire"])
        self.calls = int(state["calls"])
        self._lr_prev, self._lr_step = state.get("lr_prev"), None  # None: a checkpoint from before the field
