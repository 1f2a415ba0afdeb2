"""HMS at one rank: ZeRO-3's per-bucket reduce-scatter becomes the gradients' own flat views
(``deepspeed_compat.z3_one_rank_scatter``), the same values DeepSpeed's ``reduce_scatter_coalesced`` returns over a
group of one rank, without its copies; only for the length of each ``__avg_scatter_grads`` call. Bit-exactness of
whole HMS runs against ZeRO-3 without offload is tests/hms/test_swapper.py's
``test_hms_equals_no_offload_bitwise_1rank`` (HMS installs this seam)."""
import torch

import titan_ds
from titan_ds import deepspeed_compat as dsc


def _dist():
    import deepspeed.comm as dist
    if not dist.is_initialized():
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def test_views_hold_what_deepspeeds_reduce_scatter_returns_on_one_rank(dist_env):
    _dist()
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    g = torch.Generator().manual_seed(0)
    for sizes in ([7], [768, 1, 3 * 5, 4096], [2, 3]):
        flat = torch.randn(sum(sizes), generator=g)
        flat[0] = float("nan")
        flat[-1] = -0.0
        tensors = list(flat.split(sizes))
        ref = [t.clone() for t in reduce_scatter_coalesced([t.clone() for t in tensors])]
        out = dsc.one_rank_reduce_scatter(tensors)
        assert [o.shape for o in out] == [r.shape for r in ref]
        for o, r, t in zip(out, ref, tensors):
            assert torch.equal(o.view(torch.int32), r.view(torch.int32))  # bit for bit, NaN and -0.0 included
            assert o.data_ptr() == t.data_ptr()  # a view: no copy


def _engine(tmp_path, compression: bool = False):
    from titan_ds.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8, vocab_size=64))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "reduce_bucket_size": 500},
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
           "titan": {"hms": {"nvme_path": str(tmp_path / "nvme")}}}
    if compression:
        cfg["titan"]["compression"] = {"method": "none"}
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    return engine


def test_hms_engine_scatters_by_views_only_inside_the_call(dist_env, tmp_path, monkeypatch):
    from deepspeed.runtime.zero import stage3
    original = stage3.reduce_scatter_coalesced
    engine = _engine(tmp_path)
    assert dsc._Z3_AVG_SCATTER in vars(engine.optimizer)  # the instance's seam is installed
    seen, called = [], []
    real_views = dsc.one_rank_reduce_scatter

    def views(tensors, group=None):
        seen.append(stage3.reduce_scatter_coalesced is views)
        return real_views(tensors, group)
    monkeypatch.setattr(dsc, "one_rank_reduce_scatter", views)

    def counting(*a, **kw):
        called.append(1)
        return original(*a, **kw)
    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", counting)
    for i in range(2):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x, x))
        engine.step()
    assert len(seen) >= 2 and all(seen)  # several buckets (reduce_bucket_size 500), each through the views
    assert not called  # DeepSpeed's copy-and-collective never ran
    assert stage3.reduce_scatter_coalesced is counting  # restored after each call


def test_with_compression_the_seam_is_compressions(dist_env, tmp_path):
    engine = _engine(tmp_path, compression=True)
    hooks = engine.titan.reports["compression"]
    assert hooks._z3_held  # compression's own override of the same seam, not the one-rank views
    hooks.uninstall()


def test_more_ranks_run_deepspeeds_own(monkeypatch):
    """With a partition group of more than one rank the wrapped call is DeepSpeed's, with the global unchanged."""
    from deepspeed.runtime.zero import stage3
    seen = []

    def avg_scatter(self, params, dtype):
        seen.append(stage3.reduce_scatter_coalesced)
        return "reduced"

    Opt = type("Opt", (), {dsc._Z3_AVG_SCATTER: avg_scatter, "_get_param_partition_group": lambda self, p: None})
    opt = Opt()
    with dsc.z3_one_rank_scatter(opt):
        fn = getattr(opt, dsc._Z3_AVG_SCATTER)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        assert fn(["p"], torch.float32) == "reduced" and seen[-1] is dsc.z3_reduce_scatter_original()
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
        assert fn(["p"], torch.float32) == "reduced" and seen[-1] is dsc.one_rank_reduce_scatter
    assert dsc._Z3_AVG_SCATTER not in vars(opt) and stage3.reduce_scatter_coalesced is not dsc.one_rank_reduce_scatter
