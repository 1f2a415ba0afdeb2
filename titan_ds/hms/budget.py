"""HMS's memory check, run by :class:`~titan_ds.hms.install.HMSPillar`'s ``validate`` before anything is touched.

1. :func:`read_memory`: the RAM this process may use. The memory cgroup's limit (v1 ``memory.limit_in_bytes`` of
   the process's own group named in ``/proc/self/cgroup``, or v2 ``memory.max``; the smallest along the path up to
   the mount's root, since a parent's limit binds its children), else ``MemAvailable`` from ``/proc/meminfo`` plus
   what this process already holds (``VmRSS``: the estimate below counts the process's own baseline). Where both
   exist the smaller wins. Each figure carries the file it was read from.
2. :func:`estimate`: the bytes ``initialize`` and a step will hold in RAM for this model and these settings, from
   :func:`titan_ds.plan.predict` (the same structure and calibration as ``titan-ds plan``) with an
   :class:`~titan_ds.plan.HMSLayout` built from the config. Not counted: the activations, which depend on the
   sequence length that ``initialize`` does not know; plan's headroom (:data:`titan_ds.plan.HEADROOM`) is kept.
3. :func:`decide` (pure): the settings as given if they fit; else the first of :data:`KNOBS`' changes that fits,
   made only to keys the user did not set (``dram_cache_mb`` first: a smaller cache, down to
   :data:`MIN_CACHE_MB`; then ``gradient_buffer: "disk"``; then both); else a refusal naming the bytes needed, the
   bytes there are and where they were read, and the setting(s) that would fit (even ones the user set: named,
   never changed) or ``titan-ds plan``.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

__all__ = ["Memory", "Decision", "read_memory", "decide", "estimate", "settings_of", "KNOBS", "MIN_CACHE_MB"]

GiB, MiB = float(1 << 30), 1 << 20
# a v1 limit at or above this is "no limit" (the kernel writes 2^63 rounded down to a page: 9223372036854771712)
_NO_LIMIT = 1 << 62
# the smallest DRAM cache HMS picks by itself: the dram_cache_mb of plan's HMS candidates (plan.candidate_config),
# the one its calibration runs used
MIN_CACHE_MB = 64
# what the check may change, in the order tried, with the value each goes to (None: a size, as large as fits down to
# its floor). param_tier and optimizer_dram_mb are never changed (their defaults, "nvme" and 0, are already the
# smallest: another value is the user's); a refusal still names them
KNOBS: dict[str, Any] = {"dram_cache_mb": None, "gradient_buffer": "disk", "optimizer_dram_mb": None,
                         "param_tier": "nvme"}
AUTO = ("dram_cache_mb", "gradient_buffer")
_FLOOR = {"dram_cache_mb": MIN_CACHE_MB, "optimizer_dram_mb": 0}


@dataclass(frozen=True)
class Memory:
    bytes: int
    source: str  # where it was read, e.g. "memory.limit_in_bytes of /sys/fs/cgroup/memory/x"


@dataclass
class Decision:
    fits: bool
    need: float                                         # bytes of the settings chosen (or as given, if none fits)
    usable: float                                       # bytes the estimate may reach (plan's headroom kept)
    changes: dict[str, Any] = field(default_factory=dict)  # titan.hms key -> the value HMS picked
    message: str = ""                                   # the log line, or the refusal


# ------------------------------------------------------------------------------------------------ reading memory
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_along(mount: str, group: str, name: str) -> Optional[Memory]:
    """The smallest limit file ``name`` from ``<mount>/<group>`` up to ``<mount>`` (None: no limit set)."""
    best: Optional[Memory] = None
    parts = [p for p in group.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(mount, *parts[:depth])
        text = _read(os.path.join(folder, name))
        if text is None or text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if value < _NO_LIMIT and (best is None or value < best.bytes):
            best = Memory(value, f"{name} of {folder}")
    return best


def _cgroup_limit(proc: str, cgroup_root: str) -> Optional[Memory]:
    text = _read(os.path.join(proc, "self", "cgroup")) or ""
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        if "memory" in controllers.split(","):  # v1: "4:memory:/path"
            return _limit_along(os.path.join(cgroup_root, "memory"), group, "memory.limit_in_bytes")
    for line in text.splitlines():
        if line.startswith("0::"):  # v2: "0::/path", limits in memory.max of the unified hierarchy
            return _limit_along(cgroup_root, line[3:], "memory.max")
    return None


def _meminfo_available(proc: str) -> Optional[Memory]:
    fields = {}
    for line in (_read(os.path.join(proc, "meminfo")) or "").splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.split()
    for line in (_read(os.path.join(proc, "self", "status")) or "").splitlines():
        k, _, v = line.partition(":")
        if k == "VmRSS":
            fields["VmRSS"] = v.split()
    if "MemAvailable" not in fields:
        return None
    avail = int(fields["MemAvailable"][0]) * 1024
    rss = int(fields.get("VmRSS", ["0"])[0]) * 1024
    return Memory(avail + rss, f"MemAvailable of {os.path.join(proc, 'meminfo')} "
                               f"({avail / GiB:.2f} GiB) + this process's VmRSS ({rss / GiB:.2f} GiB)")


def read_memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[Memory]:
    """The RAM this process may use (see the module docstring); None where neither source can be read."""
    found = [m for m in (_cgroup_limit(proc, cgroup_root), _meminfo_available(proc)) if m is not None]
    return min(found, key=lambda m: m.bytes) if found else None


# ------------------------------------------------------------------------------------------------ deciding
def _options(settings: Mapping[str, Any], allowed: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Sets of knobs to change, fewest first, each in :data:`KNOBS`' order; only ones that change something."""
    movable = [k for k in KNOBS if k in allowed and k in settings and
               (settings[k] > _FLOOR[k] if KNOBS[k] is None else settings[k] != KNOBS[k])]
    return [c for n in range(1, len(movable) + 1) for c in itertools.combinations(movable, n)]


def _try(need: Callable[[Mapping[str, Any]], float], settings: Mapping[str, Any], knobs: tuple[str, ...],
         usable: float) -> Optional[tuple[dict[str, Any], float]]:
    """The changes for ``knobs`` (sizes as large as fits, at least their floor) and their need, if it fits."""
    trial = dict(settings)
    for k in knobs:
        trial[k] = _FLOOR[k] if KNOBS[k] is None else KNOBS[k]
    left = usable - need(trial)
    for k in knobs:  # a size adds its MiB to the estimate: give each what is left, up to the value it had
        if KNOBS[k] is None:
            extra = max(0, min(int(settings[k]) - _FLOOR[k], int(left // MiB)))
            trial[k] = _FLOOR[k] + extra
            left -= extra * MiB
    n = need(trial)
    return ({k: trial[k] for k in knobs}, n) if n <= usable else None


def _fmt(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"titan.hms.{k}={json.dumps(v)}" for k, v in changes.items())


def decide(need: Callable[[Mapping[str, Any]], float], settings: Mapping[str, Any], fixed: Mapping[str, str],
           have: Memory, headroom: float) -> Decision:
    """What fits ``have`` (less ``headroom``, a fraction), given ``need(settings) -> bytes`` and the titan.hms
    ``settings`` as configured (the keys of :data:`KNOBS`). ``fixed``: keys HMS must not change (the user set
    them), each with the reason a refusal gives."""
    usable = have.bytes * (1 - headroom)
    as_given = need(settings)
    have_txt = (f"{have.bytes / GiB:.2f} GiB ({have.source}; {usable / GiB:.2f} GiB of it usable, "
                f"{headroom:.0%} kept for the estimate's error)")
    if as_given <= usable:
        return Decision(True, as_given, usable, message=f"titan hms: about {as_given / GiB:.2f} GiB of RAM needed "
                                                        f"(activations not counted); it has {have_txt}")
    auto = tuple(k for k in AUTO if k not in fixed)
    for knobs in _options(settings, auto):
        hit = _try(need, settings, knobs, usable)
        if hit is not None:
            changes, n = hit
            return Decision(True, n, usable, changes, message=(
                f"titan hms: set {_fmt(changes)}: as configured this run needs about {as_given / GiB:.2f} GiB of "
                f"RAM, more than {have_txt}; with it about {n / GiB:.2f} GiB (write the key(s) into titan.hms "
                f"to keep them and silence this)"))
    head = (f"titan.hms: this run needs about {as_given / GiB:.2f} GiB of RAM in initialize and the step (activations "
            f"not counted) and has {have_txt}")
    for knobs in _options(settings, tuple(KNOBS)):
        hit = _try(need, settings, knobs, usable)
        if hit is not None:
            changes, n = hit
            why = "".join(f" ({fixed[k]})" for k in changes if k in fixed)
            return Decision(False, as_given, usable, message=f"{head}: set {_fmt(changes)} (about {n / GiB:.2f} "
                                                             f"GiB){why}, or give the job more memory")
    least = min((need({**settings, **{k: _FLOOR[k] if KNOBS[k] is None else KNOBS[k] for k in ks}}), ks)
                for ks in [()] + _options(settings, tuple(KNOBS)))
    with_least = f" with {_fmt({k: _FLOOR[k] if KNOBS[k] is None else KNOBS[k] for k in least[1]})}" if least[1] \
        else ""
    return Decision(False, as_given, usable, message=(
        f"{head}; no titan.hms setting makes it fit (the least is about {least[0] / GiB:.2f} GiB{with_least}): "
        f"give the job more memory, or run `titan-ds plan --model ... --cpu-mem {have.bytes / GiB:.1f}G` for a "
        f"configuration that fits (titan.optimizer's 8-bit state, bf16 partitions, a smaller model)"))


# ------------------------------------------------------------------------------------------------ the estimate
def settings_of(hms: Any) -> dict[str, Any]:
    """The :data:`KNOBS` of a ``titan.hms`` section (:class:`~titan_ds.config.HMSConfig`)."""
    return {k: getattr(hms, k) for k in KNOBS}


def _optimizer_key(titan: Any) -> str:
    """The optimizer plan models for this run: ASDT's bf16 or 8-bit/4-bit state where titan.optimizer says so;
    anything else (a client optimizer, ASDT's fp32 state) as AdamW, whose state and step temporaries are the
    largest plan measured (titan_ds/step_temp.json)."""
    opt = getattr(titan, "optimizer", None)
    if opt is None:
        return "adamw"
    if opt.second_moment == "coordinate":  # a per-coordinate second moment beside the momentum
        # titan_balanced's layout (8-bit momentum, 4-bit second moment: 1.547 bytes/param); any other pairing is
        # modelled as AdamW, the largest state plan knows, rather than as the momentum alone
        return "titan_balanced" if (opt.state_dtype, opt.second_dtype) in (("8bit", "4bit"), ("4bit", "4bit")) \
            else "adamw"
    return {"bf16": "asdt_bf16", "8bit": "asdt_8bit", "4bit": "asdt_8bit"}.get(opt.state_dtype, "adamw")


def estimate(*, params: int, largest: int, settings: Mapping[str, Any], titan: Any, zero: Mapping[str, Any],
             half: bool, gpu: bool, ranks: int = 1) -> float:
    """Bytes of RAM per rank that ``initialize`` and a step will hold (activations not counted) for a model of
    ``params`` elements (the largest one ``largest``) with ``settings`` (the :data:`KNOBS`), the ``titan``
    section, the ds_config's ``zero_optimization`` section ``zero`` and ``half`` (bf16/fp16 partitions)."""
    from ..plan import HMSLayout, ModelSpec, predict
    from .bounds import ZERO3_BOUNDS
    bounds = {k: int(zero[k]) if isinstance(zero.get(k), (int, float)) else v for k, v in ZERO3_BOUNDS.items()}
    opt = _optimizer_key(titan)
    layout = HMSLayout(optimizer=opt, weight_bytes=2 if half else 4,
                       params_in_dram=settings["param_tier"] == "dram",
                       grads_on_disk=settings["gradient_buffer"] == "disk",
                       cache_bytes=int(settings["dram_cache_mb"]) * MiB,
                       resident_bytes=int(settings["optimizer_dram_mb"]) * MiB, bounds=tuple(bounds.items()))
    # the calibrated process baseline of the plan mode closest to this run
    mode = "hms_dram" if layout.params_in_dram else "hms" if opt == "adamw" else \
        "hms_balanced" if opt == "titan_balanced" else "hms_asdt_bf16" if half else "hms_asdt"
    spec = ModelSpec("the model", params, layers=0, hidden=0, heads=1, vocab=0, intermediate=0, largest=largest)
    c = predict(mode, spec, ranks=ranks, gpu=gpu, layout=layout)
    c.dram.pop("activations", None)  # (zero: no layers given) the batch's, unknown here
    return c.dram_peak
