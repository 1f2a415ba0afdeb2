"""Loss and memory plot of a training run (matplotlib, headless)."""
from __future__ import annotations

from typing import Any

__all__ = ["plot_run"]


def plot_run(history: list[dict[str, Any]], val_history: list[tuple[int, float]], summary: dict[str, Any],
             path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in history], [r["loss"] for r in history], lw=0.8, label="train")
    if val_history:
        ax1.plot(*zip(*val_history), "o-", label="validation")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte)")
    ax1.set_title(f"loss; pillars: {', '.join(summary.get('pillars') or ['none'])}")
    ax1.legend()
    mem = summary.get("memory", {})
    cats = ["parameters", "gradients", "optimizer_state", "activations"]
    ax2.bar(cats, [mem.get(c, 0) / 2**20 for c in cats])
    ax2.set_ylabel("MiB (accounted, peak over steps)")
    ax2.set_title(f"memory; peak RSS {summary.get('peak_rss', 0) / 2**20:.0f} MiB")
    ax2.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
