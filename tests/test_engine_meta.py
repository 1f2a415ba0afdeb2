"""A whole training step of the shipped configs with the model on ``meta``, and no host read after the first.

On a GPU a read of a device value on the host (``.item()``, ``bool(t)``, ``int(t)``, a blocking host-to-device
copy) waits for every kernel queued before it, so a step with one cannot run ahead of the device. Here the engine
of each config is built by ``titan_ds.initialize`` (DeepSpeed's ``initialize`` with the titan section: MLME's
tiled or SDPA attention, StripeFFN, chunked loss and block recompute; ASDT, with BSPS where the config has it;
ZeRO-0, and ZeRO-2 for ``asdt_zero2``; torch AdamW as the client optimizer where the config has no titan optimizer)
around a GPT whose parameters are on ``meta``, and steps through the Quick Start's ``trainer.step`` (forward, backward,
``engine.step`` with titan's lifecycle callbacks and non-finite guard, the per-step metrics and memory
accounting). Steps 2 and 3 run under :class:`~tests.helpers.meta.HostReads`, which lists every host read and
blocking copy by call site; the set must be exactly :data:`REMAINING` (each with its reason), so a new read fails,
and so does a removed one until it is taken off the list.

The stand-ins (every one a place where meta is not a GPU): DeepSpeed's CPU accelerator answers ``meta`` for its
device, so the engine keeps the model there and puts its own tensors there (on one rank DeepSpeed's collectives
on meta tensors go through, as observed here); stochastic rounding draws from a CPU generator (meta has none, as in
tests/optim/test_meta_device.py); and MLME's replace-time check of StripeFFN against the original MLP, a one-off
comparison of values at initialize that meta cannot make, is skipped (tests/inject/test_mlme.py runs it). Not
here: TRD's TR-SVD initialization (a decomposition of values at initialize), compression (several ranks) and HMS
(host-side by design: tests/hms/test_meta_device.py).
"""
import json
from pathlib import Path

import pytest
import torch

import titan_ds
import titan_ds.deepspeed_compat as dsc
import titan_ds.optim.asdt as asdt_mod
from tests.helpers.meta import META, HostReads, all_meta
from titan_ds.inject.mlme import StripeFFNPolicy
from titan_ds.models import GPT, GPTConfig
from titan_ds.trainer import TitanTrainer

from tests.helpers.configs import config_path  # ds_configs/, tests/configs/ or launch/experiments/configs/

SMALL = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)  # head dim 16: tiled attention's least

# Host reads left in a step, by call site, with why they are there. The test asserts the set seen is exactly this.
# (DeepSpeed's fp32 ZeRO-0 clipping, deepspeed/runtime/utils.py:clip_grad_norm_, made two blocking copies a step;
# titan_ds.engine.clip_fp32_grads replaces it, bit for bit: see the test at the end.)
_GUARD = ("titan_ds/engine.py:step",
          "the ZeRO-0 non-finite guard decides on the host whether the client optimizer steps at all (one flag "
          "read); skipping on the device needs the optimizer to take the flag, as fused AdamW's found_inf")
_BSPS = ("titan_ds/optim/bsps.py:add_signals",
         "BSPS decides its blocks' transitions on the host once per engine step, from the gradient signals summed "
         "on the device (one float64 per block copied back)")
_DS_ZERO12 = {"deepspeed/runtime/utils.py:is_invalid_grad_norm":
              "DeepSpeed ZeRO-1/2 reads whether the global gradient norm is finite on the host every step",
              "deepspeed/runtime/utils.py:mask_nan_or_inf_with_val_inplace":
              "DeepSpeed ZeRO-1/2 makes its -1 sentinel with torch.tensor(-1.0, device=) every step"}
REMAINING = {
    "titan_balanced.json": dict([_GUARD]),
    "titan_memory.json": dict([_GUARD]),
    # step in backward: ASDT clips on the device (the engine's clipping is 0) and no gradient is left to check
    "hf_asdt_8bit.json": {},
    "asdt_bsps.json": dict([_GUARD, _BSPS]),
    "asdt_zero2.json": {**_DS_ZERO12, _BSPS[0]: _BSPS[1]},
    "mlme.json": dict([_GUARD]),  # MLME alone, the client optimizer torch AdamW (single-tensor: its step counts
                                  # are host tensors)
}


@pytest.fixture
def meta_accelerator(monkeypatch, dist_env):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed()  # (gloo, on the CPU) before the accelerator names meta as its device
    acc = get_accelerator()
    # an earlier zero.Init in this process leaves F.linear as ZeRO-3's memory-efficient wrapper ("This will persist
    # unless manually reset", DeepSpeed's own log line), which asks autocast for meta's dtype and fails: the plain
    # linear of a process that never entered zero.Init
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    monkeypatch.setattr(acc, "device_name", lambda device_index=None: "meta")
    monkeypatch.setattr(acc, "current_device_name", lambda: "meta")
    monkeypatch.setattr(acc, "device", lambda device_index=None: META)
    real = asdt_mod._device_generator
    monkeypatch.setattr(asdt_mod, "_device_generator",
                        lambda device, seed: torch.Generator().manual_seed(seed)
                        if torch.device(device).type == "meta" else real(device, seed))
    monkeypatch.setattr(StripeFFNPolicy, "_verify", staticmethod(lambda *a: None))


def _ds_config(name):
    ds = json.loads(config_path(name).read_text())
    # the HF Trainer fills "auto" (micro-batch, clipping: TrainingArguments' max_grad_norm 1.0)
    fill = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    for k, v in list(ds.items()):
        if v == "auto":
            if k in fill:
                ds[k] = fill[k]
            else:
                del ds[k]
    ds["train_micro_batch_size_per_gpu"] = 2
    return ds


def _batch():
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size), device=META)
    return {"input_ids": x, "labels": torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size), device=META)}


def _loss(engine, b):
    return engine(b["input_ids"], b["labels"])


@pytest.mark.parametrize("name", sorted(REMAINING))
def test_shipped_config_steps_on_meta_without_host_reads(name, meta_accelerator):
    with torch.device(META):
        model = GPT(SMALL)
    ds = _ds_config(name)
    gas = ds["gradient_accumulation_steps"]  # trainer.step is one micro-batch; the optimizer steps every gas
    client = None if "optimizer" in ds["titan"] else torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, opt, _, _ = titan_ds.initialize(model=model, optimizer=client, config=ds)
    trainer = TitanTrainer(engine, opt)
    assert engine.device == META and all_meta(list(engine.module.parameters()))
    with HostReads():  # the first step builds the optimizer state (it may copy small tables once); its reads
        for _ in range(gas):  # are answered (meta has no values), not checked
            trainer.step(_batch(), _loss)
    reads = HostReads()
    with reads:
        for _ in range(2 * gas):
            loss, m = trainer.step(_batch(), _loss)
    assert reads.where() == set(REMAINING[name]), reads.sites
    assert loss.device == META and m.loss is loss and engine.global_steps == 3
    inner = dsc.engine_basic_optimizer(engine)
    state = [{k: v for k, v in st.items() if k != "step"} for st in inner.state.values()]  # AdamW's: host scalars
    assert state and all_meta(list(engine.module.parameters()), state)
    if client is None:
        assert isinstance(m.extra["asdt_changed_elements"], torch.Tensor)  # read when logged, not in the step
        assert m.extra["asdt_changed_elements"].device == META


# clipping on (every gradient scaled); on with a norm small enough that the 1e-6 in max_norm / (norm + 1e-6) shows;
# off (coefficient 1)
@pytest.mark.parametrize("max_norm, scale", [(0.05, 1.0), (1e-4, 1e-5), (1e6, 1.0)])
def test_device_clip_is_deepspeeds_clip_bit_for_bit(max_norm, scale, dist_env):
    """titan's ZeRO-0 clipping (no host-to-device copy) against DeepSpeed's ``clip_grad_norm_``: the same norm and
    the same gradients, bit for bit, on odd and non-contiguous shapes."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_
    deepspeed.init_distributed()
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 13), (5,), (3, 4, 5), (1,)]
    grads = [torch.randn(s, generator=g) * 10 ** i * scale for i, s in enumerate(shapes)]
    grads.append(torch.randn(9, 6, generator=g).t())  # non-contiguous
    ps, qs = [], []
    for gr in grads:
        for out in (ps, qs):
            p = torch.nn.Parameter(torch.zeros(gr.shape))
            p.grad = gr.clone()
            out.append(p)
    ps.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: skipped by both
    qs.append(torch.nn.Parameter(torch.zeros(3)))
    want = clip_grad_norm_(ps, max_norm)
    got = titan_ds.engine.clip_fp32_grads(qs, max_norm)
    assert torch.equal(got, want)
    for p, q, gr in zip(ps, qs, grads):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(q.grad, gr) == (max_norm > 1e3)  # a test that can tell clipping from none
