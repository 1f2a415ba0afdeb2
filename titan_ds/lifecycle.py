"""Callbacks that pillars register around ``engine.step``, ``save_checkpoint`` and ``load_checkpoint``, and the
undo actions for what they patch globally while ``titan_ds.initialize`` runs.

A pillar never wraps the engine's methods on the instance: it registers here (through
:class:`titan_ds.engine.InitContext`), and :mod:`titan_ds.engine` wraps each of the three methods exactly once,
running the callbacks. The order is declared here, once:

* Callbacks nest like wrappers applied in registration order: the first registered is the innermost, closest to
  DeepSpeed. So the callbacks that run **after** DeepSpeed's call (``after_step``, ``save``, ``load``) run in
  registration order, and ``before_step`` callbacks in reverse registration order. Pillars register them in
  ``after_initialize`` (the engine exists only then), which runs in :data:`titan_ds.engine.PILLARS` order: HMS's
  callbacks are innermost, compression's outermost.
* ``after_step`` callbacks run only when DeepSpeed's ``step`` returned; if it raised, they are skipped (as a wrapper's
  code after the call would be).
* ``abort`` actions run in reverse registration order (an undo stack) if ``initialize`` raises after they were
  registered; an action that raises is logged and the others still run.

Every registration returns a function that removes it again (``CompressionHooks.uninstall`` uses it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Lifecycle", "KINDS", "StepCallback", "SaveCallback", "LoadCallback", "AbortAction", "Remove"]

log = logging.getLogger("titan_ds")

StepCallback = Callable[[], None]
SaveCallback = Callable[[str, str], None]                        # (save_dir, tag)
LoadCallback = Callable[[str, str, Mapping[str, Any]], None]     # (load_dir, tag, load_checkpoint's keywords)
AbortAction = Callable[[], None]
Remove = Callable[[], None]
KINDS = ("before_step", "after_step", "save", "load", "abort")  # the list fields of Lifecycle


def _remover(hooks: list[Any], fn: Any) -> Remove:
    def remove() -> None:
        if fn in hooks:
            hooks.remove(fn)

    return remove


@dataclass
class Lifecycle:
    """The registered callbacks of one ``initialize`` call (held by the context, then by ``engine.titan``)."""

    before_step: list[StepCallback] = field(default_factory=list)
    after_step: list[StepCallback] = field(default_factory=list)
    save: list[SaveCallback] = field(default_factory=list)
    load: list[LoadCallback] = field(default_factory=list)
    abort: list[AbortAction] = field(default_factory=list)

    def register(self, kind: str, fn: Callable[..., None]) -> Remove:
        """Append ``fn`` to the ``kind`` list (one of :data:`KINDS`); returns its remover."""
        if kind not in KINDS:
            raise ValueError(f"unknown lifecycle callback kind {kind!r}; choose one of {sorted(KINDS)}")
        hooks = getattr(self, kind)
        hooks.append(fn)
        return _remover(hooks, fn)

    def run_before_step(self) -> None:
        for fn in reversed(self.before_step):
            fn()

    def run_after_step(self) -> None:
        for fn in list(self.after_step):
            fn()

    def run_save(self, save_dir: str, tag: str) -> None:
        for fn in list(self.save):
            fn(save_dir, tag)

    def run_load(self, load_dir: str, tag: str, options: Mapping[str, Any]) -> None:
        for fn in list(self.load):
            fn(load_dir, tag, options)

    def run_abort(self) -> None:
        """Undo every registered global change, last registered first; clears the stack."""
        actions, self.abort[:] = list(self.abort), []
        for fn in reversed(actions):
            try:
                fn()
            except Exception:  # keep undoing the rest; initialize re-raises its own error afterwards
                log.exception("titan: undoing %r after a failed initialize raised", fn)
