"""Local updates (``titan.compression.sync_every > 1``) on one DeepSpeed engine, ZeRO stage 0, fp32.

What changes on the engine (all through :mod:`titan_ds.deepspeed_compat` / the init context, undone by
``uninstall`` or by a failed ``initialize``'s transaction):

* ``engine.enable_backward_allreduce = False`` (:func:`~titan_ds.deepspeed_compat.backward_allreduce`): backward
  no longer all-reduces ``.grad``; each rank's optimizer steps on its own gradient (the inner step);
* an after-step lifecycle callback: when an optimizer step made ``engine.global_steps`` a multiple of
  ``sync_every``, :meth:`~titan_ds.comm.diloco.OuterStep.sync` runs over the data-parallel group (a skipped step,
  or a micro-step inside gradient accumulation, does not advance ``global_steps`` and does not sync).

Checkpoints: between syncs every rank holds its own parameters and (always) its own inner optimizer state, and
DeepSpeed writes the model and optimizer of data-parallel rank 0 only. :meth:`LocalUpdateHooks.state_dict`
therefore gathers every rank's parameters, inner optimizer state and residuals (``all_gather_object``; W copies
in rank 0's ``client_state``) next to the outer state (anchor, momentum, rounds: identical on all ranks), and
:meth:`~LocalUpdateHooks.load_state_dict` puts each rank's own back after DeepSpeed loaded rank 0's.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import deepspeed_compat as dsc
from .diloco import OuterStep
from .wire import DistCollective

__all__ = ["LocalUpdateHooks"]

log = logging.getLogger("titan_ds.comm")


class LocalUpdateHooks:
    """DiLoCo on ``engine``: ``install(ctx)`` / ``uninstall()``; ``state_dict``/``load_state_dict`` per rank."""

    def __init__(self, engine: Any, outer: OuterStep, sync_every: int):
        self.engine, self.outer, self.sync_every = engine, outer, int(sync_every)
        self._patches: list[dsc.Patch] = []
        self._removers: list[Callable[[], None]] = []
        self._steps_before = 0

    def __repr__(self) -> str:
        return f"LocalUpdateHooks(sync_every={self.sync_every}, {self.outer!r})"

    def _group(self) -> Any:
        return dsc.seq_data_parallel_group(self.engine)

    def install(self, ctx: Any) -> "LocalUpdateHooks":
        if ctx.txn is not None:
            self._removers.append(ctx.txn.on_undo("uninstall titan local updates", self.uninstall))
        self._patches.append(ctx.patch(dsc.backward_allreduce(self.engine, False)))
        self._removers += [ctx.on_before_step(self._before_step), ctx.on_after_step(self._after_step)]
        return self

    def uninstall(self) -> None:
        """Remove the callbacks and give the engine its per-step all-reduce back (idempotent)."""
        for remove in self._removers:
            remove()
        self._removers.clear()
        for p in reversed(self._patches):
            p.undo()
        self._patches.clear()

    def _before_step(self) -> None:
        self._steps_before = self.engine.global_steps

    def _after_step(self) -> None:
        steps = self.engine.global_steps
        if steps != self._steps_before and steps % self.sync_every == 0:
            self.outer.sync(DistCollective(self._group()))

    # ---------------------------------------------------------------- checkpoint state
    def _local(self) -> dict[str, Any]:
        return {"params": [p.detach().clone() for p in self.outer.params],
                "optimizer": self.engine.optimizer.state_dict(), "reducer": self.outer.reducer.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        from deepspeed import comm as dist
        group = self._group()
        gathered: list[Any] = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(gathered, self._local(), group=group)
        return {"world_size": len(gathered), "sync_every": self.sync_every, "outer": self.outer.state_dict(),
                "per_rank": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from deepspeed import comm as dist
        group = self._group()
        world = dist.get_world_size(group=group)
        if state["world_size"] != world or state["sync_every"] != self.sync_every:
            raise RuntimeError(f"titan local updates were saved with {state['world_size']} ranks and sync_every="
                               f"{state['sync_every']}, this run has {world} and {self.sync_every}; resume with the "
                               f"same ranks and sync_every")
        mine = state["per_rank"][dist.get_rank(group=group)]
        self.outer.load_state_dict(state["outer"])
        self.outer.reducer.load_state_dict(mine["reducer"])
        self.engine.optimizer.load_state_dict(mine["optimizer"])
        with torch.no_grad():
            for p, saved in zip(self.outer.params, mine["params"]):
                p.copy_(saved)
