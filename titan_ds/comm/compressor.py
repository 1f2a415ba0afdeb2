"""``GradientReducer``: one compressor with residuals, warm-up and byte accounting, for DeepSpeed's reduce path.

A compressor turns the error-compensated gradient of one bucket into a small payload that crosses a
collective, and reconstructs the sum over ranks from what came back. ``GradientReducer`` wraps one
compressor with the pieces every method shares:

1. ``acc = flat + residual``: residuals are kept **per parameter and offset** (``Segment.key`` /
   ``Segment.param_offset``), never per bucket, because DeepSpeed's bucket composition depends on hook
   order and ``reduce_bucket_size``.
2. ``summed, sent = compressor.reduce(acc, comm, seed)``: ``summed`` is the sum over ranks of what each
   rank sent, identical on all ranks; ``sent`` is this rank's own contribution (dense, mostly zeros).
3. ``residual = acc - sent`` (error feedback) or zero (``error_feedback=False``).
   Invariant (tested): ``sent + new_residual == flat + old_residual``; with one rank ``summed == sent``.
4. Bytes handed to collectives are counted (``CountingCollective``) next to the dense bytes an
   uncompressed all-reduce of ``flat`` would have handed over.

``none`` sends the dense bucket (the uncompressed path through the same code, for byte accounting).
The pieces live in ``base.py`` (collectives, residuals, the ``Compressor`` protocol, byte budgets), the
methods in ``dense.py``, ``topk.py``, ``tgss.py`` and ``hge.py``, and their one list in ``registry.py``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .base import CountingCollective, ResidualStore, Segment, check_layout
from .registry import build_compressor

__all__ = ["GradientReducer"]

log = logging.getLogger("titan_ds.comm")


class GradientReducer:
    """One compressor plus residuals, warm-up and byte accounting: what the DeepSpeed seams call.

    ``reduce(flat, layout, comm, step)`` returns the **sum over ranks** of the (compressed) gradient, in
    ``flat``'s dtype; the seams divide where DeepSpeed would. Steps ``< warmup_steps`` go dense.

    Non-finite gradients: every compressor returns a non-finite sum on **every** rank when any rank's gradient
    holds NaN/Inf (dense and sketch sums carry it; top-k sends NaN/Inf first). DeepSpeed then skips the step on
    all ranks, and the reducer rolls its residuals back to the step's start, so a skipped step leaves them
    unchanged (and later steps are not poisoned by a NaN kept in a residual).
    """

    def __init__(self, method: str, ratio: float, *, error_feedback: bool = True, warmup_steps: int = 0,
                 rows: int = 3, seed: int = 0):
        self.compressor = build_compressor(method, ratio, rows)
        self.method, self.ratio = method, ratio
        self.error_feedback, self.warmup_steps, self.seed = error_feedback, warmup_steps, seed
        self.residuals = ResidualStore()
        self.dense_bytes = 0    # bytes an uncompressed all-reduce would have handed over, since last take
        self.wire_bytes = 0     # bytes actually handed to collectives, since last take
        self.total_dense = 0
        self.total_wire = 0
        self.calls = 0
        self.nonfinite_steps = 0
        self._step, self._call_in_step = -1, 0
        self._skipped_step: Optional[int] = None  # the step whose sum was non-finite (its residuals rolled back)

    def end_step(self) -> None:
        """After the optimizer step: keep this step's residual writes (a skipped step's were rolled back)."""
        self.residuals.commit()

    def _call_seed(self, step: int) -> int:
        if step != self._step:
            self.residuals.commit()  # a new step: the previous one's writes stand (no end_step was called)
            self._step, self._call_in_step = step, 0
        self._call_in_step += 1
        # identical on all ranks: same config seed, same step, same call order (collectives are ordered)
        return (self.seed * 1_000_003 + step * 7_919 + self._call_in_step) & 0x7FFFFFFF

    def reduce(self, flat: torch.Tensor, layout: list[Segment], comm: Any, step: int) -> torch.Tensor:
        check_layout(layout, flat.numel())
        counting = CountingCollective(comm)
        dense = flat.numel() * flat.element_size()
        seed = self._call_seed(step)
        if step < self.warmup_steps:
            summed = flat.clone()
            counting.all_reduce_sum(summed)
        else:
            acc = flat.detach().float().clone()
            if self.error_feedback:
                self.residuals.add_into(acc, layout)
            summed, sent = self.compressor.reduce(acc, counting, seed)
            if not bool(torch.isfinite(summed).all()):  # the same verdict on every rank (see the class doc)
                if self._skipped_step != step:
                    self._skipped_step = step
                    self.nonfinite_steps += 1
                    log.warning("titan compression: non-finite gradients at step %d; residuals rolled back to the "
                                "step's start (DeepSpeed skips the step on every rank)", step + 1)
                self.residuals.rollback()
            elif self.error_feedback and self._skipped_step != step:
                self.residuals.write(acc - sent, layout)
            summed = summed.to(flat.dtype)
        self.calls += 1
        self.dense_bytes += dense
        self.wire_bytes += counting.bytes
        self.total_dense += dense
        self.total_wire += counting.bytes
        return summed

    def take_metrics(self) -> dict[str, Any]:
        """Bytes since the previous call (one optimizer step when called per step), then reset the window.

        ``wire_compression_ratio`` is that window's dense/wire bytes (the steady state once warm-up is over);
        ``wire_compression_ratio_run`` counts every byte since the run began, warm-up included, across resumes
        (the totals are checkpointed). ``hge_compression_ratio`` is the seed's name for the first."""
        ratio = self.dense_bytes / self.wire_bytes if self.wire_bytes else None
        run = self.total_dense / self.total_wire if self.total_wire else None
        out = {"wire_compression_ratio": ratio, "hge_compression_ratio": ratio, "wire_compression_ratio_run": run,
               "wire_bytes": self.wire_bytes, "dense_grad_bytes": self.dense_bytes,
               "wire_bytes_run": self.total_wire, "dense_grad_bytes_run": self.total_dense,
               "compression_method": self.method,
               "compression_state_bytes": self.residuals.nbytes(), "compression_nonfinite_steps": self.nonfinite_steps}
        self.dense_bytes = self.wire_bytes = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals.state_dict(), "total_dense": self.total_dense,
                "total_wire": self.total_wire, "calls": self.calls, "method": self.method}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise RuntimeError(f"checkpoint holds residuals of compressor {state.get('method')!r} but "
                               f"titan.compression.method is {self.method!r}; resume with the same method")
        self.residuals.load_state_dict(state["residuals"])
        self.total_dense, self.total_wire = int(state["total_dense"]), int(state["total_wire"])
        self.calls = int(state["calls"])

