"""``titan_ds.install()``: every later ``deepspeed.initialize`` call goes through :func:`titan_ds.initialize`.

Frameworks start DeepSpeed themselves: the Hugging Face ``Trainer`` through accelerate
(``Accelerator._prepare_deepspeed`` looks up ``deepspeed.initialize`` when it runs and passes the processed
ds_config as ``config_params=``), Lightning's DeepSpeed strategy, or a user script. :func:`install` replaces the
attribute ``deepspeed.initialize`` by a function with DeepSpeed's signature that calls
:func:`titan_ds.engine.initialize`, so the ``"titan"`` section of whatever config such a call carries (dict or
json path, ``config=``, ``config_params=`` or ``args.deepspeed_config``) is applied; a config without one is
passed to DeepSpeed unchanged. :func:`uninstall` puts DeepSpeed's function back.

Only lookups made after ``install()`` see it: code that ran ``from deepspeed import initialize`` earlier keeps
DeepSpeed's own (accelerate, transformers and Lightning look the attribute up at call time). The route keeps
DeepSpeed's function as its ``__titan_original__``, which is what ``titan_ds.engine`` calls while the route is on.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Optional

from . import deepspeed_compat as dsc
from .engine import initialize as titan_initialize

__all__ = ["install", "uninstall", "is_installed"]

log = logging.getLogger("titan_ds")

_routed: Optional[Callable[..., Any]] = None  # the function install() put in deepspeed.initialize's place
_patch: Optional[dsc.Patch] = None


def _route(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any):
        # DeepSpeed's positional order (distributed_port, mpu, ... come before config) differs from
        # titan_ds.initialize's: bind by DeepSpeed's signature, pass keywords only
        return titan_initialize(**signature.bind(*args, **kwargs).arguments)

    initialize.__doc__ = (f"deepspeed.initialize routed through titan_ds.initialize by titan_ds.install() "
                          f"(titan_ds.uninstall() restores DeepSpeed's).\n\n{original.__doc__ or ''}")
    initialize.__titan_original__ = original  # type: ignore[attr-defined]
    return initialize


def _replaced_message(current: Any, then: str) -> str:
    name = f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', repr(current))}"
    return f"deepspeed.initialize was replaced after titan_ds.install() by {name}; undo that first, then {then}"


def install() -> None:
    """Route every later ``deepspeed.initialize`` call through :func:`titan_ds.initialize` (idempotent)."""
    global _routed, _patch
    import deepspeed

    if _routed is not None:
        if deepspeed.initialize is not _routed:
            raise RuntimeError(_replaced_message(deepspeed.initialize, "call titan_ds.install() again"))
        return
    _routed = _route(deepspeed.initialize)
    _patch = dsc.Patch("deepspeed.initialize (titan_ds.install)", deepspeed, "initialize", _routed).apply()
    log.info("titan: installed; deepspeed.initialize now applies the \"titan\" section of its config "
             "(titan_ds.uninstall() undoes it)")


def uninstall() -> None:
    """Put back the ``deepspeed.initialize`` that :func:`install` replaced (nothing to do when not installed)."""
    global _routed, _patch
    import deepspeed

    if _routed is None:
        return
    if deepspeed.initialize is not _routed:
        raise RuntimeError(_replaced_message(deepspeed.initialize, "call titan_ds.uninstall()"))
    _patch.undo()
    _routed = _patch = None
    log.info("titan: uninstalled; deepspeed.initialize is DeepSpeed's again")


def is_installed() -> bool:
    """Whether ``deepspeed.initialize`` is the route :func:`install` put there."""
    import deepspeed
    return _routed is not None and deepspeed.initialize is _routed
