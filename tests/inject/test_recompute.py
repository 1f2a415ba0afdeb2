"""titan.mlme.recompute_blocks: same loss and gradients, same state-dict names, far fewer saved bytes."""
import copy

import pytest
import torch

from titan_ds.config import MLMEConfig
from titan_ds.inject.mlme import apply_mlme
from titan_ds.kernels.saved import SavedTensorMeter
from titan_ds.models import GPT, GPTConfig

CFG = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=64)


def _loss_grads(model, x):
    model.zero_grad()
    loss = model(x, x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("others", [False, True])
def test_recompute_parity_names_and_memory(others):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cfg = MLMEConfig(recompute_blocks=True) if others else \
        MLMEConfig(attention="off", stripe_ffn=None, chunked_loss=False, recompute_blocks=True)
    report = apply_mlme(model, cfg)
    assert sum(1 for e in report.entries if e.policy == "mlme.recompute_blocks") == CFG.n_layer
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randint(0, 256, (2, CFG.block_size))
    l0, g0 = _loss_grads(ref, x)
    l1, g1 = _loss_grads(model, x)
    assert torch.allclose(l0, l1, atol=1e-5, rtol=0)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=3e-5, rtol=1e-4), n
    meters = []
    for m in (ref, model):
        with SavedTensorMeter() as meter:
            m(x, x)
        meters.append(meter)
    eager, rec = (mt.bytes for mt in meters)
    assert rec < eager / 4, (rec, eager)
    from titan_ds.inject.policy import apply_policies
    from titan_ds.inject.recompute import BlockRecomputePolicy
    assert apply_policies(model, [BlockRecomputePolicy()]).entries == []  # idempotent
