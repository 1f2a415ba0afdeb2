"""titan.mlme.chunked_loss on HF causal LMs (titan_ds/inject/hf_loss.py).

The oracle is the unmodified HF model: same loss (HF's ForCausalLMLoss, -100 labels, num_items_in_batch) and the
same gradient of every parameter, to 1e-5 in fp32. Tiny random configs built in code; no network.
"""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.deps import require

transformers = require("transformers")

from titan_ds.config import MLMEConfig  # noqa: E402
from titan_ds.inject import hf_loss  # noqa: E402
from titan_ds.inject.hf_loss import CapturingHead, HFChunkedLossPolicy, remove_hf_chunked_loss  # noqa: E402
from titan_ds.inject.mlme import apply_mlme  # noqa: E402

V, B, T = 211, 2, 40  # odd vocabulary; B*T*V = 16880 is the largest tensor of the unmodified model
TOL = dict(atol=1e-5, rtol=1e-5)
LOSS_ONLY = MLMEConfig(attention="off", stripe_ffn=None, chunked_loss=True, loss_chunk=16, loss_vocab_chunk=50)


def _decoder(cls_cfg, cls_model, **kw):
    def build():
        cfg = cls_cfg(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=48, vocab_size=V, max_position_embeddings=64, **kw)
        return cls_model(cfg)
    return build


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


FAMILIES = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": _decoder(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=16),
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma": _decoder(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=16),
    "gpt2": _gpt2,
}


def _pair(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    ref = copy.deepcopy(model)
    report = apply_mlme(model, LOSS_ONLY)
    model.train(), ref.train()  # HF builds models in eval mode; the chunked path is the training path
    return model, ref, report


def _batch():
    ids = torch.randint(0, V, (B, T))
    labels = ids.clone()
    labels[0, :7] = -100   # a masked prompt
    labels[1, 30:] = -100  # right padding
    return ids, labels


def _loss_grads(model, **kw):
    model.zero_grad()
    out = model(**kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("items", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_every_gradient_equal_hf(family, items):
    model, ref, report = _pair(family)
    assert [e.policy for e in report.entries] == ["mlme.chunked_loss"] and report.entries[0].detail["family"] == family
    ids, labels = _batch()
    kw = {"input_ids": ids, "labels": labels}
    if items:  # the Trainer's count over all micro-batches of a gradient-accumulation step
        kw["num_items_in_batch"] = torch.tensor(3 * int((labels[:, 1:] != -100).sum()))
    out, grads = _loss_grads(model, **kw)
    out0, grads0 = _loss_grads(ref, **kw)
    assert out.logits is None and out0.logits.shape == (B, T, V)
    torch.testing.assert_close(out.loss, out0.loss, **TOL)
    assert out.loss.dtype == out0.loss.dtype == torch.float32
    assert grads.keys() == grads0.keys() and len(grads) == len(list(ref.parameters()))
    for n in grads0:
        torch.testing.assert_close(grads[n], grads0[n], **TOL, msg=lambda m: f"grad {n}: {m}")


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_logits_never_exist_in_training(family):
    model, ref, _ = _pair(family)
    ids, labels = _batch()
    sizes = []
    for m in (ref, model):
        with _LargestTensor() as seen:
            m(input_ids=ids, labels=labels).loss.backward()
        sizes.append(seen.largest)
    assert sizes[0] >= B * T * V  # the unmodified model builds the logits (the meter sees them)
    assert sizes[1] < B * T * V, sizes  # chunks of 16 tokens x 50 classes; everything else is smaller


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eval_and_no_labels_are_the_plain_forward(family):
    model, ref, _ = _pair(family)
    ids, labels = _batch()
    train_no_labels = model(input_ids=ids).logits
    torch.testing.assert_close(train_no_labels, ref(input_ids=ids).logits, atol=0, rtol=0)
    model.eval(), ref.eval()
    with torch.no_grad():
        out, out0 = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits.shape == (B, T, V)
    torch.testing.assert_close(out.loss, out0.loss, atol=0, rtol=0)


def test_return_dict_false_puts_the_loss_first():
    model, ref, _ = _pair("llama")
    ids, labels = _batch()
    got = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], ref(input_ids=ids, labels=labels).loss, **TOL)


def test_shift_labels_and_ignore_index_kwargs():
    model, ref, _ = _pair("llama")
    ids, labels = _batch()
    for lab, kw in ((labels, {"shift_labels": torch.roll(labels, -2, dims=1)}), (ids, {"ignore_index": int(ids[0, 3])})):
        loss = model(input_ids=ids, labels=lab, **kw).loss
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=lab, **kw).loss, **TOL)
        assert not torch.allclose(loss, model(input_ids=ids, labels=lab).loss)  # the keyword changed something


def test_report_signature_state_dict_tying_and_removal():
    import inspect
    model, ref, report = _pair("gpt2")
    e = report.entries[0]
    assert (e.name, e.old_type, e.new_type) == ("lm_head", "Linear", "CapturingHead")
    assert "GPT2LMHeadModel.forward" in e.detail["forward"]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties the head to the embedding
    assert inspect.signature(model.forward).parameters.keys() == inspect.signature(ref.forward).parameters.keys()
    assert apply_mlme(model, LOSS_ONLY).entries == []  # applied once only
    ids, labels = _batch()
    assert remove_hf_chunked_loss(model) and not remove_hf_chunked_loss(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert model(input_ids=ids, labels=labels).logits.shape == (B, T, V)


def test_deepcopy_of_a_patched_model_is_patched_on_itself():
    model, _, _ = _pair("llama")
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and twin.lm_head is not model.lm_head
    ids, labels = _batch()
    torch.testing.assert_close(twin(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)


def test_unsupported_family_names_itself_and_the_supported_ones():
    cfg = transformers.Gemma2Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    intermediate_size=48, vocab_size=V, head_dim=16)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM \(model_type 'gemma2'\).*llama \(LlamaForCausalLM\)"):
        apply_mlme(transformers.Gemma2ForCausalLM(cfg), LOSS_ONLY)

    class Custom(transformers.LlamaForCausalLM):  # its own forward: we cannot know what it does to the logits
        def forward(self, *a, **k):
            return super().forward(*a, **k)
    with pytest.raises(ValueError, match="does not support Custom"):
        HFChunkedLossPolicy(Custom(FAMILIES["llama"]().config), 16)


def test_hf_config_on_llama_works_and_errors_name_each_key_once():
    """A user's report: "mlme": {"attention": "sdpa", "chunked_loss": true} on a 5.24 Llama (already SDPA)."""
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    assert model.config._attn_implementation == "sdpa"
    report = apply_mlme(model, MLMEConfig(attention="sdpa", chunked_loss=True))
    assert {e.policy for e in report.entries} == {"mlme.stripe_ffn", "mlme.chunked_loss"}
    with pytest.raises(ValueError) as err:
        apply_mlme(torch.nn.Sequential(torch.nn.Linear(4, 4)), MLMEConfig(stripe_ffn=None, chunked_loss=False))
    assert str(err.value).count("mlme.attention") == 2  # once in "but ... matched", once in "switch off ..."
    assert "but mlme.attention matched no module" in str(err.value)


MLME_SECTION = {"mlme": {"attention": "sdpa", "stripe_ffn": None, "chunked_loss": True, "loss_chunk": 8}}


@pytest.fixture
def ce_calls(monkeypatch):
    """The keyword arguments of every call of the chunked cross-entropy by the HF chunked forward."""
    calls = []
    real = hf_loss.chunked_linear_cross_entropy
    monkeypatch.setattr(hf_loss, "chunked_linear_cross_entropy", lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


def _trainer_run(tmp_path, ds_config, installed: bool):
    import titan_ds
    from tests.test_integrations import run_trainer
    if installed:
        titan_ds.install()
    try:
        return run_trainer(tmp_path, "llama", ds_config, steps=2, gradient_accumulation_steps=2)
    finally:
        titan_ds.uninstall()


def test_trainer_with_titan_section_runs_the_chunked_loss(dist_env, tmp_path, ce_calls):
    """titan_ds.install() + TrainingArguments(deepspeed=...) with an mlme section: every micro-batch of every
    training step goes through the chunked loss, with the Trainer's num_items_in_batch (gradient accumulation)."""
    from tests.test_integrations import _ds_config
    losses, _, _, trainer, _ = _trainer_run(tmp_path, _ds_config(0, MLME_SECTION), installed=True)
    entries = trainer.model_wrapped.titan.reports["mlme"].by_policy("mlme.chunked_loss").entries
    assert [e.name for e in entries] == ["lm_head"] and isinstance(trainer.model.lm_head, CapturingHead)
    assert len(ce_calls) == 4 and all(k["reduction"] == "sum" and k["chunk"] == 8 for k in ce_calls)  # 2 steps x 2
    assert torch.isfinite(losses).all() and losses.shape == (4,)  # one per micro-batch


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])  # ZeRO-3: lm_head's weight is registered as used by the root's forward
def test_trainer_chunked_loss_trains_exactly_like_plain_deepspeed(dist_env, tmp_path, ce_calls, stage):
    from tests.test_integrations import _ds_config
    plain, plain_params, *_ = _trainer_run(tmp_path, _ds_config(stage), installed=False)
    assert ce_calls == []
    losses, params, *_ = _trainer_run(tmp_path, _ds_config(stage, MLME_SECTION), installed=True)
    assert len(ce_calls) == 4
    torch.testing.assert_close(losses, plain, **TOL)
    for p, q in zip(params, plain_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


FULL = MLMEConfig(attention="tiled", tile=16, stripe_ffn=7, chunked_loss=True, loss_chunk=16, recompute_blocks=True)


@pytest.mark.parametrize("family", list(FAMILIES) + ["mistral_window"])
def test_every_mlme_part_on_each_family_equals_hf(family):
    """Tiled attention + StripeFFN + block recompute + chunked loss together, right-padded batch."""
    torch.manual_seed(0)
    model = (_decoder(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=8)()
             if family == "mistral_window" else FAMILIES[family]())
    ref = copy.deepcopy(model)
    report = apply_mlme(model, FULL)
    assert {e.policy for e in report.entries} == {"mlme.attention", "mlme.stripe_ffn", "mlme.recompute_blocks",
                                                  "mlme.chunked_loss"}, report.table()
    model.train(), ref.train()
    ids, labels = _batch()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 30:] = 0
    out, grads = _loss_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    out0, grads0 = _loss_grads(ref, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, out0.loss, atol=3e-5, rtol=3e-5)
    assert grads.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads[n], grads0[n], atol=3e-5, rtol=3e-5, msg=lambda m: f"grad {n}: {m}")


def test_installed_transformers_is_in_the_range_the_package_declares():
    """The hf extra's range and the test extra's are the same, and the transformers these tests ran on is in it."""
    import sys
    from pathlib import Path
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")  # tomllib: Python 3.11 on

    from packaging.requirements import Requirement
    meta = toml.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    ranges = {name: [Requirement(r).specifier for r in reqs if Requirement(r).name == "transformers"]
              for name, reqs in extras.items()}
    assert ranges["hf"] and ranges["test"] == ranges["hf"], ranges
    assert ranges["hf"][0].contains(transformers.__version__), (transformers.__version__, ranges["hf"])


@pytest.mark.parametrize("items", ["none", "int", "cpu_tensor", "device_tensor"])
@pytest.mark.parametrize("shift", [False, True])
def test_hf_chunked_loss_step_on_meta(items, shift):
    """The HF chunked loss (what the patched forward computes from the captured hidden states), its parameters and
    inputs on meta: a step after the first reads nothing on the host and copies nothing from it. The Trainer's
    ``num_items_in_batch`` may be an int, a 0-d CPU tensor (divides as a scalar: no copy) or a device tensor."""
    from tests.helpers.meta import META, NoHostCopies
    head = CapturingHead(32, V, bias=False, device=META)
    hidden = torch.empty(B, T, 32, device=META, requires_grad=True)
    labels = torch.randint(0, V, (B, T), device=META)
    n = {"none": None, "int": 70, "cpu_tensor": torch.tensor(70), "device_tensor": torch.tensor(70).to(META)}[items]
    kw = {"num_items_in_batch": n, "shift_labels": labels if shift else None}

    def step():
        hf_loss._causal_lm_loss(hidden, head, labels, {"chunk": 16, "vocab_chunk": 50}, **kw).backward()

    step()
    with NoHostCopies():
        step()
    assert hidden.grad.device == head.weight.grad.device == META
