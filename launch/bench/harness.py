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
           "seed_verdict", "shm_op_stamp", "run_capped_clean", "ROOT", "compare_store", "table", "compare_table"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: launch/bench/harness.py
_log = logging.getLogger("titan_ds.bench")
MiB = 2**20


def add_dgc_args(p: Any) -> None:
    """The ``--dgc-*`` flags of the compression benchmarks' ``dgc`` rows (topk with DGC's options)."""
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
    """A thin alias of :class:`launch.bench.store.Store` for the suites that key their results by a tuple of their
    fields (``key(result)``): the key is the row's config, there are no separate settings or seed, and the
    store's resume rule holds (a result is reused only from the same code, or with ``reuse_stale``). ``load``
    fixes up a result as it is read; ``rows``: every result recorded, by key (the last one per key)."""

    def __init__(self, path: Path, key: Callable[[dict], tuple], load: Optional[Callable[[dict], dict]] = None, *,
                 suite: Optional[str] = None, reuse_stale: bool = False):
        from launch.bench.store import Store
        self._key, self._load = key, load or (lambda r: r)

        def legacy(raw: dict) -> tuple:
            r = self._load(raw)
            return {"row": self._name(key(r)), "config": list(key(r)), "settings": {}, "seed": 0, "result": r}
        self.store = Store(path, suite or Path(path).name.split(".")[0], reuse_stale=reuse_stale, legacy=legacy)
        self.path = self.store.path
        self.rows: dict[tuple, dict] = {}
        for rec in self.store.records:
            r = self._load(rec["result"]) if rec["code_hash"] is not None else rec["result"]
            self.rows[key(r)] = r

    @staticmethod
    def _name(k: tuple) -> str:
        return "/".join(map(str, k))

    def get(self, k: tuple, run: Callable[[], dict], describe: Callable[[dict], str]) -> dict:
        """The result under ``k``: the reusable one (the store's rule), or ``run()`` recorded at once (and
        ``describe``d in the log)."""
        rec = self.store.find(self._name(k), config=list(k), settings={}, seed=0)
        if rec is None:
            rec = self.store.append(self._name(k), config=list(k), settings={}, seed=0, result=run())
            _log.info("%s", describe(rec["result"]))
        self.rows[k] = self._load(rec["result"])
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
                columns: Sequence[str] = (), command: str = "", seeds: Sequence[str] = ("0",),
                date: Optional[str] = None) -> str:
    """Write ``<out>.csv`` and ``<out>.md``; return the markdown. ``seeds``: the training seeds of the rows;
    ``date``: when they ran (default today)."""
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
            f"{torch.__version__}, deepspeed {_ds_version()}; {date or datetime.date.today().isoformat()}",
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
            command: str = "", timeout: Optional[float] = None, resume: bool = False,
            reuse_stale: bool = False) -> list[dict[str, Any]]:
    """Run every ``(name, ds_config)`` row with the same model/data/seed/tokens; write ``<out>.csv``/``.md``.

    A row may be ``(name, ds_config, row_args)``: ``row_args`` are appended to ``extra_args`` for that row only
    (e.g. ``["--lr", "3e-3"]`` to give the baseline its own learning rate). Every finished row is recorded at
    once in ``<out>.jsonl`` (:class:`launch.bench.store.Store`: config = its ds_config and arguments, settings =
    steps and ranks, seed = its ``--seed``); the table is :func:`table` of those records. ``resume``: a rerun
    reuses the records the store's rule allows (``reuse_stale``: from other code too) and runs only the others;
    a failed row is not recorded, so it always runs again."""
    from tqdm import tqdm
    out = Path(out)
    rows = list(rows)
    log_dir = out.parent / "logs" / out.stem  # one folder per table: row names repeat across tables
    log_dir.mkdir(parents=True, exist_ok=True)
    store = compare_store(out, reuse_stale=reuse_stale)
    settings = {"steps": steps, "ranks": num_ranks}
    results = []
    with tempfile.TemporaryDirectory(prefix="titan_bench_") as tmp:
        for name, cfg, *row_args in tqdm(rows, desc=title or "bench", unit="config"):
            args = [*extra_args, *(row_args[0] if row_args else ())]

            def run(name=name, cfg=cfg, args=args) -> dict[str, Any]:
                r = run_row(name, cfg, steps=steps, num_ranks=num_ranks, extra_args=args, workdir=Path(tmp),
                            timeout=timeout, log_dir=log_dir)
                _log.info("%s: %s", name, r.get("status"))
                return r
            config = {"ds_config": cfg, "args": args}
            seed = int(seed_of(args))
            if resume:
                rec = store.get(name, config=config, settings=settings, seed=seed, run=run,
                                keep=lambda r: r.get("status") == "ok")
            else:
                r = run()
                rec = store.append(name, config=config, settings=settings, seed=seed, result=r) \
                    if r.get("status") == "ok" else {"result": r}
            results.append({**rec["result"], "_store": rec})
    table(results, out, title=title or out.stem, steps=steps, num_ranks=num_ranks, columns=columns,
          command=command or " ".join(sys.argv))
    return [{k: v for k, v in r.items() if k != "_store"} for r in results]


def compare_store(out: Path, reuse_stale: bool = False):
    """The store of a :func:`compare` table ``<out>``: ``<out>.jsonl``, whose lines from before the store (keyed
    by ``row_key``: the json of ``[ds_config, args, steps, ranks]``) read as code unknown."""
    from launch.bench.store import Store

    def legacy(raw: dict) -> tuple:
        cfg, args, steps, ranks = json.loads(raw["row_key"])
        result = {k: v for k, v in raw.items() if k != "row_key"}
        return {"row": raw["name"], "config": {"ds_config": cfg, "args": args},
                "settings": {"steps": steps, "ranks": ranks}, "seed": int(seed_of(args)), "result": result}
    return Store(Path(out).with_suffix(".jsonl"), suite=Path(out).stem, reuse_stale=reuse_stale, legacy=legacy)


def table(results: list[dict[str, Any]], out: Path, *, title: str, steps: int, num_ranks: int,
          columns: Sequence[str] = (), command: str = "") -> str:
    """``<out>.json``, ``.csv`` and ``.md`` of :func:`compare`'s results (each with its store record under
    ``_store`` where it has one: rows from other code than the newest are marked (stale))."""
    from launch.bench.store import STALE_MARK, STALE_NOTE, stale_flags
    recs = [r["_store"] for r in results if "code_hash" in r.get("_store", {})]
    flags = iter(stale_flags(recs))
    shown = [{**r, "name": r["name"] + (STALE_MARK if "code_hash" in r.get("_store", {}) and next(flags) else "")}
             for r in results]
    plain = [{k: v for k, v in r.items() if k != "_store"} for r in shown]
    seeds = sorted({str(r["_store"].get("seed", 0)) for r in results if "seed" in r.get("_store", {})}, key=int) \
        or ["0"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(plain, indent=1, default=str))
    dates = [r["_store"]["date"] for r in results if r.get("_store", {}).get("date")]
    md = write_table(plain, out, title=title, steps=steps, num_ranks=num_ranks, columns=columns, command=command,
                     seeds=seeds, date=max(dates) if dates else None)
    if any(STALE_MARK in r["name"] for r in plain):
        out.with_suffix(".md").write_text(md + "\n" + STALE_NOTE + "\n")
    return md


def compare_table(out: str | os.PathLike, *, title: Optional[str] = None, command: Optional[str] = None,
                  columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Regenerate a :func:`compare` table from ``<out>.jsonl`` without running anything: the newest record of
    each row under the newest record's settings, in the order the rows were first recorded. ``title`` and
    ``command`` default to those the existing ``<out>.md`` shows (the records do not hold them)."""
    import re

    from launch.bench.store import STALE_MARK
    out = Path(out)
    store = compare_store(out)
    if not store.records:
        raise SystemExit(f"{out.with_suffix('.jsonl')}: no records; run the suite first")
    settings = store.records[-1]["settings"]
    last: dict[str, dict] = {}
    for rec in store.latest(settings=settings):
        last[rec["row"]] = rec
    old = out.with_suffix(".md").read_text() if out.with_suffix(".md").exists() else ""
    # the rows in the order the existing table lists them (the command's order; the records keep run order),
    # then any other row in the order first recorded
    order = {m.group(1).removesuffix(STALE_MARK): i for i, m in enumerate(re.finditer(r"^\| (\S+)", old, re.M))}
    for rec in store.latest(settings=settings):
        order.setdefault(rec["row"], len(order))
    results = [{**last[n]["result"], "_store": last[n]} for n in sorted(last, key=order.get)]
    t = re.match(r"### (.*)", old)
    c = re.search(r"Command: `([^`]*)`", old)
    table(results, out, title=title or (t.group(1) if t else out.stem), steps=settings["steps"],
          num_ranks=settings["ranks"], columns=columns, command=command or (c.group(1) if c else ""))
    return [{k: v for k, v in r.items() if k != "_store"} for r in results]
