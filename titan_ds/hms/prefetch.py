"""Predictors of the next store accesses, and an oracle replay that scores them.

A predictor sees every access (``observe(key)``), is told when a training step ends (``end_step()``) and
names the keys it expects next (``predict(depth)``); the swapper prefetches those into DRAM.

* ``none``  (:class:`NonePredictor`): predicts nothing; only DeepSpeed's own look-ahead remains.
* ``trace`` (:class:`TracePredictor`): records the access order of a step, then replays it: after an access
  it finds that key in the recorded trace (searching forward from the current position, wrapping around)
  and predicts the keys that followed it. ZeRO-3's access order is the same every step once its coordinator
  has traced the model, but DeepSpeed's *first* step fetches differently (it is still recording: forward and
  backward gathers, measured 12 swap-ins against 6 later), so the predictor keeps the order of the most
  recent complete step, not only the first: from the third step on it is exact.
* ``lstm``  (:class:`LSTMPredictor`): the seed's "LSTM-based prefetch". A one-layer LSTM over key ids
  (embedding 32, hidden 64), trained online: at the end of every step it takes ``epochs`` passes of Adam
  steps over that step's accesses, in windows of ``window`` with half-window stride (next-key
  cross-entropy, truncated BPTT). Training happens at the step boundary, never inside an access: ZeRO-3
  calls the swapper from its forward/backward hooks, where autograd must not be re-entered. Prediction
  rolls the network forward greedily ``depth`` steps from its current state.
* :class:`OraclePredictor` knows the future (the scoring upper bound), and :func:`replay` scores any
  predictor on a recorded trace with a bounded prefetch buffer (LRU eviction, or Belady's farthest-next-use
  eviction for the oracle bound): hit rate overall and after the first step, and bytes prefetched.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

__all__ = ["Predictor", "NonePredictor", "TracePredictor", "LSTMPredictor", "OraclePredictor", "make_predictor",
           "replay", "ReplayResult", "PREDICTORS"]


class Predictor(Protocol):
    def observe(self, key: str) -> None: ...
    def predict(self, depth: int) -> list[str]: ...
    def end_step(self) -> None: ...


class NonePredictor:
    def observe(self, key: str) -> None:
        """Predicts nothing, so nothing to learn."""

    def predict(self, depth: int) -> list[str]:
        return []

    def end_step(self) -> None:
        """Stateless."""


class TracePredictor:
    """Replay the access order of the last complete step (see module docstring)."""

    def __init__(self) -> None:
        self.trace: list[str] = []
        self.locked = False
        self.pos = 0
        self._where: dict[str, list[int]] = {}
        self._current: list[str] = []

    def observe(self, key: str) -> None:
        self._current.append(key)
        if not self.locked:
            return
        idx = self._where.get(key)
        if not idx:
            return
        n = len(self.trace)
        # the first recorded occurrence at or after the current position, wrapping around
        self.pos = (min(idx, key=lambda i: (i - self.pos) % n) + 1) % n

    def predict(self, depth: int) -> list[str]:
        if not self.locked or not self.trace:
            return []
        n = len(self.trace)
        return [self.trace[(self.pos + i) % n] for i in range(min(depth, n))]

    def end_step(self) -> None:
        if self._current and self._current != self.trace:
            self.trace, self._where = self._current, {}
            for i, k in enumerate(self.trace):
                self._where.setdefault(k, []).append(i)
            self.pos = 0
        self.locked = bool(self.trace)
        self._current = []


class LSTMPredictor:
    """A small LSTM over key ids, trained online at step boundaries (see module docstring)."""

    def __init__(self, max_keys: int = 4096, embed: int = 32, hidden: int = 64, window: int = 64,
                 epochs: int = 4, lr: float = 1e-2, seed: int = 0):
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.max_keys, self.window, self.epochs = max_keys, window, epochs
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.emb = torch.nn.Embedding(max_keys, embed)
            self.cell = torch.nn.LSTMCell(embed, hidden)
            self.head = torch.nn.Linear(hidden, max_keys)
        params = [*self.emb.parameters(), *self.cell.parameters(), *self.head.parameters()]
        self.opt = torch.optim.Adam(params, lr=lr)
        self.step_ids: list[int] = []
        self.state: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.train_steps = 0

    def _id(self, key: str) -> Optional[int]:
        i = self.ids.get(key)
        if i is None and len(self.names) < self.max_keys:
            i = self.ids[key] = len(self.names)
            self.names.append(key)
        return i

    @torch.no_grad()
    def _advance(self, i: int, state):
        return self.cell(self.emb(torch.tensor([i])), state)

    def observe(self, key: str) -> None:
        i = self._id(key)
        if i is None:
            return
        self.step_ids.append(i)
        self.state = self._advance(i, self.state)

    def _train_window(self, seq: torch.Tensor) -> None:
        with torch.enable_grad():
            x = self.emb(seq[:-1])
            state, logits = None, []
            for t in range(x.shape[0]):
                state = self.cell(x[t:t + 1], state)
                logits.append(self.head(state[0]))
            loss = torch.nn.functional.cross_entropy(torch.cat(logits), seq[1:])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.train_steps += 1

    @torch.no_grad()
    def predict(self, depth: int) -> list[str]:
        if self.state is None or not self.names:
            return []
        out, state = [], self.state
        for _ in range(depth):
            logits = self.head(state[0])[0, :len(self.names)]
            i = int(logits.argmax())
            out.append(self.names[i])
            state = self._advance(i, state)
        return out

    def end_step(self) -> None:
        """Train on the step just finished, then keep the recurrent state (the next step continues it)."""
        ids = torch.tensor(self.step_ids)
        self.step_ids = []
        if ids.numel() < 3:
            return
        stride = max(1, self.window // 2)
        starts = list(range(0, max(1, ids.numel() - self.window) + 1, stride))
        for _ in range(self.epochs):
            for s0 in starts:
                self._train_window(ids[s0:s0 + self.window + 1])


class OraclePredictor:
    """Knows the whole future access sequence (scoring upper bound only)."""

    def __init__(self, future: Sequence[str]):
        self.future, self.pos = list(future), 0

    def observe(self, key: str) -> None:
        self.pos += 1

    def predict(self, depth: int) -> list[str]:
        return self.future[self.pos:self.pos + depth]

    def end_step(self) -> None:
        """The oracle needs no step boundary."""


PREDICTORS = {"none": NonePredictor, "trace": TracePredictor, "lstm": LSTMPredictor}


def make_predictor(name: str) -> Predictor:
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; choose one of {sorted(PREDICTORS)}")
    return PREDICTORS[name]()


@dataclass
class ReplayResult:
    hits: int
    accesses: int
    hits_after_first: int
    accesses_after_first: int
    prefetched: int
    bytes_prefetched: int
    wasted: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def hit_rate_after_first(self) -> float:
        return self.hits_after_first / self.accesses_after_first if self.accesses_after_first else 0.0


def replay(steps: Sequence[Sequence[str]], predictor: Predictor, *, capacity: int, depth: int,
           sizes: Optional[dict[str, int]] = None, evict: str = "lru", warmup_steps: int = 1) -> ReplayResult:
    """Score ``predictor`` on a recorded per-step access trace with a prefetch buffer of ``capacity`` keys.

    An access is a hit when its key is in the buffer (prefetched, or still resident from a previous use);
    a miss loads it on demand. After each access the predictor names ``depth`` keys, which are fetched into
    the buffer. ``evict="belady"`` evicts the key whose next use is farthest (optimal, needs the future).
    ``hits_after_first`` counts from step ``warmup_steps`` on.
    """
    if evict not in ("lru", "belady"):
        raise ValueError(f"unknown eviction {evict!r}; choose 'lru' or 'belady'")
    if depth > capacity:
        raise ValueError(f"depth {depth} must be at most capacity {capacity}: deeper prefetches evict the keys "
                         f"needed first")
    flat = [k for s in steps for k in s]
    next_use: list[int] = [0] * len(flat)
    last: dict[str, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], len(flat) + 1)
        last[flat[i]] = i
    upcoming = dict(last)  # key -> index of its next use, updated as the replay advances
    buf: OrderedDict[str, None] = OrderedDict()
    hits = hits1 = acc1 = pref = pbytes = 0
    unused: set[str] = set()  # prefetched, not yet used
    wasted = [0]
    first_len = sum(len(s) for s in steps[:warmup_steps])  # "after first" counts from step warmup_steps on

    def insert(k: str) -> None:
        if k in buf:
            buf.move_to_end(k)
            return
        while len(buf) >= capacity:
            if evict == "lru":
                victim = next(iter(buf))
            else:
                victim = max(buf, key=lambda x: upcoming.get(x, len(flat) + 1))
            buf.pop(victim)
            if victim in unused:
                unused.discard(victim)
                wasted[0] += 1  # a prefetch evicted before its use
        buf[k] = None

    def fetch(keys: list[str], pref: int, pbytes: int) -> tuple[int, int]:
        for k in reversed(keys):  # farthest first, so the key needed next is the most recently used
            if k not in buf:
                pref += 1
                pbytes += (sizes or {}).get(k, 0)
                insert(k)
                unused.add(k)
        return pref, pbytes

    i = 0
    for s, step in enumerate(steps):
        for key in step:
            hit = key in buf
            hits += hit
            if i >= first_len:
                acc1 += 1
                hits1 += hit
            upcoming[key] = next_use[i]
            insert(key)
            unused.discard(key)
            predictor.observe(key)
            pref, pbytes = fetch(predictor.predict(depth), pref, pbytes)
            i += 1
        predictor.end_step()
        pref, pbytes = fetch(predictor.predict(depth), pref, pbytes)  # the next step's first keys
    return ReplayResult(hits, len(flat), hits1, acc1, pref, pbytes, wasted[0])
