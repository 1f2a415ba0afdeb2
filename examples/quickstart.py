"""The seed's Quick Start, as written, on the reference GPT (python examples/quickstart.py)."""
import torch

from titan_ds import TITANConfig, build_titan_trainer
from titan_ds.data import Batcher, load_corpus
from titan_ds.models import GPT, GPTConfig

# 1. Define your standard PyTorch model
model = GPT(GPTConfig(n_layer=6, n_embd=256, n_head=8, block_size=128, vocab_size=256))

# 2. Configure TITAN for your hardware
config = TITANConfig(
    device="cuda",                 # falls back to the CPU with a warning on a machine without CUDA
    use_trd=True,
    trd_rank=16,
    nvme_path=None,                # "./titan_storage" switches HMS on (ZeRO-3 NVMe streaming)
)

# 3. Build the production trainer
trainer = build_titan_trainer(model, config)

# 4. Training loop
corpus = load_corpus()
batches = Batcher(corpus.train, micro_batch=8, context=128, seed=0)
dataloader = ({"input_ids": x, "labels": y} for x, y in (batches.get(i) for i in range(20)))
for batch in dataloader:
    def loss_fn(model, b):
        logits = model(b["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())

    loss, metrics = trainer.step(batch, loss_fn)
    print(f"Step {metrics.step}, Loss: {loss:.4f}, Compression: {metrics.hge_compression_ratio:.1f}x, "
          f"TRD: {metrics.trd_compression_ratio:.1f}x")
