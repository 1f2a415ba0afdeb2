"""Side-by-side benchmark harness: every row trains the same model on the same data, seed and token budget
through ``launch/train.py`` (one fresh process group per row, so peak RSS is per row), in one invocation.

The first row is the baseline: plain DeepSpeed with torch AdamW as the client optimizer. The table reports
validation loss and its delta vs the baseline, tokens/s as a ratio to the baseline (this 2-core machine is
noisy: ratios only; absolute times only from a GPU), accounted memory by category, peak RSS, weight compression
(TRD) and gradient bytes on the wire.

It lives in the source tree, not in the installed package: it runs the checkout's ``launch/train.py`` and reads
``ds_configs/``. Scripts import it as ``launch.bench.harness`` with the checkout on ``sys.path``.
"""
from __future__ import annotations

import copy
import csv
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

__all__ = ["baseline_config", "compare", "localise_paths", "run_row", "write_table", "seed_of", "add_dgc_args", "ResultLog",
           "seed_verdict", "shm_op_stamp", "run_capped_clean", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: launch/bench/harness.py
_log = logging.getLogger("titan_ds.bench")
MiB = 2**20


def add_dgc_args(p: Any) -> None:
    """The ``--dgc-*`` flags of the compression benchmarks' ``dgc`` rows (topk with DGC's options, issue 14)."""
    p.add_argument("--dgc-momentum", type=float, default=0.9, help="DGC momentum correction (0: off)")
    p.add_argument("--dgc-no-masking", action="store_true", help="DGC without momentum factor masking")
    p.add_argument("--dgc-clip", type=float, default=None, help="DGC local clip (max norm per parameter)")
    p.add_argument("--dgc-ramp-steps", type=int, default=0, help="DGC sparsity warm-up steps (after the dense ones)")
    p.add_argument("--dgc-ramp-start", type=float, default=2.0, help="ratio at the start of the ramp")
    p.add_argument("--dgc-beta1", type=float, default=0.0,
                   help="AdamW beta1 of the dgc rows with momentum (the compressor's velocity is the momentum)")


def seed_verdict(delta: float, spread: float) -> str:
    """A delta between seed means is a difference only beyond the seed-to-seed spread (max - min over the seeds,
    the larger of the two rows')."""
    if abs(delta) < spread:
        return "no difference"
    return "worse" if delta > 0 else "better"


def baseline_config(stage: int = 0, **overrides: Any) -> dict[str, Any]:
    """The plain-DeepSpeed ds_config every benchmark starts from (ds_configs/baseline_adamw.json + ZeRO stage)."""
    cfg = json.loads((ROOT / "ds_configs" / "baseline_adamw.json").read_text())
    cfg["zero_optimization"] = {"stage": stage}
    if stage > 0:
        cfg["zero_allow_untested_optimizer"] = True  # torch AdamW as client optimizer is "untested" for ZeRO
    cfg.update(copy.deepcopy(overrides))
    return cfg


def localise_paths(obj: Any, folder: Path) -> Any:
    """A copy of a ds_config with every ``nvme_path`` and HMS spill-tier ``path`` moved into ``folder`` (same
    base names), so a run never writes next to the checkout."""
    if isinstance(obj, dict):
        out = {k: (str(Path(folder) / Path(v).name) if k == "nvme_path" else localise_paths(v, folder))
               for k, v in obj.items()}
        for tier in out.get("spill_tiers", []):
            tier["path"] = str(Path(folder) / Path(tier["path"]).name)
        return out
    if isinstance(obj, list):
        return [localise_paths(v, folder) for v in obj]
    return obj


def shm_op_stamp() -> float:
    """Modification time of DeepSpeed's JIT-built CPU shared-memory op (0 if absent). A measured run during which
    it changed paid for a rebuild: g++ inside the run's memory cgroup (~1-2 GiB, ~1 min), seen here as runs up
    to 3x their usual peak. Benchmarks that measure peaks compare it before and after and run again."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    try:
        return os.path.getmtime(os.path.join(ext, "deepspeed_shm_comm", "deepspeed_shm_comm.so"))
    except OSError:
        return 0.0


def run_capped_clean(cmd: Sequence[str], cap_bytes: int, log_path: Path, **kw: Any):
    """``titan_ds.memcap.run_capped`` with stdout/stderr to ``log_path``, run again (up to 3 times) when
    DeepSpeed's shm op was rebuilt during the run (:func:`shm_op_stamp`): that peak is g++'s, not the job's."""
    import subprocess

    from titan_ds.memcap import run_capped
    for _ in range(3):
        stamp = shm_op_stamp()
        with open(log_path, "w") as f:
            r = run_capped(cmd, cap_bytes, stdout=f, stderr=subprocess.STDOUT, **kw)
        if shm_op_stamp() == stamp:
            break
        _log.warning("%s: DeepSpeed's shm op was rebuilt during the run (g++ in the cgroup); measuring again",
                     log_path.stem)
    return r


class ResultLog:
    """Finished benchmark results, one JSON object per line of ``path``, each under ``key(result)``; a rerun of a
    resumable benchmark reuses them and runs only what is missing."""

    def __init__(self, path: Path, key: Callable[[dict], tuple], load: Optional[Callable[[dict], dict]] = None):
        self.path, self._key = Path(path), key
        self.rows: dict[tuple, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    r = load(r) if load else r
                    self.rows[key(r)] = r

    def get(self, k: tuple, run: Callable[[], dict], describe: Callable[[dict], str]) -> dict:
        """The result under ``k``: the saved one, or ``run()`` saved at once (and ``describe``d on stdout)."""
        if k not in self.rows:
            r = run()
            self.rows[k] = r
            with open(self.path, "a") as f:
                f.write(json.dumps(r) + "\n")
            _log.info("%s", describe(r))
        return self.rows[k]


def _launcher(num_ranks: int, port: int) -> list[str]:
    if num_ranks == 1:
        return [sys.executable]
    ds = Path(sys.executable).with_name("deepspeed")
    return [str(ds) if ds.exists() else "deepspeed", "--num_gpus", str(num_ranks), "--master_port", str(port)]


def run_row(name: str, ds_config: dict[str, Any], *, steps: int, num_ranks: int = 1,
            extra_args: Sequence[str] = (), workdir: Optional[Path] = None, timeout: Optional[float] = None,
            log_dir: Optional[Path] = None) -> dict[str, Any]:
    """Train one configuration; return its summary (launch/train.py --summary-out) plus name and status."""
    from titan_ds.utils import free_port
    workdir = Path(workdir or tempfile.mkdtemp(prefix="titan_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / f"{name}.json"
    cfg_path.write_text(json.dumps(ds_config, indent=1))
    summary_path = workdir / f"{name}.summary.json"
    cmd = _launcher(num_ranks, free_port()) + [str(ROOT / "launch" / "train.py"), "--deepspeed_config",
                                                 str(cfg_path), "--steps", str(steps), "--summary-out",
                                                 str(summary_path), "--no-progress", *extra_args]
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the child sets up its own world; never rendezvous on a port this process holds
    log_path = (log_dir or workdir) / f"{name}.log"
    with open(log_path, "w") as logf:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not summary_path.exists():
        tail = log_path.read_text()[-2000:]
        return {"name": name, "status": f"failed (exit {proc.returncode}); log {log_path}", "log_tail": tail}
    out = json.loads(summary_path.read_text())
    out.update(name=name, status="ok", command=" ".join(cmd))
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _row_values(r: dict[str, Any], base: dict[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    if r.get("status") != "ok":
        return {"config": r["name"], "status": r.get("status", "?")}
    mem, tm = r.get("memory", {}), r.get("titan_metrics", {})
    ok_base = base.get("status") == "ok"
    vals = {
        "config": r["name"],
        "val_loss": r["val_loss"],
        "delta_vs_base": r["val_loss"] - base["val_loss"] if ok_base else None,
        "tokens_per_s_ratio": r["tokens_per_s"] / base["tokens_per_s"] if ok_base else None,
        "params_MiB": mem.get("parameters", 0) / MiB,
        "grads_MiB": mem.get("gradients", 0) / MiB,
        "optim_MiB": mem.get("optimizer_state", 0) / MiB,
        "activ_MiB": mem.get("activations", 0) / MiB,
        "comm_MiB": mem.get("compression_state", 0) / MiB,
        "train_state_MiB": mem.get("training_state", 0) / MiB,
        "peak_rss_MiB": r.get("peak_rss", 0) / MiB,
        "trd_x_linears": tm.get("trd_compression_ratio", 1.0),
        "trd_x_model": tm.get("trd_model_compression_ratio", 1.0),
        "wire_x": tm.get("wire_compression_ratio", 1.0),  # the last step's (steady state)
        "wire_x_run": tm.get("wire_compression_ratio_run", 1.0),  # the whole run, warm-up included
        "wire_MiB_per_step": (tm["wire_bytes"] / MiB) if tm.get("wire_bytes") is not None else None,
    }
    for c in columns:
        vals[c] = tm.get(c, r.get(c))
    vals["status"] = "ok"
    return vals


def seed_of(args: Sequence[str]) -> str:
    """The ``--seed`` that ``launch/train.py`` gets from these arguments (the last one wins, as in argparse)."""
    seed = "0"  # launch/train.py's default
    for i, a in enumerate(args):
        if a == "--seed" and i + 1 < len(args):
            seed = str(args[i + 1])
        elif a.startswith("--seed="):
            seed = a.split("=", 1)[1]
    return seed


def write_table(rows: list[dict[str, Any]], out: Path, *, title: str, steps: int, num_ranks: int,
                columns: Sequence[str] = (), command: str = "", seeds: Sequence[str] = ("0",)) -> str:
    """Write ``<out>.csv`` and ``<out>.md``; return the markdown. ``seeds``: the training seeds of the rows."""
    base = rows[0]
    table = [_row_values(r, base, columns) for r in rows]
    keys = list(dict.fromkeys(k for t in table for k in t))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(table)
    import torch
    model = base.get("model", {})
    head = [f"### {title}", "",
            f"Command: `{command}`" if command else "",
            f"Machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
            f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}; torch "
            f"{torch.__version__}, deepspeed {_ds_version()}; {datetime.date.today().isoformat()}",
            f"Workload: GPT {model.get('n_layer')}x{model.get('n_embd')} ({base.get('trainable_params', 0):,} params), "
            f"context {model.get('block_size')}, micro-batch {base.get('micro_batch')} x {num_ranks} rank(s), "
            f"{steps} steps (~{steps * (base.get('micro_batch') or 0) * num_ranks * (model.get('block_size') or 0) / 1e6:.2f}M "
            f"tokens), seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}, validation on the fixed held-out batches. "
            f"Timings are ratios to the first row.", ""]
    fmt = {"tokens_per_s_ratio": ".2f", "trd_x_linears": ".1f", "trd_x_model": ".2f", "wire_x": ".1f",
           "delta_vs_base": "+.3f", "val_loss": ".3f"}
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for t in table:
        lines.append("| " + " | ".join(_fmt(t.get(k), fmt.get(k, ".1f" if k.endswith("MiB") or k.endswith("_MiB_per_step") else ".3f"))
                                       for k in keys) + " |")
    md = "\n".join([h for h in head if h is not None] + lines) + "\n"
    out.with_suffix(".md").write_text(md)
    return md


def _ds_version() -> str:
    try:
        import deepspeed
        return deepspeed.__version__
    except Exception as e:  # report, do not fail the table, if deepspeed cannot be imported here
        return f"unavailable ({type(e).__name__})"


def compare(rows: Iterable[tuple[Any, ...]], *, steps: int, out: str | os.PathLike, num_ranks: int = 1,
            extra_args: Sequence[str] = (), title: str = "", columns: Sequence[str] = (),
            command: str = "", timeout: Optional[float] = None, resume: bool = False) -> list[dict[str, Any]]:
    """Run every ``(name, ds_config)`` row with the same model/data/seed/tokens; write ``<out>.csv``/``.md``.

    A row may be ``(name, ds_config, row_args)``: ``row_args`` are appended to ``extra_args`` for that row only
    (e.g. ``["--lr", "3e-3"]`` to give the baseline its own learning rate). ``resume``: each finished row is
    appended to ``<out>.jsonl`` at once, keyed by its name, config, arguments, steps and ranks; a rerun reuses
    the rows saved there and runs only the others (long benchmarks that outlive a session)."""
    from tqdm import tqdm
    out = Path(out)
    rows = list(rows)
    log_dir = out.parent / "logs" / out.stem  # one folder per table: row names repeat across tables
    log_dir.mkdir(parents=True, exist_ok=True)
    store = ResultLog(out.with_suffix(".jsonl"), key=lambda r: (r["name"], r["row_key"])) if resume else None
    results = []
    seeds = sorted({seed_of([*extra_args, *(r[2] if len(r) > 2 else ())]) for r in rows}, key=int)
    with tempfile.TemporaryDirectory(prefix="titan_bench_") as tmp:
        for name, cfg, *row_args in tqdm(rows, desc=title or "bench", unit="config"):
            args = [*extra_args, *(row_args[0] if row_args else ())]

            def run(name=name, cfg=cfg, args=args) -> dict[str, Any]:
                return run_row(name, cfg, steps=steps, num_ranks=num_ranks, extra_args=args, workdir=Path(tmp),
                               timeout=timeout, log_dir=log_dir)
            if store is None:
                results.append(run())
                continue
            key = json.dumps([cfg, args, steps, num_ranks], sort_keys=True)
            done = store.rows.get((name, key))
            if done is not None and done.get("status") != "ok":  # a failed row is run again
                del store.rows[(name, key)]
            results.append(store.get((name, key), lambda run=run, key=key: {**run(), "row_key": key},
                                     lambda r: f"{r['name']}: {r.get('status')}"))
    (out.parent).mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    write_table(results, out, title=title or out.stem, steps=steps, num_ranks=num_ranks, columns=columns,
                command=command or " ".join(sys.argv), seeds=seeds)
    return results
