"""The protocol every pillar follows inside ``titan_ds.initialize`` (docs/pillars.md).

Each pillar is a :class:`Pillar` object built from the ``"titan"`` section, with three phases:

1. ``validate(view) -> list[str]``: **pure**. It reads a :class:`View` (the whole titan section, a copy of the
   ds_config, the model's structure, what was passed to ``initialize``, the world size) and returns the problems
   it finds, each naming the key and the fix. No I/O that writes, no model change, no global patch, no
   ``init_distributed``. ``initialize`` runs every pillar's ``validate`` and the cross-field rules
   (:mod:`titan_ds.rules`) first and raises one :class:`~titan_ds.config.TitanConfigError` with all of them
   before anything is touched.
2. ``apply(ctx)``: before ``deepspeed.initialize``. Changes the model, the optimizer, the ds_config; every
   change outside those (DeepSpeed's symbols, process settings, files) goes through ``ctx.txn``
   (:class:`~titan_ds.transaction.Transaction`) so that a failure undoes it.
3. ``attach(ctx)``: after ``deepspeed.initialize``, with ``ctx.engine``. Registers lifecycle callbacks, metrics and
   checkpoint state.

A pillar keeps its own state between ``apply`` and ``attach`` (attributes of the object); ``ctx.reports`` is
output only (``engine.titan.reports``), never read back by titan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .config import TitanConfig, ds_precision

__all__ = ["Pillar", "View"]


@dataclass(frozen=True)
class View:
    """What ``validate`` may read. ``ds_config`` is a copy: writing to it changes nothing."""

    titan: TitanConfig
    ds_config: Mapping[str, Any]
    model: torch.nn.Module
    optimizer: Any = None
    lr_scheduler: Any = None
    model_parameters: Any = None
    world_size: int = 1

    @classmethod
    def of(cls, titan: TitanConfig, ds_config: Mapping[str, Any], model: torch.nn.Module, **kw: Any) -> "View":
        return cls(titan=titan, ds_config=copy.deepcopy(dict(ds_config)), model=model, **kw)

    def zero(self) -> Mapping[str, Any]:
        return self.ds_config.get("zero_optimization") or {}

    def zero_stage(self) -> int:
        """The ZeRO stage the run will have (HMS sets 3 where the ds_config leaves it unset)."""
        stage = self.zero().get("stage")
        if stage is None:
            return 3 if self.titan.hms is not None else 0
        return int(stage)

    def precision(self) -> str:
        return ds_precision(self.ds_config)

    def offload_device(self) -> str:
        off = self.zero().get("offload_optimizer") or {}
        if not off and self.titan.hms is not None:
            return "nvme"
        return str(off.get("device", "none")).lower()

    def gradient_accumulation_steps(self) -> Any:
        return self.ds_config.get("gradient_accumulation_steps", 1)

    def client_optimizer(self) -> bool:
        """Whether DeepSpeed will be handed a client optimizer (the user's, or titan's)."""
        return self.optimizer is not None or self.titan.optimizer is not None


class Pillar:
    """Base of the five pillars (``hms``, ``trd``, ``mlme``, ``optimizer``, ``compression``); subclasses set
    ``key`` (their sub-section of ``"titan"``) and override the phases they need."""

    key = ""

    def __init__(self, titan: TitanConfig):
        self.titan = titan
        self.cfg = getattr(titan, self.key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key})"

    def validate(self, view: View) -> list[str]:
        return []

    def apply(self, ctx: Any) -> None:
        pass

    def attach(self, ctx: Any) -> None:
        pass
