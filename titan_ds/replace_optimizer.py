"""The one way titan replaces the optimizer passed to ``initialize`` (the HF ``Trainer`` always passes its AdamW).

Two pillars need it: ``titan.optimizer`` (titan's optimizer over the passed one's param groups) and
``titan.compression.precondition: "rms"`` (the reduced sum is an Adam-scaled update, so an Adam/AdamW becomes
plain SGD over the *same* group dicts). :func:`replace_passed_optimizer` builds the new optimizer, makes the
schedule act on it (a scheduler given to ``initialize``, and one built over the passed optimizer that
``initialize`` never sees), points the passed optimizer's ``param_groups`` at the new groups, and logs the
replacement once. The transaction of ``initialize`` snapshotted the passed optimizer and scheduler, so a later
failure puts them back. :func:`replace_ds_optimizer_section` is the same for a ds_config ``"optimizer"`` section.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch

__all__ = ["replace_passed_optimizer", "replace_ds_optimizer_section", "built_optimizer"]

log = logging.getLogger("titan_ds")


def _track_steps(opt: torch.optim.Optimizer, also: tuple[torch.optim.Optimizer, ...] = ()) -> None:
    """Wrap ``opt.step`` as a torch ``LRScheduler`` wraps the step of the optimizer it is built over (torch's
    ``patch_track_step_called``: the ``_wrapped_by_lr_sched`` marker, ``_opt_called`` set on each step, weak
    references so the optimizer is not kept alive by its own method). A scheduler re-pointed at ``opt``, or still
    pointing at an optimizer in ``also`` that ``opt`` steps for, then sees the optimizer step before it, instead of
    warning that ``optimizer.step()`` was overridden (or not called) after the scheduler was built."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    refs, func = [weakref.ref(o) for o in (opt, *also)], opt.step.__func__  # a fresh optimizer: its class's step

    @functools.wraps(func)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        for o in filter(None, (r() for r in refs)):
            o._opt_called = True
        return func(refs[0](), *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = tracked  # type: ignore[method-assign]


def _redirect_schedule(passed: torch.optim.Optimizer, new: torch.optim.Optimizer, scheduler: Any) -> None:
    """Make the schedule act on ``new``.

    Groups that ``new`` built afresh take the passed group's base lr as ``initial_lr`` where a scheduler had
    set one, keeping the fraction of it that the scheduler applied at this point (0 at warm-up step 0). A torch
    scheduler given to initialize is re-pointed at ``new`` with ``new``'s base lrs; DeepSpeed's own schedulers
    (absolute lrs) get the new ``optimizer`` and the lrs already written into the passed groups.
    (The rule that refuses a titan lr that an unseen scheduler would override is in :mod:`titan_ds.rules`.)
    """
    seen = scheduler is not None and getattr(scheduler, "optimizer", None) is passed
    for old, g in zip(passed.param_groups, new.param_groups):
        if g is old:  # the same group dict (SGD over the passed groups): nothing to carry over
            continue
        base_old = old.get("initial_lr", old["lr"])
        if "initial_lr" in old:
            g["initial_lr"] = g["lr"]
            g["lr"] = g["initial_lr"] * (old["lr"] / base_old) if base_old else old["lr"]
    if seen:
        scheduler.optimizer = new
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            _track_steps(new)
            scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in new.param_groups]
            scheduler._last_lr = [g["lr"] for g in new.param_groups]
        else:
            for old, g in zip(passed.param_groups, new.param_groups):
                g["lr"] = old["lr"]
    elif hasattr(passed.step, "_wrapped_by_lr_sched"):  # a torch scheduler initialize was not given drives `passed`
        _track_steps(new, also=(passed,))


def replace_passed_optimizer(ctx: Any, build: Callable[[torch.optim.Optimizer], torch.optim.Optimizer],
                             why: str) -> torch.optim.Optimizer:
    """Replace ``ctx.optimizer`` (a torch optimizer passed to initialize) by ``build(passed)``; returns it.

    ``passed`` is not stepped again; its ``param_groups`` becomes the new optimizer's list, so a scheduler built
    over it and never handed to ``initialize`` (``accelerator.prepare(model, opt, dl, sched)``) still sets the
    new optimizer's lr."""
    passed = ctx.optimizer
    new = build(passed)
    _redirect_schedule(passed, new, ctx.lr_scheduler)
    passed.param_groups = new.param_groups
    ctx.optimizer = new
    log.info("titan: the %s passed to initialize is replaced by %s over its %d param groups (%s); lr %s, "
             "weight_decay %s", type(passed).__name__, type(new).__name__, len(new.param_groups), why,
             [g["lr"] for g in new.param_groups], [g.get("weight_decay", 0.0) for g in new.param_groups])
    return new


def replace_ds_optimizer_section(ds_config: dict[str, Any], section: dict[str, Any], why: str) -> None:
    """The ds_config's ``"optimizer"`` section becomes ``section`` (DeepSpeed builds that one instead)."""
    log.info("titan: the ds_config's optimizer %s is replaced by %s (%s)", ds_config.get("optimizer"), section, why)
    ds_config["optimizer"] = section


def built_optimizer(optimizer: Any, model: torch.nn.Module, model_parameters: Any = None) -> Any:
    """``optimizer`` as DeepSpeed would hold it: an optimizer passed to ``initialize`` as it is, and a callable
    (``initialize(optimizer=lambda params: AdamW(params))``, valid DeepSpeed) called the way DeepSpeed's engine
    calls it, on ``model_parameters`` or else the model's parameters (``engine._configure_optimizer``). Building a
    torch optimizer allocates no state (that comes at its first step), so a pillar may build it to read its type
    and hyperparameters, and hand DeepSpeed the built one."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        return optimizer
    params = model_parameters if model_parameters is not None else model.parameters()
    return optimizer(params)
