"""Which second moment does a bf16-momentum optimizer need to train like AdamW? (the probe behind
ASDT's ``update="adaptive"``, docs/log.md (ASDT)).

    python launch/bench/second_moment_probe.py --steps 300 --seed 0 --out results/second_moment_probe

Each row trains the seed workload with ``launch/train.py`` (same model, data, schedule and validation as every
benchmark) and one client optimizer: torch AdamW, or one of the probe rules below, each with a bf16 momentum
(2 bytes/param) and an Adam step ``m_hat / (sqrt(v_hat) + eps)`` whose second moment ``v`` is:

- ``probe_full``: per coordinate (fp32, 4 bytes/param more: what the bf16 momentum alone costs against AdamW);
- ``probe_row``: one per row of a matrix (Adam-mini's one scale per output channel / token), per coordinate on
  vectors;
- ``probe_row1d``: one per row of a matrix, one per vector;
- ``probe_factored``: Adafactor's rank-1 factorisation (row and column means) on matrices, per coordinate on
  vectors;
- ``probe_tensor``: one per tensor (Adalayer), per coordinate on vectors;

and ``probe_sign``: no second moment, Lion's sign of the interpolated momentum (ASDT's ``update="sign"`` at
density 1) at 0.3x the lr. The rules are written here, plainly, as a probe (not titan code): the one chosen is
ASDT's ``update="adaptive"`` (``titan_ds/optim/asdt.py``, tested against its own reference loop).

Resumable: each finished row is recorded in ``<out>.jsonl`` at once (``launch/bench/store.py``) and a rerun from
the same code skips it (``--reuse-stale``: from any code).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import ResultLog  # noqa: E402
from launch.bench.store import add_store_args  # noqa: E402

RULES = ("full", "row", "row1d", "factored", "tensor", "sign")
DESCRIBE = {"adamw": "torch AdamW (fp32 m and v)", "probe_full": "v per coordinate (fp32)",
            "probe_row": "v per matrix row; per coordinate on vectors", "probe_row1d": "v per matrix row; per vector",
            "probe_factored": "Adafactor row x column factors; per coordinate on vectors",
            "probe_tensor": "v per tensor; per coordinate on vectors",
            "probe_sign": "no v: sign of the interpolated momentum (Lion), 0.3x lr"}


class Probe(torch.optim.Optimizer):
    """bf16 momentum + the second moment of ``rule`` (see the module docstring); decoupled weight decay."""

    def __init__(self, params, lr: float, rule: str, betas=(0.9, 0.95), eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.rule = rule

    def _v(self, st: dict, p: torch.Tensor, g2: torch.Tensor, b2: float) -> torch.Tensor:
        matrix = p.dim() >= 2
        if self.rule == "row1d" and not matrix:
            st.setdefault("v", torch.zeros(())).mul_(b2).add_(g2.mean(), alpha=1 - b2)
        elif not matrix or self.rule == "full":
            st.setdefault("v", torch.zeros_like(p, dtype=torch.float32)).mul_(b2).add_(g2, alpha=1 - b2)
        elif self.rule in ("row", "row1d"):
            st.setdefault("v", torch.zeros(p.shape[0], 1)).mul_(b2).add_(g2.mean(1, keepdim=True), alpha=1 - b2)
        elif self.rule == "tensor":
            st.setdefault("v", torch.zeros(())).mul_(b2).add_(g2.mean(), alpha=1 - b2)
        elif self.rule == "factored":
            r = st.setdefault("r", torch.zeros(p.shape[0], 1)).mul_(b2).add_(g2.mean(1, keepdim=True), alpha=1 - b2)
            c = st.setdefault("c", torch.zeros(1, p.shape[1])).mul_(b2).add_(g2.mean(0, keepdim=True), alpha=1 - b2)
            return r * c / r.mean().clamp_min(1e-30)
        return st["v"]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad.float(), self.state[p]
                if not st:
                    st["t"], st["m"] = 0, torch.zeros_like(p, dtype=torch.bfloat16)
                st["t"] += 1
                m = st["m"].float()
                p.mul_(1 - lr * wd)
                if self.rule == "sign" and p.dim() >= 2:  # Lion: update with beta1, momentum with 0.99
                    p.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-lr * 0.3)
                    st["m"] = (m * 0.99 + g * 0.01).to(torch.bfloat16)
                    continue
                m = m * b1 + g * (1 - b1)
                st["m"] = m.to(torch.bfloat16)
                v = self._v(st, p, g * g, b2)
                bc1, bc2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
                p.add_((m / bc1) / ((v / bc2).sqrt() + group["eps"]), alpha=-lr)


def _worker(argv: Sequence[str]) -> None:
    """Run launch/train.py in this process with the probe rules as extra --optimizer choices."""
    sys.path.insert(0, str(ROOT / "launch"))
    import train
    for rule in RULES:
        train.CLIENT_OPTIMIZERS[f"probe_{rule}"] = (lambda r: lambda groups, lr: Probe(groups, lr, r))(rule)
    train.main(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's best lr of the frontier grid")
    p.add_argument("--rows", default="adamw," + ",".join(f"probe_{r}" for r in RULES))
    p.add_argument("--out", default=str(ROOT / "results" / "second_moment_probe"))
    add_store_args(p)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = ResultLog(out.with_suffix(".jsonl"), key=lambda r: (r["row"], r["steps"], r["seed"], r["lr"]),
                      reuse_stale=a.reuse_stale)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

    def run(row: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            summary = Path(tmp) / "s.json"
            cmd = [sys.executable, __file__, "--worker", "--deepspeed_config",
                   str(ROOT / "ds_configs" / "baseline_adamw.json"), "--steps", str(a.steps), "--seed", str(a.seed),
                   "--lr", repr(a.lr), "--optimizer", row, "--summary-out", str(summary), "--no-progress"]
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            s = json.loads(summary.read_text())
        return {"row": row, "steps": a.steps, "seed": a.seed, "lr": a.lr, "val_loss": s["val_loss"],
                "optimizer_bytes_per_param": s["optimizer_bytes_per_param"], "step_s": s["step_s"]}

    rows = [store.get((r, a.steps, a.seed, a.lr), lambda r=r: run(r), lambda x: f"{x['row']}: {x['val_loss']:.4f}")
            for r in a.rows.split(",")]
    ref = next((r for r in rows if r["row"] == "adamw"), rows[0])
    lines = [f"### Second moment of a bf16-momentum optimizer vs AdamW ({a.steps} steps, seed {a.seed}, lr {a.lr})", "",
             f"Command: `python launch/bench/second_moment_probe.py --steps {a.steps} --seed {a.seed} --out "
             f"{os.path.relpath(out, ROOT)}`. One seed: a sweep, not a confirmed claim (AdamW's seed-to-seed spread at "
             f"300 steps is 0.014, results/frontier_300_2seeds.md). optim_B_per_param measured from the state.", "",
             "| row | second moment | val_loss | delta vs AdamW | optim_B_per_param |", "|---|---|---|---|---|"]
    for r in rows:
        mark = " (*)" if r.get("note") else ""
        lines.append(f"| {r['row']}{mark} | {DESCRIBE[r['row']]} | {r['val_loss']:.4f} | "
                     f"{r['val_loss'] - ref['val_loss']:+.4f} | {r['optimizer_bytes_per_param']:.2f} |")
    notes = sorted({r["note"] for r in rows if r.get("note")})
    lines += ["", *[f"(*) {n}." for n in notes]] if notes else []
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        main()
