"""The CPU kernel of :mod:`~titan_ds.optim.core`'s adaptive chunk (``csrc/core_cpu.cpp``): the same arithmetic as
the eager loop, op for op in fp32 (the square root the correctly rounded one on both:
:func:`~titan_ds.optim.asdt_math.ieee_sqrt`), in two passes over the chunk, so it stores the same weights and state
bit for bit (``tests/optim/test_core_cpu.py``), at several times the eager loop's elements/s with fp32 weights
(results/optim_step_ieee). bf16 weights without a master copy are rounded stochastically inside the kernel: it
draws from the optimizer's CPU generator what ``torch.randint(0, 2**16, ...)`` draws (the generator's mt19937,
one 32-bit output per value, kept mod 2^16) and leaves the generator in the state torch would, so the weights, the
state and the generator match the eager loop's bit for bit. That read of ATen's generator is the one private
access, versioned in :mod:`titan_ds.torch_compat`: on a torch outside its range bf16 weights take the eager loop.
Where the kernel uses AVX-512 (a ``-march=native`` build on a CPU that has it) it steps 16 values at a time, else
8 with AVX2; the same IEEE operations either way.

**A build is keyed by the CPU it targets.** ``-march=native`` code may use any instruction of the building CPU,
and an extension cache (``TORCH_EXTENSIONS_DIR``) can be shared by machines with other CPUs (a network home, a
container image, a cluster's shared file system): torch's loader keys a build by its sources and flags, not by
the CPU, so another machine would load it and die of an illegal instruction. The extension's name therefore
carries a hash of the CPU's instruction-set flags (``/proc/cpuinfo``), the compiler flags and the torch version
(:func:`build_name`): a machine with other flags builds its own copy beside it. Where the flags cannot be read
(no ``/proc/cpuinfo``) the build targets the compiler's baseline (no ``-march=native``: the scalar loops, the same
results, slower).

The eager loop makes ~20 whole-chunk passes through ATen (decode, update, encode each a few kernels, each
reading and writing the chunk); the kernel makes two, each element's work done while it is in cache. It is a
C++ extension JIT-built by ``torch.utils.cpp_extension`` on first use (as DeepSpeed builds its CPU ops; ~30-60 s
once, cached under ``TORCH_EXTENSIONS_DIR``). Where it cannot build (no compiler) the eager loop runs, with one
warning. ``TITAN_CORE_CPU=0`` turns it off. Tensors on any other device (a GPU, or ``meta`` in the tests) take the
eager loop or the compiled step.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from functools import lru_cache
from typing import Optional

import torch

from . import qstate
from .. import torch_compat

__all__ = ["ENABLED", "available", "supports", "runs", "step", "unit_sumsq", "build_name", "build_flags"]

_env = os.environ.get("TITAN_CORE_CPU", "1")
if _env not in ("0", "1"):
    raise ValueError(f"TITAN_CORE_CPU={_env!r}: set 1 (the C++ CPU kernel, default) or 0 (the eager loop)")
ENABLED = _env == "1"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "core_cpu.cpp")
_KIND = {"8bit": 8, "4bit": 4}
_PLAIN = {torch.float32: 0, torch.bfloat16: 1}


# -ffp-contract=off: no fused multiply-add may merge two of the eager loop's roundings
_CFLAGS = ["-O3", "-ffp-contract=off"]
_CPUINFO = "/proc/cpuinfo"


def _cpu_flags(path: str = _CPUINFO) -> Optional[str]:
    """The CPU's instruction-set flags as the kernel lists them (x86 ``flags``, Arm ``Features``; the first
    processor's, sorted), or None where they cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        return None
    return None


def build_flags(cpu_flags: Optional[str]) -> list[str]:
    """The compiler flags of a build for a CPU with ``cpu_flags``: ``-march=native`` where they are known (the
    build is keyed by them), else the compiler's baseline."""
    return _CFLAGS + (["-march=native"] if cpu_flags else [])


def build_name(cpu_flags: Optional[str] = None) -> str:
    """The extension's name for a CPU with ``cpu_flags`` (default: this one's): ``titan_core_cpu_`` and a hash of
    those flags, the compiler flags and the torch version, so no build is ever loaded by a CPU (or torch) it was
    not made for."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    key = "\n".join([flags or "baseline", " ".join(build_flags(flags)), torch.__version__])
    return "titan_core_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def _module():
    """The built extension, or None (with a warning) where it does not build."""
    try:
        from torch.utils.cpp_extension import load
        flags = _cpu_flags()
        return load(name=build_name(flags), sources=[_SOURCE], extra_cflags=build_flags(flags), verbose=False)
    except Exception as e:  # noqa: BLE001 (any build failure: no compiler, no ninja, a read-only cache)
        warnings.warn(f"titan_ds: the C++ optimizer kernel ({_SOURCE}) did not build ({type(e).__name__}: {e}); "
                      "ASDT steps with the eager loop (same results, slower). Install a C++ compiler and ninja, "
                      "or set TITAN_CORE_CPU=0 to silence this.", RuntimeWarning, stacklevel=3)
        return None


def available() -> bool:
    return ENABLED and _module() is not None


def supports(w: torch.Tensor, g: torch.Tensor, *bufs) -> bool:
    """Whether the kernel steps a chunk of ``w`` (gradient ``g``) with the state buffers ``bufs``: CPU tensors,
    fp32/bf16 weights and gradients, states plain fp32/bf16 or 8-/4-bit codes."""
    if w.device.type != "cpu" or g.device.type != "cpu" or w.dtype not in _PLAIN or g.dtype not in _PLAIN:
        return False
    return all(b is None or (b.kind in _KIND if b.kind is not None else b.data.dtype in _PLAIN) for b in bufs)


def runs(w: torch.Tensor, g: torch.Tensor, *bufs) -> bool:
    """Whether the kernel steps these tensors here: on (:data:`ENABLED`), :func:`supports` them, and built; bf16
    weights (rounded stochastically from the generator's engine) only where :mod:`titan_ds.torch_compat` allows
    the read."""
    return (ENABLED and supports(w, g, *bufs) and (w.dtype != torch.bfloat16 or torch_compat.generator_seam())
            and available())


def unit_sumsq(g: torch.Tensor, lengths: list[int], sq: torch.Tensor) -> None:
    """Add each unit's sum of squared gradients (fp64, in order: ``segment_reduce``'s) to ``sq`` (fp64, one per
    unit), for ``g`` holding whole units of ``lengths``."""
    _module().unit_sumsq(g, lengths, sq)


def _spec(buf, s) -> tuple:
    """The kernel's arguments for state buffer ``buf`` at chunk ``s``: kind, data, first index, absmax, code map,
    encoding entries."""
    if buf.kind is None:
        empty = torch.empty(0)
        return (_PLAIN[buf.data.dtype], buf.data[s.buf:s.buf + s.n], 0, empty, empty, empty)
    block = qstate.KINDS[buf.kind][0]
    b0 = buf.block0[s.lo] + s.offset // block
    return (_KIND[buf.kind], buf.data, s.buf, buf.absmax[b0:], *_tables(buf.kind, buf.signed))


@lru_cache(maxsize=None)
def _tables(kind: str, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The code map and, per top-16-bit pattern of a float32, the kernel's encoding entry (csrc: ``encode``):
    qstate._table's code in the low byte and, above it, the threshold on the value's lower 16 bits (ordered by
    ``key``: reversed for negative values) at which it rounds one code up: the midpoint's, where that midpoint
    lies in the pattern's bucket, else 0x10000 (never)."""
    codes, nxt = qstate._table(kind, signed)
    top = torch.arange(1 << 16, dtype=torch.int32)
    bits = nxt.view(torch.int32)
    inside = (((bits >> 16) & 0xFFFF) == top) & torch.isfinite(nxt)
    low = bits & 0xFFFF
    key = torch.where(top >= 0x8000, 0xFFFF - low, low)
    threshold = torch.where(inside, key, torch.full_like(key, 0x10000))
    return qstate.qmap(kind, signed), (codes | (threshold << 8)).contiguous()


def step(w_flat: torch.Tensor, g_flat: torch.Tensor, s, momentum, variance, *, unit_denom: Optional[torch.Tensor],
         bc1: Optional[torch.Tensor], inv_bc2: Optional[torch.Tensor], betas: tuple[float, float], eps: float,
         lr: float, weight_decay: float, update_clip: Optional[float], importance: str,
         generator: Optional[torch.Generator], grad_scale: float = 1.0) -> torch.Tensor:
    """The adaptive step of chunk ``s`` (:func:`core.dense_step`'s arguments), in place; the count of changed
    elements (an int64 tensor, as the eager loop's ``mask.sum()``). ``grad_scale``: an fp32 factor the kernel
    multiplies each fp32 gradient value by as it reads it (bit for bit ``g.mul_(grad_scale)`` first; the gradient
    is left as it was)."""
    # bf16 weights are rounded stochastically in the kernel, from the CPU generator's own draws (the optimizer
    # keeps one generator per device of its weights: CPU weights, a CPU generator; the eager loop's
    # torch.randint refuses any other)
    sr = generator is not None and w_flat.dtype == torch.bfloat16
    if sr and generator.device.type != "cpu":
        raise ValueError(f"core_cpu.step: CPU bf16 weights are rounded from a CPU generator, got a generator on "
                         f"{generator.device}; pass torch.Generator(device='cpu')")
    mod = _module()
    b1, b2 = betas
    w = w_flat[s.flat:s.flat + s.n]
    g = g_flat[s.flat:s.flat + s.n]
    four = momentum.kind == "4bit" or (variance is not None and variance.kind == "4bit")
    empty = torch.empty(0)
    v = _spec(variance, s) if variance is not None else (-1, empty, 0, empty, empty, empty)
    count = mod.step(w, g, list(s.lengths), *_spec(momentum, s), *v,
                     inv_bc2[s.lo:s.hi] if variance is not None else empty,
                     bc1[s.lo:s.hi] if variance is not None else unit_denom[s.lo:s.hi],
                     torch.empty(s.n if four else 0, dtype=torch.uint8),
                     b1, 1 - b1, b2, 1 - b2, eps, lr, weight_decay, update_clip is not None,
                     0.0 if update_clip is None else update_clip, importance == "grad_weight",
                     generator if sr else None, float(grad_scale))
    return torch.tensor(count)


def _encode_cpu(x: torch.Tensor, kind: str, signed: bool) -> Optional[torch.Tensor]:
    """:func:`qstate._encode` of the 1-D fp32 CPU tensor ``x`` by the kernel's encoding (None where it is off or
    did not build): the same codes, several times faster than the lookup (a fresh state's first packing)."""
    if not available():
        return None
    q, entries = _tables(kind, signed)
    return _module().encode_codes(x, 1.0, q, entries)


qstate._CPU_ENCODER = _encode_cpu
