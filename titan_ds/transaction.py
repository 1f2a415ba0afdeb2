"""What ``titan_ds.initialize`` changes, recorded so that a failure leaves nothing half-done.

A :class:`Transaction` is opened after every pillar's ``validate`` passed and before the first ``apply``. It
holds:

* a snapshot of the user's **model** (every module's attributes, children, parameters, buffers, hooks and
  instance ``forward``; every parameter's and buffer's tensor, dtype, ``requires_grad``, attributes and
  gradient), of the **optimizer** and **lr scheduler** passed to ``initialize`` (their attributes and param
  groups). It copies no data: it keeps references, so an in-place cast (``weight_dtype: "bf16"``) holds the
  original weights until ``initialize`` returns (2 more bytes a parameter, transiently);
* the **undo stack**: every :class:`~titan_ds.deepspeed_compat.Patch` of DeepSpeed applied through
  :meth:`Transaction.patch`, process-wide settings (HMS's ``mallopt``), folders created, threads started;
* **files**: a folder titan would empty is moved aside (:meth:`Transaction.move_aside`) and deleted only on
  commit; on rollback it is moved back, so nothing that existed before is deleted by a failed ``initialize``.

On failure :meth:`rollback` undoes the stack (last first; an undo that raises is logged and the others still
run), restores the optimizer, scheduler and model bitwise, and adds a note to the exception saying so. Under
ZeRO-3 the model's parameters are partitioned in place (by HMS's conversion or by ``deepspeed.initialize``:
``deepspeed.zero.Init`` frees each full tensor as it partitions it); a model that got that far cannot be put
back without holding a second copy of it, so the note says plainly that the model was consumed and must be
built again (as after a failed plain ``deepspeed.initialize`` under ZeRO-3). On success :meth:`commit` runs the
deferred deletions and drops the snapshots.
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import uuid
from typing import Any, Callable, Optional

import torch

from . import deepspeed_compat as dsc

__all__ = ["Transaction", "ModelSnapshot", "ObjectSnapshot"]

log = logging.getLogger("titan_ds")

_CONTAINERS = (dict, list, set)


def _copy_container(v: Any) -> Any:
    return type(v)(v) if not isinstance(v, dict) else dict(v)


def _restore_container(obj: Any, saved: Any) -> None:
    """Put ``saved``'s items back into ``obj`` in place (other holders of ``obj`` see the restored items)."""
    if isinstance(obj, dict):
        obj.clear()
        obj.update(saved)
    elif isinstance(obj, list):
        obj[:] = saved
    else:
        obj.clear()
        obj.update(saved)


class ObjectSnapshot:
    """An object's attributes, and one level into them: containers (dicts, lists, sets) and the dicts inside a
    list (an optimizer's ``param_groups``). Restored in place."""

    def __init__(self, obj: Any):
        self.obj = obj
        self.attrs = dict(vars(obj))
        self.containers = {k: _copy_container(v) for k, v in self.attrs.items() if isinstance(v, _CONTAINERS)}
        self.inner = {k: [(d, dict(d)) for d in v if isinstance(d, dict)] for k, v in self.attrs.items()
                      if isinstance(v, list)}

    def restore(self) -> None:
        d = vars(self.obj)
        d.clear()
        d.update(self.attrs)
        for k, saved in self.containers.items():
            _restore_container(self.attrs[k], saved)
        for pairs in self.inner.values():
            for obj, saved in pairs:
                _restore_container(obj, saved)


# a tensor's hook dicts live on the C++ side, outside its __dict__
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hooks(t: torch.Tensor, name: str) -> Any:
    v = getattr(t, name, None)
    return None if v is None else type(v)(v)


class ModelSnapshot:
    """The model's module tree and tensors as they were (references, no data copies)."""

    def __init__(self, model: torch.nn.Module, keep_data: bool):
        self.model, self.keep_data = model, keep_data
        self.modules = [(m, m.__class__, ObjectSnapshot(m)) for m in model.modules()]
        tensors = {id(t): t for m in model.modules() for t in itertools.chain(m._parameters.values(), m._buffers.values())
                   if t is not None}
        self.tensors = [(t, t.data if keep_data else None, t.dtype, t.requires_grad, dict(vars(t)), t.grad,
                         {k: _hooks(t, k) for k in _TENSOR_HOOKS}) for t in tensors.values()]
        self.zero_params = {id(t) for t, *_ in self.tensors if dsc.is_zero_param(t)}

    def consumed(self) -> bool:
        """Whether the parameters were partitioned (ZeRO-3) or re-allocated where no reference was kept."""
        for t, data, dtype, *_ in self.tensors:
            if id(t) not in self.zero_params and dsc.is_zero_param(t):
                return True
            if data is None and t.dtype != dtype:
                return True
        return False

    def restore(self) -> None:
        for m, cls, snap in self.modules:
            if m.__class__ is not cls:
                m.__class__ = cls
            snap.restore()
        for t, data, _, requires_grad, attrs, grad, hooks in self.tensors:
            d = vars(t)
            d.clear()
            d.update(attrs)
            for k, v in hooks.items():  # DeepSpeed's gradient hooks (register_post_accumulate_grad_hook) go
                now = getattr(t, k, None)
                if now is not None:  # in place: autograd holds this very dict (set to None, it keeps calling it)
                    now.clear()
                    now.update(v or {})
                elif v:
                    setattr(t, k, type(v)(v))
            if data is not None and t.data is not data:
                t.data = data
            if t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
            if t.grad is not grad:
                t.grad = grad


class Transaction:
    """The undo log of one ``titan_ds.initialize`` call (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None, *,
                 keep_data: bool = True):
        self.model = ModelSnapshot(model, keep_data)
        self.objects = [ObjectSnapshot(o) for o in (optimizer, lr_scheduler) if o is not None and hasattr(o, "__dict__")]
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._commit: list[tuple[str, Callable[[], None]]] = []
        self.open = True

    # ------------------------------------------------------------------ recording
    def patch(self, p: dsc.Patch) -> dsc.Patch:
        """Apply ``p`` now; undo it on rollback."""
        p.apply()
        self._undo.append((p.name, p.undo))
        return p

    def on_undo(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn()`` on rollback (last registered first). Returns a function that drops it (for a change
        undone earlier by other means)."""
        entry = (name, fn)
        self._undo.append(entry)
        return lambda: self._undo.remove(entry) if entry in self._undo else None

    def on_commit(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once ``initialize`` succeeded (deferred deletions)."""
        self._commit.append((name, fn))

    def make_dirs(self, path: str) -> str:
        """``os.makedirs(path)``; on rollback the topmost folder this created is removed again."""
        full = os.path.abspath(os.path.expanduser(path))
        top = None
        probe = full
        while not os.path.exists(probe):
            top, probe = probe, os.path.dirname(probe)
        os.makedirs(full, exist_ok=True)
        if top is not None:
            self.on_undo(f"remove the folder {top} created by titan", lambda: shutil.rmtree(top, ignore_errors=True))
        return full

    def move_aside(self, path: str) -> None:
        """Make ``path`` free without deleting what is there: it is renamed next to itself; deleted on commit,
        moved back on rollback (after whatever titan put at ``path`` meanwhile is removed)."""
        if not os.path.lexists(path):
            return
        aside = f"{path}.titan-old-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)

        def back() -> None:
            shutil.rmtree(path, ignore_errors=True)
            os.rename(aside, path)

        self.on_undo(f"move {aside} back to {path}", back)
        self.on_commit(f"delete the stale {aside}", lambda: shutil.rmtree(aside, ignore_errors=True))

    # ------------------------------------------------------------------ ending
    def rollback(self, error: Optional[BaseException] = None) -> None:
        """Undo everything (last first), restore the user's objects and model; note what happened on ``error``."""
        if not self.open:
            return
        self.open = False
        failed = []
        for name, fn in reversed(self._undo):
            try:
                fn()
            except Exception:  # keep undoing the rest; the caller re-raises its own error
                log.exception("titan: undoing %r after a failed initialize raised", name)
                failed.append(name)
        self._undo.clear()
        for snap in self.objects:
            snap.restore()
        consumed = self.model.consumed()
        if not consumed:
            self.model.restore()
        note = ("titan: initialize failed, and the model was consumed: ZeRO-3 had partitioned its parameters in "
                "place (deepspeed.zero.Init frees each full tensor), so build the model again before retrying"
                if consumed else
                "titan: initialize failed; the model, the optimizer and scheduler passed to it, DeepSpeed's "
                "patched symbols and process settings are as they were before the call")
        if failed:
            note += f" (except: undoing {', '.join(failed)} failed; see the log)"
        log.error(note)
        if error is not None and hasattr(error, "add_note"):
            error.add_note(note)

    def commit(self) -> None:
        if not self.open:
            return
        self.open = False
        for name, fn in self._commit:
            try:
                fn()
            except Exception:
                log.exception("titan: %s failed after a successful initialize (left as it is)", name)
        self._undo.clear()
        self._commit.clear()
        self.model = None  # type: ignore[assignment]  # drop the references (the cast's originals)
        self.objects = []
