"""Fine-tune a Hugging Face causal LM with the HF ``Trainer``, DeepSpeed and titan (``titan_ds.install()``).

    deepspeed --num_gpus 1 examples/hf_trainer.py --deepspeed ds_configs/hf_asdt_8bit.json --model tiny-llama --steps 20
    deepspeed --num_gpus 1 examples/hf_trainer.py --deepspeed ds_configs/hf_asdt_8bit.json --model /path/to/hf/folder
    python examples/hf_trainer.py --deepspeed ds_configs/hf_plain.json --model tiny-gpt2   # one process, no launcher

Shipped profiles: ``hf_plain.json`` (no titan section: plain DeepSpeed with the Trainer's AdamW),
``hf_exact.json`` (MLME only: SDPA attention, StripeFFN, block recompute, chunked loss; the loss is the model's
own), ``hf_asdt.json`` (+ titan's ASDT optimizer in place of the Trainer's AdamW), ``hf_trd.json`` (+ tensor-ring
linears initialised from the dense weights by TR-SVD). Their ``"auto"`` values are filled by HF from the arguments.

Runs without network. ``--model tiny-llama`` / ``tiny-gpt2`` builds a small random model in code with a byte-level
vocabulary (256 tokens, no tokenizer files); any other value is a local HF folder, loaded with its own tokenizer.

Data: the docstrings of the installed ``transformers`` package, outside ``transformers/models`` (the library's
own documentation: Trainer, generation, tokenizers, pipelines...), deduplicated. It is English technical prose,
not the project's own training data (CPython's standard-library sources, ``titan_ds.data``); it ships with the
example's own dependency, so it is there offline, under the Apache-2.0 license, and the same for a given
transformers version. Every tenth module (sorted by path) is held out for evaluation. The extracted text is
cached under ``$TITAN_CACHE/hf_corpus`` (default ``./.cache``).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import titan_ds  # noqa: E402
from titan_ds.utils import ensure_dist_env  # noqa: E402

__all__ = ["TINY_MODELS", "parse_args", "corpus_texts", "build_model", "token_blocks", "eval_loss", "main"]

log = logging.getLogger("hf_trainer")

TINY_MODELS = ("tiny-llama", "tiny-gpt2")
BYTE_VOCAB = 256
EVAL_EVERY = 10  # every tenth module of the corpus is held out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", required=True, help="ds_config json (ds_configs/hf_*.json)")
    p.add_argument("--model", default="tiny-llama", help=f"{' or '.join(TINY_MODELS)}, or a local HF folder")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's max_grad_norm (HF's default)")
    p.add_argument("--eval-blocks", type=int, default=32, help="held-out sequences for the eval loss")
    p.add_argument("--optim", default="adamw_torch",
                   help="the Trainer's optimizer when the ds_config has no titan optimizer (TrainingArguments.optim: "
                        "adamw_torch, or torchao's adamw_torch_8bit / adamw_torch_4bit)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the Trainer's gradient_checkpointing (HF's own recompute of each decoder layer in backward)")
    p.add_argument("--output-dir", default=None, help="Trainer output (default: $TITAN_CACHE/hf_trainer_out)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def _cache() -> Path:
    return Path(os.environ.get("TITAN_CACHE", Path.cwd() / ".cache"))


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node))]


def corpus_texts() -> tuple[list[str], list[str]]:
    """(train, eval) docstrings of transformers outside ``transformers/models``; exact duplicates dropped (the
    first one in path order kept), every ``EVAL_EVERY``-th module held out. Cached per transformers version."""
    import transformers
    out = _cache() / "hf_corpus" / f"transformers-{transformers.__version__}-docstrings.json"
    if out.exists():
        data = json.loads(out.read_text())
        return data["train"], data["eval"]
    root = Path(transformers.__file__).parent
    files = sorted(f for f in root.rglob("*.py") if "models" not in f.relative_to(root).parts)
    seen: set[str] = set()
    split: dict[str, list[str]] = {"train": [], "eval": []}
    for i, f in enumerate(files):
        for d in _docstrings(f):
            if len(d) >= 80 and d not in seen:  # one-liners ("Returns the config.") carry little text
                seen.add(d)
                split["eval" if i % EVAL_EVERY == EVAL_EVERY - 1 else "train"].append(d)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    tmp.write_text(json.dumps(split))
    os.replace(tmp, out)  # atomic: the ranks of a launch may all build it at once
    return split["train"], split["eval"]


def corpus_digest(train: list[str], held_out: list[str]) -> str:
    return hashlib.sha256(json.dumps([train, held_out]).encode()).hexdigest()[:16]


def build_model(spec: str, seq: int) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer); the tokenizer is None for the byte-level tiny models."""
    import transformers
    if spec == "tiny-llama":
        cfg = transformers.LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=256,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=seq)
        return transformers.LlamaForCausalLM(cfg), None
    if spec == "tiny-gpt2":
        cfg = transformers.GPT2Config(vocab_size=BYTE_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=seq)
        return transformers.GPT2LMHeadModel(cfg), None
    if not Path(spec).is_dir():
        raise SystemExit(f"--model {spec!r}: neither {' nor '.join(TINY_MODELS)} nor a local folder")
    model = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(spec)


def token_blocks(texts: list[str], tokenizer: Any, seq: int) -> torch.Tensor:
    """``[n, seq]`` token ids: the texts joined (blank line, or the tokenizer's EOS, between them), cut in blocks."""
    if tokenizer is None:
        ids = torch.frombuffer(bytearray("\n\n".join(texts).encode("utf-8")), dtype=torch.uint8).long()
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = torch.tensor([t for doc in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in doc + eos])
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}  # the model shifts the labels itself


@torch.no_grad()
def eval_loss(model: torch.nn.Module, blocks: torch.Tensor, batch: int) -> float:
    """Mean next-token loss over ``blocks`` (every block has the same number of predicted tokens)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [float(model(input_ids=b.to(device), labels=b.to(device)).loss) for b in blocks.split(batch)]
    model.train(was_training)
    return sum(losses) / len(losses)


def _callbacks(eval_blocks: torch.Tensor, batch: int, result: dict) -> list:
    import transformers

    class Record(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            # after deepspeed.initialize: titan's module replacements (TRD, MLME) are in place
            result["eval_at_start"] = eval_loss(model, eval_blocks, batch)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                result["train_losses"].append(float(logs["loss"]))

    return [Record()]


def main(argv: Optional[Sequence[str]] = None, trainer_cls: Any = None, callbacks: Sequence[Any] = ()) -> dict:
    """Train; returns ``{"eval_before", "eval_at_start", "eval_after", "train_losses", "titan", "trainer", ...}``.
    ``trainer_cls`` (a ``Trainer`` subclass) and ``callbacks`` let a benchmark measure more."""
    import transformers
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ensure_dist_env()  # one process without the launcher; inside the launcher nothing changes
    titan_ds.install()  # every later deepspeed.initialize, the Trainer's included, applies the "titan" section
    transformers.set_seed(args.seed)
    model, tokenizer = build_model(args.model, args.seq)
    train_texts, eval_texts = corpus_texts()
    train, held_out = token_blocks(train_texts, tokenizer, args.seq), token_blocks(eval_texts, tokenizer, args.seq)
    held_out = held_out[: args.eval_blocks]
    result: dict[str, Any] = {"train_losses": [], "corpus": corpus_digest(train_texts, eval_texts),
                              "train_blocks": len(train), "eval_blocks": len(held_out)}
    result["eval_before"] = eval_loss(model, held_out, args.batch)
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir or str(_cache() / "hf_trainer_out"), deepspeed=args.deepspeed,
        per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=args.warmup, lr_scheduler_type="linear", weight_decay=args.weight_decay, seed=args.seed,
        max_grad_norm=args.max_grad_norm, optim=args.optim,
        gradient_checkpointing=args.gradient_checkpointing, logging_strategy="steps", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = (trainer_cls or transformers.Trainer)(
        model=model, args=targs, train_dataset=Blocks(train),
        callbacks=_callbacks(held_out, args.batch, result) + list(callbacks))
    trainer.train()
    engine = trainer.model_wrapped
    result["eval_after"] = eval_loss(trainer.model, held_out, args.batch)
    result["titan"] = sorted(engine.titan.reports) if hasattr(engine, "titan") else []
    result["trainer"] = trainer
    log.info("eval loss (%d held-out blocks of %d tokens): before %.4f, at the start of training %.4f (after "
             "titan's replacements), after %d steps %.4f; titan pillars: %s", len(held_out), args.seq,
             result["eval_before"], result["eval_at_start"], args.steps, result["eval_after"],
             ", ".join(result["titan"]) or "none (plain DeepSpeed)")
    if not all(math.isfinite(v) for v in result["train_losses"]):
        raise SystemExit(f"non-finite training loss: {result['train_losses']}")
    return result


if __name__ == "__main__":
    main()
