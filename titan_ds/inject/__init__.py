"""Module-injection pillars: the policy protocol (:mod:`.policy`), TRD (:mod:`.trd`) and MLME (:mod:`.mlme`).

Pillar modules are imported lazily by ``titan_ds.engine``; only the generic policy API is re-exported here.
"""
from .policy import Policy, Replacement, ReplacementReport, apply_policies, count_params

__all__ = ["Policy", "Replacement", "ReplacementReport", "apply_policies", "count_params"]
