"""``titan_ds.install()``: every later ``deepspeed.initialize`` call goes through :func:`titan_ds.initialize`.

Frameworks start DeepSpeed themselves: the Hugging Face ``Trainer`` through accelerate
(``Accelerator._prepare_deepspeed`` looks up ``deepspeed.initialize`` when it runs and passes the processed
ds_config as ``config_params=``), Lightning's DeepSpeed strategy, or a user script. :func:`install` replaces the
attribute ``deepspeed.initialize`` by a function with DeepSpeed's signature that calls
:func:`titan_ds.engine.initialize`, so the ``"titan"`` section of whatever config such a call carries (dict or
json path, ``config=``, ``config_params=`` or ``args.deepspeed_config``) is applied; a config without one is
passed to DeepSpeed unchanged. :func:`uninstall` puts DeepSpeed's function back.

:func:`install` also routes ``deepspeed.zero.Init``: a call whose config (``config_dict_or_path=`` or ``config=``)
has a ``titan.hms`` section and that names no ``param_swapper`` becomes :func:`titan_ds.zero_init` with the same
arguments, so a model the framework builds under ZeRO-3 (``from_pretrained`` with the Trainer's ZeRO-3 config,
transformers ``modeling_utils.get_init_context``) streams its parameters to HMS's store as each module is built,
and ``initialize`` adopts that store. Any other call is DeepSpeed's ``Init`` unchanged; ``isinstance`` checks
against the routed name answer for DeepSpeed's class (:func:`titan_ds.deepspeed_compat.route_zero_init`).

Only lookups made after ``install()`` see it: code that ran ``from deepspeed import initialize`` earlier keeps
DeepSpeed's own (accelerate, transformers and Lightning look the attribute up at call time). The route keeps
DeepSpeed's function as its ``__titan_original__``, which is what ``titan_ds.engine`` calls while the route is on.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Callable, Optional

from . import deepspeed_compat as dsc
from .engine import initialize as titan_initialize

__all__ = ["install", "uninstall", "is_installed"]

log = logging.getLogger("titan_ds")

_routed: Optional[Callable[..., Any]] = None  # the function install() put in deepspeed.initialize's place
_patches: list[dsc.Patch] = []  # deepspeed.initialize, deepspeed.zero.Init (in the order applied)


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


def _hms_section(config: Any) -> bool:
    """Whether a ``zero.Init`` config (dict, json path, or None) has a ``titan.hms`` section."""
    from .config import load_ds_config
    if config is None:
        return False
    ds = config if isinstance(config, dict) else load_ds_config(config) if isinstance(config, (str, os.PathLike)) \
        else None
    return isinstance(ds, dict) and isinstance(ds.get("titan"), dict) and ds["titan"].get("hms") is not None


def _route_zero_init(original: type, *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.zero.Init(...)`` while installed: :func:`titan_ds.zero_init` when the config has ``titan.hms``
    and no ``param_swapper`` is given (the caller's own swapper wins), else DeepSpeed's ``Init``."""
    bound = inspect.signature(original).bind(*args, **kwargs).arguments
    config = bound.get("config_dict_or_path") or bound.get("config")
    if bound.get("param_swapper") is not None or not bound.get("enabled", True) or not _hms_section(config):
        return original(*args, **kwargs)
    from .hms.install import zero_init
    rest = {k: v for k, v in bound.items() if k not in ("config_dict_or_path", "config")}
    log.info("titan: deepspeed.zero.Init with a titan.hms section: the model is built under titan_ds.zero_init "
             "(its parameters go to HMS's store)")
    return zero_init(config, **rest)


def _replaced_message(current: Any, then: str) -> str:
    name = f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', repr(current))}"
    return f"deepspeed.initialize was replaced after titan_ds.install() by {name}; undo that first, then {then}"


def install() -> None:
    """Route every later ``deepspeed.initialize`` call through :func:`titan_ds.initialize`, and every later
    ``deepspeed.zero.Init`` whose config has ``titan.hms`` through :func:`titan_ds.zero_init` (idempotent)."""
    global _routed
    import deepspeed

    if _routed is not None:
        if deepspeed.initialize is not _routed:
            raise RuntimeError(_replaced_message(deepspeed.initialize, "call titan_ds.install() again"))
        return
    routed = _route(deepspeed.initialize)
    first = dsc.Patch("deepspeed.initialize (titan_ds.install)", deepspeed, "initialize", routed).apply()
    try:
        _patches[:] = [first, dsc.route_zero_init(_route_zero_init).apply()]
    except Exception:
        first.undo()
        raise
    _routed = routed
    log.info("titan: installed; deepspeed.initialize now applies the \"titan\" section of its config, and "
             "deepspeed.zero.Init builds under titan_ds.zero_init when it has titan.hms (titan_ds.uninstall() "
             "undoes both)")


def uninstall() -> None:
    """Put back the ``deepspeed.initialize`` and ``deepspeed.zero.Init`` that :func:`install` replaced (nothing to
    do when not installed)."""
    global _routed
    import deepspeed

    if _routed is None:
        return
    if deepspeed.initialize is not _routed:
        raise RuntimeError(_replaced_message(deepspeed.initialize, "call titan_ds.uninstall()"))
    for p in reversed(_patches):
        p.undo()
    _patches.clear()
    _routed = None
    log.info("titan: uninstalled; deepspeed.initialize and deepspeed.zero.Init are DeepSpeed's again")


def is_installed() -> bool:
    """Whether ``deepspeed.initialize`` is the route :func:`install` put there."""
    import deepspeed
    return _routed is not None and deepspeed.initialize is _routed
