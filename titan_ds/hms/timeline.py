"""Per-step timeline of an HMS training step: ``time.perf_counter`` spans, off by default.

The HMS swappers and a training script add spans to the recorder returned by :func:`current` when one is
enabled (:func:`enable`); when none is (the default) :func:`current` returns None and nothing is recorded, so the
cost off is one global read per swapper call. Phases (``PHASES``): the training script's ``forward``,
``backward`` and ``step`` (the whole ``engine.step``, lane ``main``) and one ``wall`` span per training step
(lane ``steps``); inside them the swappers' ``param fetch`` (waits in ``synchronize_reads`` / buffer reads),
``param write`` (the synchronous write, or with ``param_write_behind`` the queueing and the wait for earlier
sub-groups' writes), ``grad write``, ``opt read`` (waits in ``swap_in_optimizer_state``), ``opt write`` (the
synchronous write, or the wait for earlier background writes when pipelined, and the end-of-step flush) and, on
lane ``writer``, ``opt write (bg)``, ``param write (bg)`` and ``grad write (bg)`` (``gradient_store``): each background write from start to end
(overlapping the main lane).

:func:`breakdown` turns the spans of one step into seconds per phase, each span counted once in its innermost
phase (``forward`` without the ``param fetch`` inside it, and so on; ``opt compute`` is ``step`` less the
swapper spans inside it: DeepSpeed's other work in ``step`` (gradient norm, unscaling, copies) included) and
``idle`` the rest of the step's wall time; spans outside the step's wall time are left out.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Optional

__all__ = ["Timeline", "current", "enable", "disable", "breakdown", "PHASES", "TOP", "INNER"]

TOP = ("forward", "backward", "step")  # the training script's spans (lane "main")
INNER = ("param fetch", "param write", "grad write", "opt read", "opt write")  # the swappers' (lane "main")
BACKGROUND = ("opt write (bg)", "param write (bg)", "grad write (bg)")  # lane "writer"
PHASES = TOP + INNER + BACKGROUND

_CURRENT: Optional["Timeline"] = None


class Timeline:
    """Spans ``(phase, lane, start, end, step)`` with ``start``/``end`` in seconds since the recorder began."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.step = 0
        self.spans: list[tuple[str, str, float, float, int]] = []
        self._lock = threading.Lock()

    def add(self, phase: str, start: float, end: float, lane: str = "main") -> None:
        """A span from two ``time.perf_counter()`` readings (any thread)."""
        with self._lock:
            self.spans.append((phase, lane, start - self.t0, end - self.t0, self.step))

    @contextmanager
    def span(self, phase: str, lane: str = "main"):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, t, time.perf_counter(), lane)

    def to_dict(self, **meta) -> dict:
        with self._lock:
            spans = [{"phase": p, "lane": ln, "start": s, "end": e, "step": st} for p, ln, s, e, st in self.spans]
        return {"meta": meta, "spans": spans}

    def save(self, path: str, **meta) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(**meta), f)


def current() -> Optional[Timeline]:
    """The enabled recorder, or None (the default: record nothing)."""
    return _CURRENT


def enable(tl: Optional[Timeline] = None) -> Timeline:
    global _CURRENT
    _CURRENT = tl or Timeline()
    return _CURRENT


def disable() -> None:
    global _CURRENT
    _CURRENT = None


def breakdown(spans: list[dict], step: int) -> dict[str, float]:
    """Seconds per phase of training step ``step`` (see the module docstring); ``wall`` is the step's span."""
    wall = next((s for s in spans if s["step"] == step and s["phase"] == "wall"), None)
    if wall is None:
        raise ValueError(f"no wall span for step {step}")
    # the spans inside the step's wall time (a validation or metrics read after it carries the same step number)
    own = [s for s in spans if s["step"] == step and wall["start"] <= (s["start"] + s["end"]) / 2 <= wall["end"]]
    out = {p: 0.0 for p in TOP + INNER}
    for b in BACKGROUND:
        out[b] = sum(s["end"] - s["start"] for s in own if s["phase"] == b)
    tops = [s for s in own if s["lane"] == "main" and s["phase"] in TOP]
    for s in tops:
        out[s["phase"]] += s["end"] - s["start"]
    for s in own:
        if s["lane"] != "main" or s["phase"] not in INNER:
            continue
        d = s["end"] - s["start"]
        out[s["phase"]] += d
        mid = (s["start"] + s["end"]) / 2
        host = next((t for t in tops if t["start"] <= mid <= t["end"]), None)
        if host is not None:
            out[host["phase"]] -= d  # counted in its innermost phase only
    out["opt compute"] = out.pop("step")
    out["wall"] = wall["end"] - wall["start"]
    out["idle"] = out["wall"] - sum(v for k, v in out.items() if k in TOP + INNER + ("opt compute",))
    return out
