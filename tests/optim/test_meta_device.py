"""GPU readiness of every ASDT update, without a GPU: parameters and gradients on the ``meta`` device.

Meta raises where a GPU step would break or stall (a CPU tensor next to a device one; any read of a device value
on the host), and :class:`~tests.helpers.meta.NoHostCopies` fails on host-to-device copies after the first step
(tests/helpers/meta.py). Each case runs the update kinds the shipped configs use for three steps: the first builds
the state, the second and third reuse it, in place, under the copy check. The one thing meta cannot stand for is
a random generator of its own (stochastic rounding of bf16 weights): ``asdt._device_generator`` is the seam, and
here it hands a CPU generator, which ``torch.randint(..., device="meta")`` accepts.
"""
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import titan_ds.optim.asdt as asdt_mod
from tests.helpers.meta import META, NoHostCopies, all_meta
from titan_ds.config import TitanConfig
from titan_ds.optim.asdt import ASDT, ELASTIC, FROZEN, GROWTH, SLEEPING
from titan_ds.optim.bsps import Plasticity
from titan_ds.optim.install import build_optimizer, build_plasticity
from titan_ds.optim.layout import Layout, Piece

from tests.helpers.configs import all_configs, config_path  # noqa: E402


@pytest.fixture(autouse=True)
def _meta_generator(monkeypatch):
    """Stochastic rounding draws from ``_device_generator(device)``; meta has no generator: give a CPU one."""
    real = asdt_mod._device_generator

    def gen(device, seed):
        if torch.device(device).type == "meta":
            return torch.Generator().manual_seed(seed)
        return real(device, seed)

    monkeypatch.setattr(asdt_mod, "_device_generator", gen)


def _params(dtype=torch.float32):
    """A matrix (row units), a 3-D tensor and a vector, on meta."""
    shapes = {"a.weight": (6, 40), "b.weight": (3, 4, 5), "a.bias": (6,)}
    return [(n, nn.Parameter(torch.empty(s, device=META, dtype=dtype))) for n, s in shapes.items()]


def _step(opt, params, steps=3):
    for i in range(steps):
        for _, p in params:
            p.grad = torch.empty_like(p)
        if i == 0:
            opt.step()
        else:
            with NoHostCopies():
                opt.step()
    assert all_meta([p for _, p in params], [dict(st) for st in opt.state.values()])


def _run(dtype=torch.float32, **kw):
    params = _params(dtype)
    opt = ASDT(params, lr=1e-3, block_size=64, **kw)
    _step(opt, params)
    return opt


@pytest.mark.parametrize("density", [0.3, 1.0])
@pytest.mark.parametrize("granularity", ["tensor", "block", "row"])
@pytest.mark.parametrize("update", ["sign", "adaptive"])
def test_update_on_meta(update, granularity, density):
    opt = _run(update=update, granularity=granularity, density=density)
    assert opt.state and all(st["step"] == 3 for st in opt.state.values())


@pytest.mark.parametrize("granularity, density", [("row", 0.3), ("tensor", 1.0)])
@pytest.mark.parametrize("state_dtype", ["bf16", "8bit", "4bit"])
@pytest.mark.parametrize("update", ["sign", "adaptive"])
def test_state_dtype_on_meta(update, state_dtype, granularity, density):
    opt = _run(update=update, state_dtype=state_dtype, granularity=granularity, density=density)
    if state_dtype in ("8bit", "4bit"):  # stored packed between steps, codes and block scales on the device
        assert all(st["momentum"].dtype == torch.uint8 and st["momentum_absmax"].device == META
                   for st in opt.state.values())


@pytest.mark.parametrize("density", [0.3, 1.0])
@pytest.mark.parametrize("update", ["sign", "adaptive"])
@pytest.mark.parametrize("importance", ["grad_weight", "sketch"])
def test_importance_on_meta(importance, update, density):
    opt = _run(update=update, importance=importance, density=density, sketch_width=64)
    if importance == "sketch":
        assert opt.sketch.table.device == META  # moved to the gradients' device, not kept on the CPU


@pytest.mark.parametrize("second_dtype, state_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("8bit", "4bit"),
                                                       ("4bit", "8bit")])
def test_coordinate_second_moment_on_meta(second_dtype, state_dtype):
    _run(update="adaptive", second_moment="coordinate", second_dtype=second_dtype, state_dtype=state_dtype,
         granularity="row", density=0.3, update_clip=1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("update", ["sign", "adaptive"])
def test_bf16_weights_on_meta(update, rounding):
    opt = _run(dtype=torch.bfloat16, update=update, rounding=rounding, density=0.5, state_dtype="4bit")
    assert bool(opt._generators) == (rounding == "stochastic")


def _model(dtype=torch.float32):
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8)).to(device=META, dtype=dtype)


def _loss(model):
    x = torch.randint(0, 16, (2, 5), device=META)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_step_in_backward_on_meta(max_norm):
    """Each parameter updated in its gradient hook; with clipping, the coefficient stays a device tensor."""
    model = _model()
    opt = ASDT(list(model.named_parameters()), update="adaptive", granularity="row", density=1.0,
               state_dtype="8bit", update_clip=1.0)
    opt.attach_backward_steps(max_norm=max_norm)
    for i in range(3):
        if i == 0:
            _loss(model).backward()
            opt.step()
            continue
        loss = _loss(model)
        with NoHostCopies():
            loss.backward()
            opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert isinstance(opt._clip_coef, torch.Tensor) == (max_norm > 0)
    if max_norm > 0:
        assert opt._clip_coef.device == META


@pytest.fixture
def _signals_stay_on_device(monkeypatch):
    """BSPS decides its transitions on the host once per engine step (``Plasticity.add_signals``, the one read):
    here the signals are checked to be device tensors and replaced by ones."""
    seen = []

    def add_signals(self, sumsq):
        assert sumsq.device == META and sumsq.dtype == torch.float64 and sumsq.shape == (len(self.blocks),)
        seen.append(sumsq.shape)
        self._acc += 1.0

    monkeypatch.setattr(Plasticity, "add_signals", add_signals)
    return seen


@pytest.mark.parametrize("kw", [dict(state_dtype="8bit"), dict(update="adaptive", second_moment="coordinate",
                                                                state_dtype="4bit", second_dtype="4bit"),
                                dict(importance="sketch", sketch_width=64, update="adaptive")],
                         ids=["sign-8bit", "adaptive-4bit", "sketch"])
def test_sparse_units_cut_into_chunks_on_meta(monkeypatch, kw):
    """A unit larger than a chunk (its threshold from the chunked radix select, sparse.kth_largest_chunked)."""
    from titan_ds.optim import core
    monkeypatch.setattr(core, "CHUNK", 256)
    params = [("w", nn.Parameter(torch.empty(3, 400, device=META)))]
    opt = ASDT(params, lr=1e-3, density=0.3, **kw)
    _step(opt, params)
    assert len(core.plan(opt._layouts.of(params[0][1]).pieces)) > 1


@pytest.mark.parametrize("update", ["sign", "adaptive"])
def test_bsps_modes_on_meta(update, _signals_stay_on_device):
    params = _params()
    opt = ASDT(params, lr=1e-3, update=update, density=0.5, state_dtype="8bit", granularity="row")
    pl = Plasticity([n for n, _ in params], [p.numel() for _, p in params], max_active_fraction=1.0)
    opt.attach_plasticity(pl, [[n for n, _ in params].index(u.param) for u in opt.units])
    _step(opt, params, steps=1)  # probe step: every block enters Growth
    pl.modes = [GROWTH, ELASTIC, FROZEN]  # every mode at once: Growth, Elastic (anchor, pull), Frozen
    _step(opt, params, steps=2)
    pl.modes = [SLEEPING, GROWTH, ELASTIC]  # state freed and re-placed
    _step(opt, params, steps=2)
    assert _signals_stay_on_device
    assert opt._plasticity_state()["acc"].device.type == "cpu"  # BSPS's state is on the host


def _shipped():
    out = []
    for path in all_configs():
        titan = TitanConfig.from_ds_config(str(path))
        if titan is not None and titan.optimizer is not None:
            out.append(pytest.param(path.name, id=path.stem))
    return out


@pytest.mark.parametrize("name", _shipped())
def test_shipped_optimizer_sections_on_meta(name, _signals_stay_on_device):
    """The optimizer section of every shipped ds_config (hf_asdt_8bit, titan_balanced, asdt, ...) as titan builds
    it, stepping on meta: after backward, or in the gradient hooks when the config says so."""
    ds = json.loads(config_path(name).read_text())
    titan = TitanConfig.from_ds_config(ds)
    cfg = titan.optimizer
    model = _model(torch.bfloat16 if cfg.weight_dtype == "bf16" else torch.float32)
    opt = build_optimizer(model, cfg)
    if titan.plasticity is not None and titan.plasticity.enabled:
        build_plasticity(opt, model, titan.plasticity)
    if cfg.step_in_backward:
        clip = ds.get("gradient_clipping", 0.0)
        opt.attach_backward_steps(max_norm=1.0 if clip == "auto" else float(clip))  # "auto": HF's default 1.0
    for i in range(3):
        loss = _loss(model)
        with NoHostCopies() if i else nullcontext():
            loss.backward()
            opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------------ ZeRO: units split across ranks
@pytest.fixture
def fake_dist(monkeypatch):
    """deepspeed.comm's all_reduce replaced by one that checks its tensor is on the device (NCCL takes no CPU
    tensor) and leaves it as it is (one rank's view of a 2-rank group)."""
    import deepspeed.comm as dist

    calls = []

    def all_reduce(t, op=None, group=None, **kw):
        assert t.device == META, f"collective on a {t.device} tensor"
        calls.append(tuple(t.shape))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def _split_layout(opt, lo, hi, flat):
    """This rank holds elements [lo, hi) of the parameters laid end to end; a unit cut by lo or hi is split."""
    pieces, split = [], []
    for u in opt.units:
        a, b = max(u.global_offset, lo), min(u.global_offset + u.numel, hi)
        if a < b:
            pieces.append(Piece(u.index, a - lo, b - a, a - u.global_offset))
            if b - a < u.numel:
                split.append(u.index)
    return {id(flat): (flat, Layout(pieces, split, group=object(), zero=True))}


@pytest.mark.parametrize("case", ["sign_sparse", "adaptive_row_sparse", "sketch", "bsps"])
def test_zero_split_units_on_meta(case, fake_dist, _signals_stay_on_device):
    """A ZeRO flat partition whose first and last units are split across ranks: the collective top-k bisection,
    the per-unit sums, the sketch's all-reduce and BSPS's signal sum run on the device."""
    params = _params()
    kw = {"sign_sparse": dict(density=0.3, state_dtype="8bit"),
          "adaptive_row_sparse": dict(update="adaptive", granularity="row", density=0.3),
          "sketch": dict(importance="sketch", sketch_width=64, density=0.3),
          "bsps": dict(density=0.3, granularity="block", block_size=32)}[case]
    opt = ASDT(params, lr=1e-3, **kw)
    if case == "bsps":
        pl = Plasticity([n for n, _ in params], [p.numel() for _, p in params], max_active_fraction=1.0)
        opt.attach_plasticity(pl, [[n for n, _ in params].index(u.param) for u in opt.units])
    flat = nn.Parameter(torch.empty(200, device=META))
    opt.param_groups[0]["params"] = [flat]
    opt.attach_layouts(_split_layout(opt, 50, 250, flat))
    assert opt._layouts.of(flat).split_units
    for i in range(3):
        flat.grad = torch.empty_like(flat)
        with NoHostCopies() if i else nullcontext():
            opt.step()
    assert fake_dist and all_meta(dict(opt.state[flat]))
