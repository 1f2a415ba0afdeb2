"""Module-replacement policies and the one function that applies them.

A *policy* is any object with

* ``name: str`` -- a short label used in reports (``"trd"``, ``"mlme.attention"``);
* ``matches(name, module) -> bool`` -- should the module at qualified name ``name`` be replaced?
* ``replace(name, module) -> nn.Module`` -- build its replacement.

and, optionally, ``detail(name, old, new) -> dict`` -- extra per-module facts for the report (ranks,
reconstruction error, ...).

:func:`apply_policies` walks the model once, in ``named_modules`` order, and replaces every module that
the first matching policy claims; the children of a replaced module are not visited. The returned
:class:`ReplacementReport` lists each replacement with its parameter counts before and after.

Idempotence is part of the contract: a policy must not match what it produced. ``apply_policies`` checks
this for every replacement and raises if it is broken, so applying the same policies twice replaces
nothing the second time. Parameter counts use ``ds_numel`` when DeepSpeed ZeRO-3 has partitioned a
parameter (its local ``numel()`` is then 0), and count shared parameters once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from torch import nn

__all__ = ["Policy", "Replacement", "ReplacementReport", "apply_policies", "count_params"]

log = logging.getLogger("titan_ds.inject")


@runtime_checkable
class Policy(Protocol):
    """What :func:`apply_policies` needs from a policy (see the module docstring)."""

    name: str

    def matches(self, name: str, module: nn.Module) -> bool: ...

    def replace(self, name: str, module: nn.Module) -> nn.Module: ...


def count_params(params: Iterable[nn.Parameter]) -> int:
    """Number of elements of the distinct parameters (full size even when ZeRO-3 has partitioned them)."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


@dataclass(frozen=True)
class Replacement:
    """One replaced module: its qualified name, the policy, the types and parameter counts."""

    name: str
    policy: str
    old_type: str
    new_type: str
    dense_params: int
    new_params: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.dense_params / self.new_params if self.new_params else float("inf")


@dataclass
class ReplacementReport:
    """What :func:`apply_policies` did. ``model_params_*`` are whole-model counts before and after."""

    entries: list[Replacement]
    model_params_before: int
    model_params_after: int

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def dense_params(self) -> int:
        return sum(e.dense_params for e in self.entries)

    @property
    def new_params(self) -> int:
        return sum(e.new_params for e in self.entries)

    @property
    def compression_ratio(self) -> float:
        """Dense parameters of the replaced modules / parameters of their replacements (1.0 if none)."""
        return self.dense_params / self.new_params if self.new_params else 1.0

    @property
    def model_compression_ratio(self) -> float:
        """Whole-model parameters before / after."""
        return self.model_params_before / self.model_params_after if self.model_params_after else 1.0

    def by_policy(self, policy: str) -> "ReplacementReport":
        """The entries of one policy (model totals unchanged)."""
        return ReplacementReport([e for e in self.entries if e.policy == policy],
                                 self.model_params_before, self.model_params_after)

    def table(self) -> str:
        """A markdown table of the replacements and the two totals."""
        rows = ["| module | policy | from | to | dense params | new params | ratio |", "|---|---|---|---|---:|---:|---:|"]
        for e in self.entries:
            rows.append(f"| {e.name} | {e.policy} | {e.old_type} | {e.new_type} | {e.dense_params} | "
                        f"{e.new_params} | {e.ratio:.2f}x |")
        rows.append(f"| **replaced modules** | | | | {self.dense_params} | {self.new_params} | "
                    f"{self.compression_ratio:.2f}x |")
        rows.append(f"| **whole model** | | | | {self.model_params_before} | {self.model_params_after} | "
                    f"{self.model_compression_ratio:.2f}x |")
        return "\n".join(rows)

    def __str__(self) -> str:
        return (f"ReplacementReport({len(self.entries)} modules replaced, {self.dense_params} -> "
                f"{self.new_params} params ({self.compression_ratio:.2f}x); whole model "
                f"{self.model_params_before} -> {self.model_params_after} ({self.model_compression_ratio:.2f}x))")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def planned(model: nn.Module, policies: Sequence[Policy]) -> list[tuple[str, nn.Module, Policy]]:
    """``(name, module, policy)`` for every submodule that :func:`apply_policies` would replace, in its order,
    without replacing anything (first match wins; a matched module's children are not visited; never the root).
    Replacing does not change what is visited: the module list is taken before the first replacement."""
    out: list[tuple[str, nn.Module, Policy]] = []
    skip_prefixes: list[str] = []
    for name, module in list(model.named_modules()):
        if not name or any(name.startswith(s) for s in skip_prefixes):
            continue
        policy = next((p for p in policies if p.matches(name, module)), None)
        if policy is not None:
            out.append((name, module, policy))
            skip_prefixes.append(name + ".")
    return out


def apply_policies(model: nn.Module, policies: Sequence[Policy]) -> ReplacementReport:
    """Replace, in place, every submodule of ``model`` that one of ``policies`` matches (first match wins).

    The root module itself is never replaced. Returns the :class:`ReplacementReport`. Raises
    ``TypeError`` for an object that is not a policy and ``RuntimeError`` when a policy matches its own
    replacement (which would break idempotence).
    """
    for p in policies:
        if not isinstance(p, Policy):
            raise TypeError(f"{p!r} is not a policy: it needs name, matches(name, module) and replace(name, module)")
    before = count_params(model.parameters())
    entries: list[Replacement] = []
    for name, module, policy in planned(model, policies):
        new = policy.replace(name, module)
        if policy.matches(name, new):
            raise RuntimeError(f"policy {policy.name!r} matches its own replacement of {name!r} "
                               f"({type(new).__name__}); a policy must not match what it produced")
        detail_fn = getattr(policy, "detail", None)
        detail = dict(detail_fn(name, module, new)) if detail_fn is not None else {}
        entries.append(Replacement(name, policy.name, type(module).__name__, type(new).__name__,
                                   count_params(module.parameters()), count_params(new.parameters()), detail))
        _set_submodule(model, name, new)
        log.debug("titan: %s replaced %s (%s -> %s)", policy.name, name, type(module).__name__, type(new).__name__)
    report = ReplacementReport(entries, before, count_params(model.parameters()))
    if entries:
        log.info("titan: %s", report)
    return report
