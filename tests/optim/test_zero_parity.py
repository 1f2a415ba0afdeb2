"""ASDT (+BSPS) under DeepSpeed ZeRO 1/2/3 takes exactly the steps of stage 0 (1 rank here; 2 ranks: slow)."""
import os
import sys

import pytest
import torch

from tests.helpers.launch import run as run_group

sys.path.insert(0, os.path.dirname(__file__))
import zero_harness as h  # noqa: E402

from titan_ds.optim.asdt import ASDT  # noqa: E402
from titan_ds.optim.layout import Layout, Piece, kth_largest, param_layout  # noqa: E402


@pytest.fixture(scope="module")
def dist1():
    h.init_single_process()


@pytest.fixture(scope="module")
def stage0_runs(dist1):
    return {case: h.run(0, case) for case in ("sparse", "block_bf16", "bsps", "adaptive", "quant")}


def _assert_same(ref, got):
    for t, (a, b) in enumerate(zip(ref, got)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {t + 1} {k}: max diff {(a[k] - b[k]).abs().max()}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["sparse", "block_bf16", "bsps", "adaptive", "quant"])
def test_zero_stage_matches_stage0_step_by_step(stage0_runs, stage, case):
    ref = stage0_runs[case]
    first, last = ref[0], ref[-1]
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the run does train
    _assert_same(ref, h.run(stage, case))


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_matches_stage0(stage0_runs, stage):
    _assert_same(stage0_runs["bsps"], h.run(stage, "bsps", offload=True))


def test_collective_kth_largest_is_exact(dist1):
    """The bisection used for units split across ranks finds exactly topk's k-th value (ties, zeros too)."""
    s = [torch.rand(37), torch.zeros(5), torch.tensor([0.5, 0.5, 0.5, 0.1]), torch.rand(1000) ** 6]
    ks = [5, 2, 2, 999]
    pieces = [Piece(i, 0, x.numel(), 0) for i, x in enumerate(s)]
    got = kth_largest(s, ks, pieces, Layout(pieces, [0, 1, 2, 3], None))
    for x, k, tau in zip(s, ks, got):
        assert tau.item() == torch.topk(x, k).values[-1].item()


def test_units_marked_split_step_like_local_ones(dist1):
    """Every unit marked split (collective k-th largest, over 1 rank here; both modes' calls run, as on a rank
    that holds none of a mode's units): the same steps as without the marks."""
    ps = [torch.randn(7, 5, requires_grad=True), torch.randn(11, requires_grad=True)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    start = [p.detach().clone() for p in ps]
    marked = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, density=0.3, weight_decay=0.1)
    plain = ASDT([(f"p{i}", q) for i, q in enumerate(qs)], lr=1e-2, density=0.3, weight_decay=0.1)
    units = [marked.units_by_param[f"p{i}"] for i in range(len(ps))]
    marked.attach_layouts({id(p): (p, Layout(param_layout(us).pieces, [u.index for u in us], None))
                           for p, us in zip(ps, units)})
    for t in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        marked.step()
        plain.step()
    for p, q, s0 in zip(ps, qs, start):
        assert torch.equal(p.data, q.data) and not torch.equal(p.data, s0)


@pytest.mark.slow
def test_two_ranks_all_stages_match_stage0(tmp_path):
    """``deepspeed --num_gpus 2``: every unit of ZeRO-3 is split across the ranks (collective top-k)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = ["deepspeed", "--num_gpus", "2", os.path.join(os.path.dirname(__file__), "zero_harness.py"),
           "--out", str(tmp_path)]
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    r = run_group(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for case in ("sparse", "block_bf16", "bsps", "adaptive"):
        for rank in (0, 1):
            ref = torch.load(tmp_path / f"rank{rank}_stage0_{case}.pt")
            for stage in (1, 2, 3):
                _assert_same(ref, torch.load(tmp_path / f"rank{rank}_stage{stage}_{case}.pt"))
            if case != "bsps":  # step in backward, gradients averaged in the hooks: the same steps as stage 0
                _assert_same(ref, torch.load(tmp_path / f"rank{rank}_backward_{case}.pt"))


@pytest.mark.parametrize("case", ["sparse", "block_bf16", "adaptive"])
def test_step_in_backward_matches_stage0(stage0_runs, case):
    """Stage 0 with ASDT updating in the gradient hooks (titan.optimizer.step_in_backward) takes the same steps."""
    _assert_same(stage0_runs[case], h.run(0, case, step_in_backward=True))
