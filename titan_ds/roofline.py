"""The memory roofline of one optimizer step on a GPU: bytes moved per parameter element, and the step time that
predicts at a card's memory bandwidth (docs/gpu.md's table is :func:`markdown`'s output; ``python -m
titan_ds.roofline`` prints it, and ``tests/test_roofline.py`` checks the doc against it).

An elementwise optimizer step reads each element's weight, gradient and state and writes the weight and state
back, once each when the step is one fused kernel (items that stay in registers, the random bits of stochastic
rounding included, move no bytes). Its time is at least bytes / bandwidth: a lower bound that a fused kernel
approaches, a chain of eager kernels does not (each re-reads and re-writes its operands).

Bytes per element of a state, from the layouts in the code: fp32 4, bf16 2; a block-quantized state
(:mod:`titan_ds.optim.qstate`, torchao's ``OptimState8bit``/``OptimState4bit``) ``bits / 8`` of code plus one fp32
scale per block, ``4 / block`` (read and written with the codes).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

__all__ = ["Row", "BANDWIDTH", "PARAMS", "CPU_SOURCE", "rows", "markdown", "cpu_markdown"]

# nominal memory bandwidth, bytes/s: H100 SXM (HBM3) 3.35 TB/s, RTX 4090 (GDDR6X) 1.008 TB/s, the vendors' figures
BANDWIDTH = {"H100 (3.35 TB/s)": 3.35e12, "RTX 4090 (1.01 TB/s)": 1.01e12}
PARAMS = 1_000_000_000  # a 1B-parameter model
# the CPU measurements beside the roofline: launch/bench/optim_step.py's table (2^24 elements, 1 thread), and the
# row and parameter dtype of each optimizer in it
CPU_SOURCE = "results/optim_step_avx512/step.md"
CPU_ROWS = {"torch AdamW (fused)": ("adamw_fused", "fp32"), "torchao AdamW8bit": ("torchao_adamw8bit", "fp32"),
            "torchao AdamW4bit": ("torchao_adamw4bit", "fp32"), "titan_balanced": ("titan_balanced", "fp32"),
            "titan_memory": ("titan_memory", "bf16")}
FP32, BF16 = 4.0, 2.0


def quantized(bits: int, block: int) -> float:
    """Bytes per element of a block-quantized state: the code and its share of the block's fp32 scale."""
    return bits / 8 + 4 / block


def _titan(kind: str) -> float:
    from .optim.qstate import KINDS
    block, bits = KINDS[kind]
    return quantized(bits, block)


def _torchao_block(cls: str, default: int) -> int:
    """The block size torchao's ``cls`` uses by default (read from its signature where torchao is installed;
    ``default`` is torchao 0.18.0's)."""
    try:
        import torchao.optim as ao
        return int(inspect.signature(getattr(ao, cls).__init__).parameters["block_size"].default)
    except Exception:  # noqa: BLE001 (torchao is optional: its 0.18.0 defaults)
        return default


@dataclass(frozen=True)
class Row:
    optimizer: str
    layout: str
    weight: float   # bytes per element of the weight (read once, written once)
    grad: float     # bytes per element of the gradient (read once)
    states: tuple[float, ...]  # bytes per element of each state buffer (read once, written once)

    @property
    def read(self) -> float:
        return self.weight + self.grad + sum(self.states)

    @property
    def written(self) -> float:
        return self.weight + sum(self.states)

    @property
    def total(self) -> float:
        return self.read + self.written

    def ms(self, bandwidth: float, params: int = PARAMS) -> float:
        return self.total * params / bandwidth * 1e3


def rows() -> list[Row]:
    """The optimizers of docs/gpu.md, bytes per element from their state layouts."""
    ao8, ao4 = _torchao_block("AdamW8bit", 256), _torchao_block("AdamW4bit", 128)
    q8, q4 = _titan("8bit"), _titan("4bit")
    return [
        Row("torch AdamW (fused)", "fp32 w, g, m, v", FP32, FP32, (FP32, FP32)),
        Row("torchao AdamW8bit", f"fp32 w, g; m, v 8-bit, block {ao8}", FP32, FP32, (quantized(8, ao8),) * 2),
        Row("torchao AdamW4bit", f"fp32 w, g; m, v 4-bit, block {ao4}", FP32, FP32, (quantized(4, ao4),) * 2),
        Row("titan_balanced", "fp32 w, g; m 8-bit (block 256), v 4-bit (block 128)", FP32, FP32, (q8, q4)),
        Row("titan_memory", "bf16 w (stochastic rounding), bf16 g; m, v 4-bit (block 128)", BF16, BF16, (q4, q4)),
    ]


def markdown() -> str:
    """The roofline table of docs/gpu.md."""
    cards = list(BANDWIDTH)
    head = ("| optimizer | state layout | read B/el | written B/el | total B/el | "
            + " | ".join(f"1B step at {c}" for c in cards) + " |")
    lines = [head, "|" + "---|" * (5 + len(cards))]
    for r in rows():
        times = " | ".join(f"{r.ms(BANDWIDTH[c]):.2f} ms" for c in cards)
        lines.append(f"| {r.optimizer} | {r.layout} | {r.read:.4g} | {r.written:.4g} | {r.total:.4g} | {times} |")
    return "\n".join(lines)


def _measured(table: str, row: str, dtype: str, column: str = "M/s 2^24") -> float:
    """A cell of launch/bench/optim_step.py's markdown: ``column`` of the line of ``row`` with ``dtype``."""
    header = None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["optimizer", "dtype"]:
            header = cells
        elif header is not None and cells[:2] == [row, dtype]:
            return float(cells[header.index(column)])
    raise ValueError(f"{CPU_SOURCE}: no {column!r} for row {row!r} with {dtype} parameters")


def cpu_markdown(root: str = ".") -> str:
    """The CPU measurements beside the roofline (docs/gpu.md): each optimizer's elements/s from
    :data:`CPU_SOURCE` and the bandwidth that makes at :func:`rows`' bytes per element (B/el x elements/s)."""
    from pathlib import Path
    table = (Path(root) / CPU_SOURCE).read_text()
    lines = ["| optimizer | parameters | M elements/s (CPU, 1 thread, 2^24) | total B/el | bytes moved (GB/s) |",
             "|---|---|---|---|---|"]
    for r in rows():
        name, dtype = CPU_ROWS[r.optimizer]
        mps = _measured(table, name, dtype)
        lines.append(f"| {r.optimizer} | {dtype} | {mps:.1f} | {r.total:.4g} | {r.total * mps / 1e3:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
    print()
    print(cpu_markdown(str(__import__("pathlib").Path(__file__).resolve().parents[1])))
