"""A small GPT (pre-LayerNorm, GELU MLP, learned positions): the reference workload of every benchmark.

The seed workload is ``GPTConfig(n_layer=6, n_embd=256, n_head=8, block_size=128, vocab_size=256)``.
Module names are part of the contract with the injection policies (TRD matches ``blocks.{i}.attn.qkv`` etc.,
MLME replaces ``blocks.{i}.attn.core``, ``blocks.{i}.mlp`` and ``lm_loss``); keep them stable.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "AttentionCore", "MLP", "LMLoss"]


@dataclass
class GPTConfig:
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal; q, k, v of shape (B, H, T, Dh). The eager reference materialises the
    (T, T) score matrix; MLME swaps this module for a tiled one."""

    def __init__(self, causal: bool = True):
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.core = AttentionCore(causal=True)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMLoss(nn.Module):
    """Mean next-token cross-entropy of ``head(hidden)``; eager: the whole (B, T, V) logits tensor exists."""

    def forward(self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, **overrides: Any):
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_loss = LMLoss()
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: Union[torch.Tensor, Mapping[str, torch.Tensor]], targets: torch.Tensor | None = None):
        if isinstance(idx, Mapping):
            targets = idx.get("labels", targets)
            idx = idx["input_ids"]
        h = self.hidden(idx)
        if targets is None:
            return self.head(h)
        return self.lm_loss(h, self.head, targets)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
