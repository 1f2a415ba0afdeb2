"""GPU readiness without a GPU: run a path with its tensors on the ``meta`` device.

A meta tensor has a shape and a dtype but no data, so what would be wrong on a GPU fails here:

* an op mixing a CPU tensor (more than a 0-dim scalar) with a device tensor raises ("Tensor on device cpu is not
  on the expected device meta!"), as it does on CUDA;
* a host sync raises: ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)``, ``torch.nonzero`` /
  boolean-mask indexing, ``repeat_interleave`` without ``output_size`` ("cannot be called on meta tensors",
  "Cannot copy out of meta tensor", ...). On a GPU each of these stalls the step until the device catches up.

What meta lets through is a host-to-device copy (``cpu_tensor.to(device)``, ``dst.copy_(cpu_tensor)``): on CUDA
a blocking copy waits for the stream too. :class:`NoHostCopies` fails on blocking ones, for the steps after the
first (a first step may copy small constant tables once); an asynchronous one (``non_blocking=True``, from pinned
memory on CUDA: ``titan_ds.comm.base.to_device_async``) does not wait and passes. Syncs inside a C++ kernel (e.g. ``segment_reduce``'s input
checks) are invisible to both; the code under test avoids them by construction.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NoHostCopies", "HostReads", "META", "meta_like", "all_meta"]

META = torch.device("meta")
aten = torch.ops.aten


class _TensorFactoryWatch(TorchDispatchMode):
    """A dispatch mode that also sees ``torch.tensor(data, device=...)``, which copies from the host below the
    dispatcher (unseen by ``__torch_dispatch__``): while entered, such a call to a non-CPU device goes to
    :meth:`_device_tensor` first."""

    def _device_tensor(self, device: Any) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._tensor = torch.tensor

        def tensor(data: Any, *a: Any, device: Any = None, **kw: Any) -> torch.Tensor:
            if device is not None and torch.device(device).type != "cpu":
                self._device_tensor(device)
            return self._tensor(data, *a, device=device, **kw)

        torch.tensor = tensor
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.tensor = self._tensor
        return super().__exit__(*exc)


class NoHostCopies(_TensorFactoryWatch):
    """Raise on a copy of a CPU tensor into a meta tensor (``_to_copy`` to meta, ``copy_`` from CPU) and on a
    host read of a device tensor, naming the op and the shape. Host reads of CPU tensors are fine."""

    def _device_tensor(self, device: Any) -> None:
        raise AssertionError(f"torch.tensor(..., device={device}) in the step: a blocking host-to-device "
                             f"copy (make it on the host and copy it asynchronously, or once)")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._to_copy.default:  # an asynchronous copy (non_blocking, from pinned memory) is fine
            src, dev = args[0], kwargs.get("device")
            if src.device.type == "cpu" and dev is not None and torch.device(dev).type == "meta" and \
                    not kwargs.get("non_blocking", False):
                raise AssertionError(f"host-to-device copy of a CPU tensor of shape {tuple(src.shape)} in the step "
                                     f"(a blocking copy waits for the device)")
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if dst.device.type == "meta" and src.device.type == "cpu" and blocking:
                raise AssertionError(f"copy_ of a CPU tensor of shape {tuple(src.shape)} into a device tensor in "
                                     f"the step (a blocking copy waits for the device)")
        elif func is aten._local_scalar_dense.default and args[0].device.type != "cpu":  # meta raises too
            raise AssertionError(f"host read of a device tensor ({func}) in the step")
        return func(*args, **kwargs)


def meta_like(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's meta twin (same shape, dtype and requires_grad)."""
    out = []
    for t in tensors:
        m = torch.empty_like(t, device=META)
        out.append(m.requires_grad_(t.requires_grad))
    return out


def all_meta(*objs: Any) -> bool:
    """Every tensor inside ``objs`` (nested lists, tuples, dicts) is on the meta device."""
    return all(t.device.type == "meta" for t in tree_leaves(objs) if isinstance(t, torch.Tensor))


class HostReads(_TensorFactoryWatch):
    """Record, instead of raising, every host read of a device tensor (``.item()``, ``bool(t)``, ``float(t)``...)
    and every blocking host-to-device copy (``torch.tensor(..., device=)``, ``.to(device)``, ``copy_``), each by
    its call site: ``path:function`` of the first frame outside torch (``titan_ds/engine.py:step``,
    ``deepspeed/runtime/utils.py:clip_grad_norm_``). A read of a meta tensor (which has no value) is answered
    with 0 / False and a copy of one to the host with zeros, so a whole step runs on and every read in it is
    listed, not only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, str]] = []  # (kind, site) in the order they happened

    def _record(self, kind: str) -> None:
        import sys
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename.replace("\\", "/")
            if "/torch/" not in name and not name.endswith("tests/helpers/meta.py"):
                break
            f = f.f_back
        if f is None:
            self.sites.append((kind, "?"))
            return
        name = f.f_code.co_filename.replace("\\", "/")
        for marker in ("site-packages/", "/titan_ds/", "/tests/", "/launch/"):
            if marker in name:
                name = name.split(marker, 1)[1] if marker == "site-packages/" else \
                    marker.strip("/") + "/" + name.split(marker, 1)[1]
                break
        self.sites.append((kind, f"{name}:{f.f_code.co_name}"))

    def _device_tensor(self, device: Any) -> None:
        self._record("torch.tensor(..., device=)")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].device.type != "cpu":
            self._record("host read")
            if args[0].device.type == "meta":
                return False if args[0].dtype == torch.bool else 0
        elif func is aten._to_copy.default:
            dev = kwargs.get("device")
            if args[0].device.type == "cpu" and dev is not None and torch.device(dev).type != "cpu" and \
                    not kwargs.get("non_blocking", False):
                self._record("blocking copy to the device")
            elif args[0].device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu":
                self._record("copy to the host")
                if args[0].device.type == "meta":  # no values to copy: zeros of the shape and dtype asked for
                    return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if dst.device.type != "cpu" and src.device.type == "cpu" and blocking:
                self._record("blocking copy_ to the device")
            elif dst.device.type == "cpu" and src.device.type != "cpu":
                self._record("copy_ to the host")
                if src.device.type == "meta":
                    return dst.zero_()
        return func(*args, **kwargs)

    def where(self) -> set[str]:
        """The call sites seen."""
        return {site for _, site in self.sites}
