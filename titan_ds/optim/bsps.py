"""BSPS: Synaptic Plasticity Scheduling, a state machine over parameter blocks driven by gradient signals.

A *block* is a module's parameters (``block="module"``) or one parameter (``"parameter"``). States:

* **Frozen**   no update, no optimizer state; at stage 0 ``requires_grad=False`` (no gradient either).
* **Growth**   full learning rate, momentum buffer (ASDT's steps).
* **Elastic**  ``elastic_lr_scale`` x lr, no momentum; pulled toward its weights at entry (one anchor buffer).
* **Sleeping** like Frozen; its optimizer state has been freed (momentum restarts at zero when it wakes).

Signal: per block, the RMS of its gradient, smoothed by an EMA (``ema``), read every step for Growth and
Elastic blocks and, for Frozen and Sleeping ones, only at *probe steps* (step 1 and every ``wake_every``
steps), when every block gets a gradient. Transitions, decided at the end of step ``t`` and effective from
step ``t + 1``, each logged once:

1. step 1 (probe, no update yet): blocks ranked by signal enter Growth while the active elements stay within
   ``max_active_fraction`` of all elements; the rest are Frozen.
2. Growth -> Elastic: after ``warmup_steps`` in Growth, when the signal EMA has fallen to
   ``plateau_ratio`` x its peak while in Growth (the block's gradient has plateaued at a lower level).
3. Elastic -> Sleeping: after ``sleep_after`` steps in Elastic.
4. every step: Frozen/Sleeping blocks (except those that moved this step), strongest last-known signal
   first, wake into Growth while capacity allows; at a probe step (fresh signals) an Elastic block with a
   weaker signal is also put to sleep to make room for a stronger candidate.

``max_active_fraction`` bounds the elements of Growth + Elastic blocks (the ones holding optimizer state).
All decisions are a deterministic function of the signals, so every rank and every ZeRO stage takes them
identically (signals of blocks split across ranks are all-reduced first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..utils import get_logger

__all__ = ["Plasticity", "Transition", "FROZEN", "GROWTH", "ELASTIC", "SLEEPING", "STATE_NAMES"]

log = get_logger("titan_ds.optim")

FROZEN, GROWTH, ELASTIC, SLEEPING = 0, 1, 2, 3
STATE_NAMES = {FROZEN: "frozen", GROWTH: "growth", ELASTIC: "elastic", SLEEPING: "sleeping"}


@dataclass(frozen=True)
class Transition:
    step: int
    block: str
    src: str
    dst: str
    signal: float


class Plasticity:
    """Block states and their transitions; see the module docstring."""

    def __init__(self, blocks: list[str], numels: list[int], *, max_active_fraction: float = 0.5,
                 warmup_steps: int = 50, elastic_lr_scale: float = 0.3, elastic_pull: float = 0.01,
                 sleep_after: int = 100, wake_every: int = 50, ema: float = 0.9, plateau_ratio: float = 0.5):
        if len(blocks) != len(numels) or not blocks:
            raise ValueError("Plasticity needs one numel per block and at least one block")
        self.blocks, self.numels = list(blocks), [int(n) for n in numels]
        self.capacity = int(max_active_fraction * sum(self.numels))
        self.warmup_steps, self.elastic_lr_scale, self.elastic_pull = warmup_steps, elastic_lr_scale, elastic_pull
        self.sleep_after, self.wake_every, self.beta, self.plateau_ratio = sleep_after, wake_every, ema, plateau_ratio
        n = len(blocks)
        self.modes = [FROZEN] * n
        self.signal = torch.zeros(n, dtype=torch.float64)   # EMA of gradient RMS
        self.seen = torch.zeros(n, dtype=torch.bool)
        self.peak = torch.zeros(n, dtype=torch.float64)
        self.in_mode = [0] * n
        self.assigned = False
        self.step = 0
        self._acc = torch.zeros(n, dtype=torch.float64)
        self.events: list[Transition] = []

    # ------------------------------------------------------------------ queries (used by ASDT)
    def mode(self, b: int) -> int:
        return self.modes[b]

    def lr_scale(self, b: int) -> float:
        return {GROWTH: 1.0, ELASTIC: self.elastic_lr_scale}.get(self.modes[b], 0.0)

    def is_probe(self, t: int) -> bool:
        return t == 1 or t % self.wake_every == 0

    def needs_grad(self, b: int, t: int) -> bool:
        """Whether block ``b`` needs a gradient at step ``t`` (stage 0 sets ``requires_grad`` from it)."""
        return self.modes[b] in (GROWTH, ELASTIC) or self.is_probe(t)

    def observe(self, b: int, sumsq: float) -> None:
        self._acc[b] += sumsq

    def add_signals(self, sumsq: torch.Tensor) -> None:
        """:meth:`observe` for every block at once: ``sumsq[b]`` (fp64, any device; read to the host here) is
        block ``b``'s sum of squared gradients since the last :meth:`end_step`."""
        self._acc += sumsq.to(device=self._acc.device, dtype=torch.float64)

    def counts(self) -> dict[str, int]:
        return {name: sum(1 for m in self.modes if m == k) for k, name in STATE_NAMES.items()}

    def active_elements(self) -> int:
        return sum(n for n, m in zip(self.numels, self.modes) if m in (GROWTH, ELASTIC))

    # ------------------------------------------------------------------ transitions
    def take_signals(self) -> Optional[torch.Tensor]:
        """The signals added since the last :meth:`end_step` (fp64, per block), now cleared; None when all are 0.
        For a caller that sums them across ranks itself, on its device, before adding the sum back."""
        if not bool(self._acc.any()):
            return None
        out, self._acc = self._acc, torch.zeros_like(self._acc)
        return out

    def end_step(self, t: int, group: Any = None) -> list[Transition]:
        """Fold step ``t``'s signals in and decide transitions (effective from step ``t + 1``); ``group``: sum the
        signals over its ranks first."""
        if group is not None:
            import deepspeed.comm as dist
            dist.all_reduce(self._acc, group=group)
        probe = self.is_probe(t)
        before = len(self.events)
        for b in range(len(self.blocks)):
            if probe or self.modes[b] in (GROWTH, ELASTIC):
                rms = float((self._acc[b] / max(self.numels[b], 1)) ** 0.5)
                self.signal[b] = rms if not self.seen[b] else self.signal[b] * self.beta + rms * (1 - self.beta)
                self.seen[b] = True
                if self.modes[b] == GROWTH:
                    self.peak[b] = max(float(self.peak[b]), float(self.signal[b]))
        self._acc.zero_()
        self.step = t
        if not self.assigned:
            self._wake([b for b in range(len(self.blocks))], t)
            self.assigned = True
        else:
            for b, m in enumerate(self.modes):
                if m == GROWTH and self.in_mode[b] >= self.warmup_steps and \
                        self.signal[b] <= self.plateau_ratio * self.peak[b]:
                    self._move(b, ELASTIC, t)
                elif m == ELASTIC and self.in_mode[b] >= self.sleep_after:
                    self._move(b, SLEEPING, t)
            # wake into the freed capacity, strongest last-known signal first (fresh at probe steps); a block
            # that moved this step waits one step (no sleep -> wake churn within a step)
            moved = {e.block for e in self.events[before:]}
            self._wake([b for b, m in enumerate(self.modes) if m in (FROZEN, SLEEPING)
                        and self.blocks[b] not in moved], t, demote=probe)
        for b in range(len(self.blocks)):
            self.in_mode[b] += 1
        return self.events[before:]

    def _wake(self, candidates: list[int], t: int, demote: bool = False) -> None:
        order = sorted(candidates, key=lambda b: (-float(self.signal[b]), b))
        for b in order:
            free = self.capacity - self.active_elements()
            if self.numels[b] > free and not demote:
                continue
            if self.numels[b] > free:
                weaker = sorted((e for e, m in enumerate(self.modes) if m == ELASTIC and self.signal[e] < self.signal[b]),
                                key=lambda e: (float(self.signal[e]), e))
                room = free + sum(self.numels[e] for e in weaker)
                if self.numels[b] > room:
                    continue
                for e in weaker:
                    if self.numels[b] <= self.capacity - self.active_elements():
                        break
                    self._move(e, SLEEPING, t)
            self._move(b, GROWTH, t)
        if self.active_elements() == 0:
            raise ValueError(f"titan.plasticity.max_active_fraction leaves room for no block: capacity "
                             f"{self.capacity} elements, smallest block {min(self.numels)}; raise it")

    def _move(self, b: int, dst: int, t: int) -> None:
        src = self.modes[b]
        if src == dst:
            return
        self.modes[b], self.in_mode[b] = dst, 0
        if dst == GROWTH:
            self.peak[b] = self.signal[b]
        ev = Transition(t, self.blocks[b], STATE_NAMES[src], STATE_NAMES[dst], float(self.signal[b]))
        self.events.append(ev)
        log.info("titan.bsps: step %d block %s %s -> %s (grad-rms EMA %.3g)", t, ev.block, ev.src, ev.dst, ev.signal)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks), "modes": list(self.modes), "signal": self.signal.clone(),
                "seen": self.seen.clone(), "peak": self.peak.clone(), "in_mode": list(self.in_mode),
                "assigned": self.assigned, "step": self.step, "acc": self._acc.clone(),
                "events": [vars(e).copy() for e in self.events]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if list(sd["blocks"]) != self.blocks:
            raise ValueError("BSPS state was saved for different blocks (model or titan.plasticity.block changed)")
        self.modes, self.in_mode = list(sd["modes"]), list(sd["in_mode"])
        self.signal, self.seen, self.peak = sd["signal"].clone(), sd["seen"].clone(), sd["peak"].clone()
        self.assigned, self.step, self._acc = bool(sd["assigned"]), int(sd["step"]), sd["acc"].clone()
        self.events = [Transition(**e) for e in sd["events"]]


def block_name(param_name: str, block: str) -> str:
    if block == "parameter":
        return param_name
    if block == "module":
        return param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    raise ValueError(f"unknown plasticity block {block!r}; choose one of ['module', 'parameter']")
