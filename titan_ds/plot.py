"""Plots (matplotlib, headless): a training run's loss and memory; a memory-vs-quality frontier."""
from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["plot_run", "plot_frontier"]


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


# one colour and marker per family of row, in the legend's order
_FAMILIES = {"adamw": ("black", "o", "dense AdamW (lr grid)"), "peer": ("tab:blue", "s", "low-memory peers"),
             "titan": ("tab:red", "D", "titan profiles")}


def plot_frontier(points: list[dict[str, Any]], path: str, *, title: str = "",
                  xlabel: str = "training-state MiB (params + grads + optimizer + activations, accounted; log)",
                  ylabel: str = "validation loss (nats/byte)") -> None:
    """One labelled point per config: ``x`` (memory), ``y`` (mean loss), optional ``ylo``/``yhi`` (the seeds'
    min and max, drawn as an error bar), ``family`` (a key of the legend: adamw, peer, titan), ``label``, and
    ``best`` (drawn larger: the reference row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unknown = sorted({p["family"] for p in points} - set(_FAMILIES))
    if unknown:
        raise ValueError(f"unknown families {unknown}; choose from {sorted(_FAMILIES)}")
    fig, ax = plt.subplots(figsize=(10, 6))
    labels: list[tuple[dict[str, Any], str]] = []
    for fam, (colour, marker, name) in _FAMILIES.items():
        mine = [p for p in points if p["family"] == fam]
        if not mine:
            continue
        ax.scatter([p["x"] for p in mine], [p["y"] for p in mine], c=colour, marker=marker, label=name, zorder=3,
                   s=[90 if p.get("best") else 36 for p in mine])
        for p in mine:
            if p.get("ylo") is not None and p.get("yhi") is not None:
                ax.errorbar(p["x"], p["y"], yerr=[[p["y"] - p["ylo"]], [p["yhi"] - p["y"]]], c=colour, lw=1,
                            capsize=3, zorder=2)
            labels.append((p, colour))
    xs = [p["x"] for p in points]
    ax.set_xlim(min(xs) / 1.4, max(xs) * 2.6)  # room on the right for the labels of the largest configs
    _log_x_axes(fig, ax, xlabel, ylabel, title)
    _place_labels(fig, ax, labels)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# label positions tried in turn (offset in points, horizontal alignment), the first that overlaps no earlier label
_SPOTS = [((5, 4), "left"), ((5, -10), "left"), ((-5, 4), "right"), ((-5, -10), "right"), ((5, 13), "left"),
          ((5, -19), "left"), ((-5, 13), "right"), ((-5, -19), "right")]


def _place_labels(fig: Any, ax: Any, labels: list[tuple[dict[str, Any], str]]) -> None:
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    for p, colour in sorted(labels, key=lambda pc: pc[0]["y"]):
        for offset, ha in _SPOTS:
            text = ax.annotate(p["label"], (p["x"], p["y"]), textcoords="offset points", xytext=offset, ha=ha,
                               fontsize=7, color=colour)
            box = text.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in placed) or (offset, ha) == _SPOTS[-1]:
                placed.append(box)
                break
            text.remove()


def plot_curves(curves: dict[str, list[tuple[float, float, float]]], path: str, *, title: str = "",
                xlabel: str = "", ylabel: str = "", style: Optional[Callable[[str], dict]] = None) -> None:
    """One line per curve name through its ``(x, y, err)`` points (sorted by x; ``err`` drawn as +-error bar), a
    log x axis and a zero line (e.g. loss delta against a reference, by compression ratio). ``style(name)``:
    matplotlib keywords for that curve (e.g. one colour per method and one marker per worker count, where more
    curves than the 10 default colours would repeat one)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, pts in curves.items():
        pts = sorted(pts)
        kw = {"marker": "o", "ms": 4, "capsize": 3, "lw": 1.2, **(style(name) if style else {})}
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], label=name, **kw)
    ax.axhline(0.0, c="k", lw=0.8)
    _log_x_axes(fig, ax, xlabel, ylabel, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lines(series: dict[str, list[tuple[float, float]]], path: str, *, title: str = "", xlabel: str = "",
               ylabel: str = "") -> None:
    """One line per series through its ``(x, y)`` points on linear axes (e.g. validation loss against step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1.2, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _log_x_axes(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """A log x axis with plain tick labels (30, 300: not 3x10^1), labels, title, grid, legend, tight layout."""
    import matplotlib.ticker

    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
