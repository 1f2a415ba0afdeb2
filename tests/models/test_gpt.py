import torch
import torch.nn.functional as F

from titan_ds.models import GPT, GPTConfig


def test_shapes_loss_and_dict_batch():
    m = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    x = torch.randint(0, 256, (3, 16))
    logits = m(x)
    assert logits.shape == (3, 16, 256)
    ref = F.cross_entropy(logits.reshape(-1, 256), x.reshape(-1))
    assert torch.allclose(m(x, x), ref, atol=1e-6, rtol=0)
    assert torch.allclose(m({"input_ids": x, "labels": x}), ref, atol=1e-6, rtol=0)


def test_seed_model_size_and_names():
    m = GPT()
    assert m.num_parameters() == 4_902_912  # 6 x 256, vocab 256, context 128
    names = dict(m.named_modules())
    for n in ("blocks.5.attn.qkv", "blocks.5.attn.core", "blocks.5.attn.proj", "blocks.5.mlp.fc", "blocks.5.mlp.out",
              "lm_loss", "head"):
        assert n in names


def test_causal():
    m = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=8))
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 256
    assert torch.allclose(m(x)[0, :-1], m(y)[0, :-1])
