"""Callbacks that pillars register around ``engine.step``, ``save_checkpoint`` and ``load_checkpoint``.

A pillar never wraps the engine's methods on the instance: it registers here (through
:class:`titan_ds.engine.InitContext`), and :mod:`titan_ds.engine` wraps each of the three methods exactly once,
running the callbacks. The order is declared here, once:

* Callbacks nest like wrappers applied in registration order: the first registered is the innermost, closest to
  DeepSpeed. So the callbacks that run **after** DeepSpeed's call (``after_step``, ``save``, ``load``) run in
  registration order, and ``before_step`` callbacks in reverse registration order. Pillars register them in
  ``attach`` (the engine exists only then), which runs in :data:`titan_ds.engine.PILLARS` order: HMS's
  callbacks are innermost, compression's outermost.
* ``after_step`` callbacks run only when DeepSpeed's ``step`` returned; if it raised, they are skipped (as a wrapper's
  code after the call would be).

What a pillar changes while ``initialize`` runs is undone, if it fails, by its transaction
(:mod:`titan_ds.transaction`), not here.

Every registration returns a function that removes it again (``CompressionHooks.uninstall`` uses it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Lifecycle", "KINDS", "StepCallback", "SaveCallback", "LoadCallback", "Remove"]

log = logging.getLogger("titan_ds")

StepCallback = Callable[[], None]
SaveCallback = Callable[[str, str], None]                        # (save_dir, tag)
LoadCallback = Callable[[str, str, Mapping[str, Any]], None]     # (load_dir, tag, load_checkpoint's keywords)
Remove = Callable[[], None]
KINDS = ("before_step", "after_step", "save", "load")  # the list fields of Lifecycle


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
