"""The two HMS swappers ZeRO-3 calls, under their earlier module: :class:`HMSParamSwapper`
(:mod:`titan_ds.hms.param_swapper`) and :class:`HMSOptimizerSwapper` (:mod:`titan_ds.hms.optimizer_swapper`)."""
from __future__ import annotations

from .optimizer_swapper import SWAP_MIN_NUMEL, HMSOptimizerSwapper
from .param_swapper import HMSParamSwapper, PartitionedParamStatus

__all__ = ["HMSParamSwapper", "HMSOptimizerSwapper", "PartitionedParamStatus", "SWAP_MIN_NUMEL"]
