"""The optimizer step on one parameter tensor: elements/s, peak temporaries and state, per optimizer, size, dtype.

The maintained "optimizer-step" suite (``python -m launch.bench optimizer-step ARGS``). The full run, which also
rewrites ``titan_ds/step_temp.json`` (the temporaries ``titan-ds plan`` charges), from the repository root::

    flock /tmp/titan_timed.lock python launch/bench/optim_step.py --step-temp-json titan_ds/step_temp.json

A smoke run: ``python launch/bench/optim_step.py --sizes 1048576 --repeats 1 --out results/tmp/optim_step``.

For each (optimizer row, numel, parameter dtype) one 2-D parameter of ``numel`` elements (rows of 1024) with a
gradient of its dtype is stepped:

* **speed**: in this process, ``--warmup`` steps (the state exists, any ``torch.compile`` is done), then
  ``--steps`` timed steps (``--steps-large`` at 2^26 elements and above); elements/s is numel over the median,
  over ``--repeats``, of the mean step time. Each repeat runs every row of a (dtype, size) before the next
  repeat starts (rows interleaved, the order rotated each repeat), with a fresh optimizer each time.
* **temporaries**: a fresh process per case steps once (the state exists), resets the kernel's RSS high-water
  mark (``/proc/self/clear_refs``), steps again and reports (VmHWM - VmRSS before the step) / numel, with glibc's
  mmap threshold at 1 MiB (as HMS sets it).
* **state**: the bytes of the tensors in ``optimizer.state`` (a quantized torchao state counts its codes, scales
  and shared code table once) / numel.

``--threads`` intra-op threads (1 by default; torch and OpenMP). Each finished case is one line of
``OUT.jsonl`` at once; a rerun skips the cases finished with the same settings (``--redo`` runs them again, e.g.
after the optimizer's code changed). A case that fails is recorded with its error and shown as failed. ``OUT.md``
(a table per dtype) and ``OUT.png`` are rewritten from the jsonl after every case group.

``--step-temp-json PATH`` writes the temporaries of the rows plan charges (``PLAN_ROWS``), fp32 parameters, at the
largest size measured for all of them, with the command and git SHA: ``titan_ds/step_temp.json`` is the package
data ``titan_ds.plan`` reads (tests/test_measured_constants.py checks it against results/optim_step.jsonl).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

log = logging.getLogger("titan_ds.bench.optim_step")
SIZES = (1 << 20, 1 << 24, 1 << 26)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WIDTH = 1024  # the parameter is (numel / WIDTH, WIDTH): a matrix, so the profiles' weight decay applies to it
MMAP_THRESHOLD = "1048576"  # glibc's mmap threshold as titan_ds.hms sets it


def _titan_profile(name: str) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    """The optimizer section of ds_configs/NAME.json, built by titan's public builder (it follows the profile)."""
    def build(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
        section = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())["titan"]["optimizer"]
        return _titan_section(section)(model, dtype)
    return build


def _titan_section(section: dict[str, Any]) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    def build(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
        from titan_ds.config import OptimizerConfig
        from titan_ds.optim.install import build_optimizer
        return build_optimizer(model, OptimizerConfig(**section))
    return build


def _plan_mode(mode: str) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    """The optimizer section ``titan-ds plan`` writes for ``mode`` (so the row is the optimizer it charges)."""
    def build(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
        from titan_ds.plan import candidate_config
        return _titan_section(candidate_config(mode)["titan"]["optimizer"])(model, dtype)
    return build


def _torch_adamw(**kw: Any) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    return lambda model, dtype: torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                                  weight_decay=0.1, **kw)


def _torchao(cls: str, **kw: Any) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    def build(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
        import torchao.optim
        return getattr(torchao.optim, cls)(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    return build


def _ds_cpu_adam(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
    # DeepSpeed 0.19.8 takes bf16 parameters too: fp32 exp_avg/exp_avg_sq by default (fp32_optimizer_states=True),
    # the update computed in fp32 and written back to the bf16 parameter by its C++ op
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _eager(build: Callable[[torch.nn.Module, str], torch.optim.Optimizer]
           ) -> Callable[[torch.nn.Module, str], torch.optim.Optimizer]:
    """``build``'s optimizer stepping on the core's eager loop (the C++ CPU kernel off during its steps)."""
    def eager(model: torch.nn.Module, dtype: str) -> torch.optim.Optimizer:
        from titan_ds.optim import core_cpu
        opt = build(model, dtype)
        step = opt.step

        def eager_step(*a: Any, **k: Any) -> Any:
            saved, core_cpu.ENABLED = core_cpu.ENABLED, False
            try:
                return step(*a, **k)
            finally:
                core_cpu.ENABLED = saved
        opt.step = eager_step
        return opt
    return eager


@dataclass(frozen=True)
class Row:
    build: Callable[[torch.nn.Module, str], torch.optim.Optimizer]
    what: str
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    peer: Optional[dict[str, str]] = None  # dtype -> the torchao row of (about) the same state bytes


ROWS: dict[str, Row] = {
    "titan_balanced": Row(_titan_profile("titan_balanced"), "ds_configs/titan_balanced.json's ASDT (adaptive, "
                          "8-bit momentum, 4-bit coordinate second moment)",
                          peer={"fp32": "torchao_adamw8bit", "bf16": "torchao_adamw8bit"}),
    "titan_memory": Row(_titan_profile("titan_memory"), "ds_configs/titan_memory.json's ASDT (adaptive, 4-bit "
                        "momentum and second moment, stochastic rounding of bf16 weights)",
                        peer={"fp32": "torchao_adamw4bit", "bf16": "torchao_adamw4bit_sr"}),
    "titan_balanced_eager": Row(_eager(_titan_profile("titan_balanced")), "titan_balanced on the core's eager loop "
                                "(TITAN_CORE_CPU=0: no C++ kernel)",
                                peer={"fp32": "torchao_adamw8bit", "bf16": "torchao_adamw8bit"}),
    "titan_memory_eager": Row(_eager(_titan_profile("titan_memory")), "titan_memory on the core's eager loop "
                              "(TITAN_CORE_CPU=0: no C++ kernel)",
                              peer={"fp32": "torchao_adamw4bit", "bf16": "torchao_adamw4bit_sr"}),
    "asdt_sign_bf16": Row(_titan_section({"name": "asdt", "lr": 1e-5, "density": 1.0, "state_dtype": "bf16"}),
                          "ASDT sign update, density 1, bf16 momentum"),
    "asdt_sign_bf16_d0.1": Row(_plan_mode("hms_asdt"), "ASDT sign update, density 0.1, bf16 momentum (plan's "
                               "hms_asdt section)"),
    "asdt_sign_8bit": Row(_plan_mode("hms_asdt_bf16"), "ASDT sign update, density 1, 8-bit momentum (plan's "
                          "hms_asdt_bf16 section)"),
    "asdt_sign_8bit_d0.1": Row(_titan_section({"name": "asdt", "lr": 1e-5, "density": 0.1, "state_dtype": "8bit"}),
                               "ASDT sign update, density 0.1, 8-bit momentum (the sparse strategy)"),
    "asdt_adaptive_8bit_d0.1": Row(_titan_section({
        "name": "asdt", "update": "adaptive", "granularity": "tensor", "lr": 1e-3, "betas": [0.9, 0.95],
        "density": 0.1, "weight_decay": 0.1, "state_dtype": "8bit", "second_moment": "coordinate",
        "second_dtype": "4bit"}), "titan_balanced's ASDT (adaptive, 8-bit momentum, 4-bit coordinate second "
        "moment) at density 0.1 (the sparse strategy)"),
    "adamw": Row(_torch_adamw(), "torch AdamW, default implementation (on CPU: the per-tensor loop)"),
    "adamw_foreach": Row(_torch_adamw(foreach=True), "torch AdamW foreach=True"),
    "adamw_fused": Row(_torch_adamw(fused=True), "torch AdamW fused=True"),
    "torchao_adamw8bit": Row(_torchao("AdamW8bit"), "torchao AdamW8bit (torch.compile on CPU)"),
    "torchao_adamw4bit": Row(_torchao("AdamW4bit"), "torchao AdamW4bit (torch.compile on CPU)"),
    "torchao_adamw4bit_sr": Row(_torchao("AdamW4bit", bf16_stochastic_round=True), "torchao AdamW4bit, "
                                "bf16_stochastic_round=True", dtypes=("bf16",)),
    "ds_cpu_adam": Row(_ds_cpu_adam, "DeepSpeedCPUAdam (DeepSpeed's C++ cpu_adam op)"),
}
# titan_ds.plan.STEP_TEMP_BYTES key -> the row whose temporaries it charges (plan.MODE_OPTIMIZER maps modes to keys)
PLAN_ROWS = {"adamw": "adamw", "asdt_bf16": "asdt_sign_bf16_d0.1", "asdt_8bit": "asdt_sign_8bit",
             "titan_balanced": "titan_balanced", "titan_memory": "titan_memory"}


def label(numel: int) -> str:
    return f"2^{numel.bit_length() - 1}" if numel & (numel - 1) == 0 else str(numel)


def _model(numel: int, dtype: str) -> torch.nn.Module:
    if numel % WIDTH:
        raise SystemExit(f"--sizes: {numel} is not a multiple of {WIDTH} (the parameter is numel/{WIDTH} x {WIDTH})")
    m = torch.nn.Module()
    m.w = torch.nn.Parameter((torch.randn(numel // WIDTH, WIDTH) * 0.02).to(DTYPES[dtype]))
    m.w.grad = (torch.randn(numel // WIDTH, WIDTH) * 1e-3).to(DTYPES[dtype])
    return m


def _tensor_bytes(t: torch.Tensor, seen: set[int]) -> int:
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's states)
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen:
        return 0
    seen.add(ptr)
    return t.untyped_storage().nbytes()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors the optimizer's state holds (each storage once)."""
    seen: set[int] = set()

    def walk(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            return _tensor_bytes(v, seen)
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        return 0
    return walk(list(opt.state.values()))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def measure_temp(row: str, dtype: str, numel: int) -> dict[str, Any]:
    """In this (fresh) process: the peak RSS above the resident state during one step, per element."""
    m = _model(numel, dtype)
    opt = ROWS[row].build(m, dtype)
    opt.step()
    m.w.grad = (torch.randn(m.w.shape) * 1e-3).to(m.w.dtype)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    before = _status("VmHWM")  # read after the reset: an RSS read before it could be above it (pages freed between)
    opt.step()
    return {"temp_bytes_per_element": (_status("VmHWM") - before) / numel,
            "state_bytes_per_element": state_bytes(opt) / numel}


def time_steps(row: str, dtype: str, numel: int, warmup: int, steps: int) -> tuple[float, float]:
    """Mean seconds of one of ``steps`` timed steps after ``warmup`` steps, and state bytes per element."""
    m = _model(numel, dtype)
    opt = ROWS[row].build(m, dtype)
    for _ in range(warmup):
        opt.step()
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    seconds = (time.perf_counter() - t) / steps
    sb = state_bytes(opt) / numel
    del opt, m
    gc.collect()
    return seconds, sb


# ---------------------------------------------------------------------------------------------------------- records
def _git_sha() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for mod in ("torchao", "deepspeed"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a version that cannot be read is reported, not fatal
            out[mod] = f"not importable ({type(e).__name__})"
    return out


def case_key(r: dict[str, Any]) -> tuple:
    """A case and the settings its figure depends on."""
    base = (r["kind"], r["row"], r["dtype"], r["numel"], r["threads"])
    return base + ((r["repeats"], r["steps"], r["warmup"]) if r["kind"] == "speed" else ())


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(path: Path, rec: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def drop(path: Path, keys: set[tuple]) -> None:
    """``--redo``: remove the records of these cases before running them again."""
    kept = [r for r in load(path) if case_key(r) not in keys]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


# ------------------------------------------------------------------------------------------------------------- runs
def run_temp_case(row: str, dtype: str, numel: int, threads: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = subprocess.run([sys.executable, __file__, "--child", row, dtype, str(numel), str(threads)], env=env,
                       capture_output=True, text=True)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode != 0 or not last.startswith("{"):
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "failed", "error": f"exit {p.returncode}: {tail[:300]}"}
    return {"status": "ok", **json.loads(last)}


def child(row: str, dtype: str, numel: str, threads: str) -> None:
    torch.set_num_threads(int(threads))
    _quiet()
    print(json.dumps(measure_temp(row, dtype, int(numel))))


def _quiet() -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch._dynamo.config as dc
    dc.recompile_limit = 64  # torchao compiles its step per shape and dtype (dynamic=False); the default 8 falls back


def steps_for(numel: int, a: argparse.Namespace) -> int:
    return a.steps_large if numel >= 1 << 26 else a.steps


def run(a: argparse.Namespace, command: str) -> list[dict[str, Any]]:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jl = out.with_suffix(".jsonl")
    common = {"threads": a.threads, "git_sha": _git_sha(), "command": command, **versions()}
    cases = [(row, dt, n) for dt in a.dtypes for n in a.sizes for row in a.rows if dt in ROWS[row].dtypes]
    kinds = ["temp", "speed"] if a.what == "all" else [a.what]
    planned = {k: [dict(kind=k, row=r, dtype=dt, numel=n, threads=a.threads, repeats=a.repeats,
                        steps=steps_for(n, a), warmup=a.warmup) for r, dt, n in cases] for k in kinds}
    if a.redo:
        drop(jl, {case_key(c) for cs in planned.values() for c in cs})
    done = {case_key(r) for r in load(jl)}
    for kind in kinds:
        todo = [c for c in planned[kind] if case_key(c) not in done]
        for c in planned[kind]:
            if case_key(c) in done:
                log.info("skip %s %s %s %s: finished (%s)", kind, c["row"], c["dtype"], label(c["numel"]), jl)
        if kind == "temp":
            for c in todo:
                log.info("temporaries %s %s %s (a fresh process)", c["row"], c["dtype"], label(c["numel"]))
                rec = {**{k: c[k] for k in ("kind", "row", "dtype", "numel")}, **common,
                       "date": _now(), **run_temp_case(c["row"], c["dtype"], c["numel"], a.threads)}
                append(jl, rec)
                write_outputs(out, a)
        else:
            for dt in a.dtypes:
                for n in a.sizes:
                    group = [c for c in todo if c["dtype"] == dt and c["numel"] == n]
                    if group:
                        for rec in _speed_group(group, a.repeats, common):
                            append(jl, rec)
                        write_outputs(out, a)
    if a.step_temp_json:
        write_step_temp(Path(a.step_temp_json), load(jl), a.threads, command)
    return load(jl)


def _speed_group(group: list[dict[str, Any]], repeats: int, common: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of one (dtype, size): repeat r runs each case once, the order rotated by r."""
    secs: dict[int, list[float]] = {i: [] for i in range(len(group))}
    state: dict[int, float] = {}
    errors: dict[int, str] = {}
    for r in range(repeats):
        order = list(range(len(group)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            c = group[i]
            if i in errors:
                continue
            try:
                s, sb = time_steps(c["row"], c["dtype"], c["numel"], c["warmup"], c["steps"])
            except Exception as e:  # noqa: BLE001 - the row records why it has no figure
                errors[i] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.warning("%s %s %s failed: %s", c["row"], c["dtype"], label(c["numel"]), errors[i])
                continue
            secs[i].append(s)
            state[i] = sb
            log.info("repeat %d/%d %s %s %s: %.4f s/step, %.1f M elements/s", r + 1, repeats, c["row"],
                     c["dtype"], label(c["numel"]), s, c["numel"] / s / 1e6)
    out = []
    for i, c in enumerate(group):
        rec = {**c, **common, "date": _now()}
        if i in errors:
            rec.update(status="failed", error=errors[i])
        else:
            med = statistics.median(secs[i])
            rec.update(status="ok", seconds=secs[i], seconds_median=med, elements_per_s=c["numel"] / med,
                       state_bytes_per_element=state[i])
        out.append(rec)
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ----------------------------------------------------------------------------------------------------------- output
def write_step_temp(path: Path, records: list[dict[str, Any]], threads: int, command: str) -> dict[str, Any]:
    """The temporaries of PLAN_ROWS (fp32) at the largest size measured for all of them -> ``path``."""
    ok = {(r["row"], r["numel"]): r for r in records if r["kind"] == "temp" and r["dtype"] == "fp32"
          and r["threads"] == threads and r.get("status") == "ok"}
    sizes = [n for n in sorted({n for _, n in ok}, reverse=True) if all((row, n) in ok for row in PLAN_ROWS.values())]
    if not sizes:
        raise SystemExit(f"--step-temp-json: no size has fp32 temporaries of every row plan charges "
                         f"({', '.join(PLAN_ROWS.values())}) with {threads} thread(s); run "
                         f"--what temp --dtypes fp32 --rows {','.join(PLAN_ROWS.values())}")
    n = sizes[0]
    data = {"what": "bytes per element above the resident state during one optimizer step (VmHWM), fp32 "
                    "parameter; titan_ds.plan.STEP_TEMP_BYTES", "numel": n, "dtype": "fp32", "threads": threads,
            "bytes_per_element": {k: ok[(row, n)]["temp_bytes_per_element"] for k, row in PLAN_ROWS.items()},
            "rows": dict(PLAN_ROWS), "source": "results/optim_step.jsonl (kind temp)",
            "command": ok[(PLAN_ROWS['adamw'], n)]["command"], "git_sha": ok[(PLAN_ROWS['adamw'], n)]["git_sha"],
            "written_by": command}
    path.write_text(json.dumps(data, indent=1) + "\n")
    log.info("wrote %s", path)
    return data


def _latest(records: list[dict[str, Any]], threads: int) -> dict[tuple, dict[str, Any]]:
    """(kind, row, dtype, numel) -> its last record with ``threads``."""
    out = {}
    for r in records:
        if r["threads"] == threads:
            out[(r["kind"], r["row"], r["dtype"], r["numel"])] = r
    return out


def tables(records: list[dict[str, Any]], threads: int) -> dict[str, list[dict[str, str]]]:
    """dtype -> rows of its table (strings), from the records."""
    last = _latest(records, threads)
    sizes = sorted({k[3] for k in last})
    out: dict[str, list[dict[str, str]]] = {}
    for dt in DTYPES:
        rows = []
        for name, row in ROWS.items():
            if not any(k[1] == name and k[2] == dt for k in last):
                continue
            t = {"optimizer": name, "dtype": dt}
            for n in sizes:
                sp, tp = last.get(("speed", name, dt, n)), last.get(("temp", name, dt, n))
                peer = last.get(("speed", row.peer[dt], dt, n)) if row.peer else None
                L = label(n)
                t[f"M/s {L}"] = _fmt(sp, lambda r: f"{r['elements_per_s'] / 1e6:.1f}")
                t[f"x torchao {L}"] = (f"{sp['elements_per_s'] / peer['elements_per_s']:.2f}"
                                       if sp and peer and sp["status"] == peer["status"] == "ok" else "-")
                ds = last.get(("speed", "ds_cpu_adam", dt, n))
                t[f"x DS {L}"] = (f"{sp['elements_per_s'] / ds['elements_per_s']:.2f}"
                                  if sp and ds and sp["status"] == ds["status"] == "ok" else "-")
                t[f"temp B/el {L}"] = _fmt(tp, lambda r: f"{r['temp_bytes_per_element']:.2f}")
                state = next((r for r in (sp, tp) if r and r["status"] == "ok"), None)
                t[f"state B/el {L}"] = f"{state['state_bytes_per_element']:.3f}" if state else "-"
            rows.append(t)
        if rows:
            out[dt] = rows
    return out


def _fmt(r: Optional[dict[str, Any]], f: Callable[[dict[str, Any]], str]) -> str:
    if r is None:
        return "-"
    return f(r) if r["status"] == "ok" else "failed"


def write_outputs(out: Path, a: argparse.Namespace) -> None:
    records = load(out.with_suffix(".jsonl"))
    tabs = tables(records, a.threads)
    mine = [r for r in records if r["threads"] == a.threads]
    lines = ["### Optimizer step on one parameter tensor: elements/s, temporaries, state", "",
             f"Written {_now()[:10]} from {out.with_suffix('.jsonl').name}; {a.threads} intra-op thread(s); "
             + ", ".join(f"{k} {v}" for k, v in versions().items()) + ".", "",
             "Commands (with the git SHA each ran at):", ""]
    for cmd, sha in dict.fromkeys((r["command"], r["git_sha"]) for r in mine):
        lines.append(f"- Command: `{cmd}` at {sha}")
    steps = sorted({(label(r["numel"]), r["steps"], r["warmup"], r["repeats"]) for r in mine if r["kind"] == "speed"})
    lines += ["", "Speed: M/s = million elements per second of `opt.step()` (after the warm-up steps), the median "
              "over repeats of the mean step time; " + ("; ".join(f"{s}: {st} timed steps after {w} warm-up, "
                                                          f"{rep} repeat(s)" for s, st, w, rep in steps) or
                                                "not measured") + ".",
              "x DS: elements/s over DeepSpeedCPUAdam's (same size and dtype). "
              "x torchao: elements/s over that of the torchao optimizer of about the same state bytes (titan_memory: "
              "AdamW4bit, with bf16_stochastic_round for bf16; titan_balanced: AdamW8bit, which holds more state: "
              "compare the state columns). temp B/el: peak RSS above the resident state during one step, per "
              "element (a fresh process per case, glibc mmap threshold 1 MiB). state B/el: bytes of the "
              "optimizer's state tensors per element.", ""]
    for dt, rows in tabs.items():
        lines += [f"#### {dt} parameters", "", "| " + " | ".join(rows[0]) + " |",
                  "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
        lines.append("")
    failed = [r for r in mine if r.get("status") == "failed"]
    if failed:
        lines += ["Failed cases:", ""]
        lines += [f"- {r['kind']} {r['row']} {r['dtype']} {label(r['numel'])}: {r['error']}" for r in failed]
        lines.append("")
    lines += ["Rows:", ""] + [f"- {k}: {v.what}" for k, v in ROWS.items() if any(r["row"] == k for r in mine)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(out.with_suffix(".png"), mine)


def plot(path: Path, records: list[dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    speed = [r for r in records if r["kind"] == "speed" and r.get("status") == "ok"]
    dts = [dt for dt in DTYPES if any(r["dtype"] == dt for r in speed)] or ["fp32"]
    fig, axes = plt.subplots(1, len(dts), figsize=(6.5 * len(dts), 4.5), squeeze=False)
    for ax, dt in zip(axes[0], dts):
        for name in ROWS:
            pts = sorted((r["numel"], r["elements_per_s"] / 1e6) for r in speed
                         if r["row"] == name and r["dtype"] == dt)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements in the parameter")
        ax.set_ylabel("million elements / s (one opt.step)")
        ax.set_title(f"{dt} parameters")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(kind: Callable[[str], Any], choices: Optional[Any] = None) -> Callable[[str], list]:
    def parse(s: str) -> list:
        vals = [kind(x) for x in s.split(",") if x]
        bad = [v for v in vals if choices is not None and v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{bad or s!r}: choose from {', '.join(map(str, choices))}"
                                             if choices is not None else f"{s!r}: give a comma-separated list")
        return vals
    return parse


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=_csv(int), default=list(SIZES), help="elements per parameter, comma-separated")
    p.add_argument("--dtypes", type=_csv(str, DTYPES), default=list(DTYPES))
    p.add_argument("--rows", type=_csv(str, ROWS), default=list(ROWS))
    p.add_argument("--what", choices=("all", "speed", "temp"), default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat below 2^26 elements")
    p.add_argument("--steps-large", type=int, default=5, help="timed steps per repeat at 2^26 elements and above")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (torch and OpenMP)")
    p.add_argument("--out", default=str(ROOT / "results" / "optim_step"), help="writes OUT.md, OUT.jsonl, OUT.png")
    p.add_argument("--redo", action="store_true", help="run the selected cases again even if finished")
    p.add_argument("--step-temp-json", default=None, help="also write plan's temporaries here "
                   "(titan_ds/step_temp.json)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k in ("repeats", "steps", "steps_large", "warmup", "threads"):  # warm-up: the first step makes the state
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} {getattr(a, k)}: must be at least 1")
    return a


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.child:
        child(*a.child)
        return []
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    torch.set_num_threads(a.threads)
    _quiet()
    command = "python launch/bench/optim_step.py " + " ".join(shlex.quote(x) for x in argv)
    return run(a, command.strip())


if __name__ == "__main__":
    main()
