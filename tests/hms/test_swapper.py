"""ZeRO-3 with titan HMS: bit-exact against training without offload, bit-exact resume in a fresh process,
and the resume that DeepSpeed's own NVMe swappers lose (each configuration runs in its own process through
tests/hms/zero3_harness.py).

Reference choice: with ``gradient_clipping 0`` HMS must equal ZeRO-3 without offload bit for bit. With
clipping on, DeepSpeed's offload path computes the gradient norm in another summation order than its
no-offload path (ulp differences in the clip coefficient), so the reference is then DeepSpeed's CPU offload,
which takes the same path.
"""
import os
import sys
from collections import Counter, OrderedDict

import pytest
import torch

from tests.helpers.launch import run_on_free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HARNESS = os.path.join(HERE, "zero3_harness.py")
PY = sys.executable


def run(tmp, name, *args, ranks=1):
    out = str(tmp / f"{name}.pt")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    tail = ["--out", out, "--nvme", str(tmp / "nvme" / name), *map(str, args)]

    def build(port):
        if ranks == 1:
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            return [PY, HARNESS, *tail]
        ds = os.path.join(os.path.dirname(PY), "deepspeed")
        return [ds, "--num_gpus", str(ranks), "--master_port", str(port), HARNESS, *tail]

    p = run_on_free_port(build, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [torch.load(out.replace(".pt", f".rank{r}.pt"), weights_only=False) for r in range(ranks)]


def assert_same(a, b, steps=None):
    common = sorted(set(a["losses"]) & set(b["losses"])) if steps is None else steps
    assert common
    for k in common:
        assert a["losses"][k] == b["losses"][k], f"loss at step {k}: {a['losses'][k]} vs {b['losses'][k]}"
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert_state_same(a["state"], b["state"])
    assert a["lr"] == b["lr"]


def assert_state_same(sa, sb):
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), (i, sorted(sa[i]), sorted(sb[i]))
        for k, v in sa[i].items():
            w = sb[i][k]
            assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), f"sub-group {i} state {k!r}"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_zero3")


def reference_cache(log, *, prefetch=True, reads=None):
    """Hits and misses by key kind of an LRU DRAM cache of ``log["budget"]`` bytes replaying the store calls in
    ``log`` (tests/hms/zero3_harness.py --record-store), with every prefetch complete when it is issued:
    a put replaces the key's cached copy (write-allocate), a get hits if the key is cached or was prefetched
    (or staged from its last put) since that put and not yet read, and a missed read is cached; anything over ``log["item_max"]`` (the store's admission limit) is never cached.
    ``prefetch=False`` ignores the prefetch calls (caching alone). ``reads``, a Counter, gets the file reads by
    key kind (a prefetch that starts one, a missed get)."""
    reads = Counter() if reads is None else reads
    budget, cache, staged = log["budget"], OrderedDict(log["cache"]), set()
    item_max = log["item_max"]
    sizes = {k: n for op, k, n in log["ops"] if op in ("put", "get")}  # a prefetch or a stage records 0 bytes
    hits, misses = Counter(), Counter()

    def insert(key, n):
        if n > item_max:
            return
        while cache and sum(cache.values()) + n > budget:
            cache.popitem(last=False)
        cache[key] = n

    for op, key, n in log["ops"]:
        kind = key.split("/", 1)[0]
        if op == "put":
            cache.pop(key, None)
            staged.discard(key)
            insert(key, n)
        elif op == "prefetch":
            if prefetch and key not in cache and key not in staged:
                staged.add(key)
                reads[kind] += 1
                insert(key, sizes[key])
        elif op == "stage":  # the value just put, held as a finished prefetch (not cached)
            if prefetch and key not in cache and key not in staged:
                staged.add(key)
        elif key in cache:
            cache.move_to_end(key)
            hits[kind] += 1
        elif key in staged:
            staged.discard(key)
            hits[kind] += 1
        else:
            misses[kind] += 1
            reads[kind] += 1
            insert(key, n)
    return hits, misses


def test_hms_equals_no_offload_bitwise_1rank(tmp):
    ref, = run(tmp, "none0", "--mode", "none", "--clip", 0)
    hms, = run(tmp, "hms0", "--mode", "hms", "--clip", 0)
    assert_same(ref, hms)
    assert len(ref["state"]) == 2 and ref["state"][1]["fp32"].numel() < (1 << 20) // 4  # one small sub-group
    # the same run with every prefetch read complete when issued: still bit-exact, and its hit counts are a
    # function of the store calls alone, so a reference cache replaying them must give exactly the same
    sync, = run(tmp, "hms0_sync", "--mode", "hms", "--clip", 0, "--sync-prefetch", "--record-store")
    assert_same(ref, sync)
    m, log = sync["hms"], sync["store_ops"]
    hits, misses = reference_cache(log)
    assert set(hits) | set(misses) == {"param", "opt"}
    for kind in ("param", "opt"):
        h0, m0 = log["by_kind"].get(kind, [0, 0])[:2]  # counted during initialize, before the log
        assert (m[f"{kind}_hits"] - h0, m[f"{kind}_misses"] - m0) == (hits[kind], misses[kind]), kind
    h0, m0 = (sum(v[i] for v in log["by_kind"].values()) for i in (0, 1))
    assert (m["hits"] - h0, m["misses"] - m0) == (sum(hits.values()), sum(misses.values()))
    assert m["hit_rate"] == m["hits"] / (m["hits"] + m["misses"])
    # every parameter swap-in ZeRO-3 makes after initialize was announced (swap_in prefetches, the predictor
    # reads ahead, the optimizer step prefetches the partitions a master is read back from), so none misses;
    # caching alone keeps the small partitions (the store admits items of at most 1/8 of its budget) but misses
    # the 1 MiB one and the 1.1 MB sub-group's tensors at every use
    assert misses["param"] == 0 and hits["param"] > 0
    plain_hits, plain_misses = reference_cache(log, prefetch=False)
    assert plain_misses["param"] > 0 and plain_misses["opt"] > 0, (plain_hits, plain_misses)
    assert hits["param"] > plain_hits["param"] and hits["opt"] > plain_hits["opt"], (hits, plain_hits)
    # with real background reads the hit counts depend on timing, the accesses do not
    a = hms["hms"]
    for kind in ("param", "opt"):
        assert a[f"{kind}_hits"] + a[f"{kind}_misses"] == m[f"{kind}_hits"] + m[f"{kind}_misses"], kind
    assert a["bytes_written"] == m["bytes_written"] > 0 and a["bytes_read"] > 0


def test_lstm_prefetch_trains_the_same_live(tmp):
    """The seed's LSTM predictor in a live ZeRO-3 run (no shipped profile uses it since trace measured better:
    99.3% vs 75.9% hits, 1.47x the throughput): its guesses only move reads earlier, so the run is bit-exact."""
    ref, = run(tmp, "none_lstm", "--mode", "none", "--clip", 0)
    hms, = run(tmp, "hms_lstm", "--mode", "hms", "--clip", 0, "--prefetch", "lstm")
    assert_same(ref, hms)
    assert hms["hms"]["param_hits"] > 0


def test_partitions_written_by_the_step_stay_staged_for_the_next_forward(tmp):
    # with no DRAM cache, the partitions the optimizer step writes that the predictor expects next (the first
    # ones of the next forward) are kept as finished prefetches (TensorStore.stage): still bit-exact, the hit
    # counts are the reference replay's with the stage calls in it, and those hits read nothing from disk
    ref, = run(tmp, "none0_st", "--mode", "none", "--clip", 0)
    st, = run(tmp, "hms0_st", "--mode", "hms", "--clip", 0, "--sync-prefetch", "--record-store", "--dram-mb", 0)
    assert_same(ref, st)
    m, log = st["hms"], st["store_ops"]
    assert log["budget"] == 0 and m["staged_writes"] > 0
    staged = sum(op == "stage" for op, _, _ in log["ops"])
    assert m["staged_writes"] <= staged
    reads, reads_without = Counter(), Counter()
    hits, misses = reference_cache(log, reads=reads)
    for kind in ("param", "opt"):
        h0, m0 = log["by_kind"].get(kind, [0, 0])[:2]
        assert (m[f"{kind}_hits"] - h0, m[f"{kind}_misses"] - m0) == (hits[kind], misses[kind]), kind
    assert m["reads"] - log["reads"] == sum(reads.values())  # the store read exactly the files the replay did
    reference_cache(dict(log, ops=[op for op in log["ops"] if op[0] != "stage"]), reads=reads_without)
    # every staged partition is one file read fewer (a prefetch that found it staged)
    assert reads_without["param"] - reads["param"] == m["staged_writes"] > 0


def test_model_built_under_titan_zero_init_streams_from_birth_and_trains_the_same(tmp):
    # a model larger than RAM must never exist whole; built under titan_ds.zero_init each module's
    # parameters go to HMS's store as it is constructed, initialize adopts that store, and the run is the same
    ref, = run(tmp, "none0_zi", "--mode", "none", "--clip", 0)
    zi, = run(tmp, "hms0_zi", "--mode", "hms", "--clip", 0, "--zero-init")
    assert_same(ref, zi)
    assert zi["hms"]["bytes_written"] > 0


def test_gradient_buffer_on_disk_trains_the_same(tmp):
    # titan.hms.gradient_buffer "disk": DeepSpeed's fp32 gradient partitions live in a file mapping (page cache,
    # reclaimable under a memory cap) instead of anonymous memory; the arithmetic is unchanged. The optimizer
    # swapper reads the gradient pieces from that mapping, as it reads them from DeepSpeed's CPU buffer with
    # "dram": neither writes a copy to the store
    ref, = run(tmp, "hms0_gdram", "--mode", "hms", "--clip", 1.0, "--gas", 2)
    gd, = run(tmp, "hms0_gd", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--grad-disk")
    assert_same(ref, gd)
    assert gd["grad_buffer_mapped"] is True and ref["grad_buffer_mapped"] is False
    assert ref["grad_keys"] == 0 and gd["grad_keys"] == 0
    # every sub-group stepped on ZeRO-3's buffer itself (its pieces lie there back to back): no copy, same bits
    assert ref["grads_in_place"] > 0 and gd["grads_in_place"] > 0
    assert ref["hms"]["bytes_written"] == gd["hms"]["bytes_written"] > 0
    # the next sub-group's gradient pages were asked back from the file ahead of its step (madvise WILLNEED), one
    # advice per sub-group and step; DeepSpeed's anonymous CPU buffer ("dram") is never advised
    assert gd["grads_advised"] >= gd["subgroups"] and ref["grads_advised"] == 0


def test_bf16_parameters_with_disk_gradients_train_the_same(tmp):
    # the full-size run's layout (launch/bench/hms_scale.py hms_asdt_bf16): bf16 parameter partitions, fp32
    # gradient accumulation in the file mapping, fp32 masters; the mapped gradients are read in place, bit-exact
    ref, = run(tmp, "hms_bf16_gdram", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--bf16")
    gd, = run(tmp, "hms_bf16_gd", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--bf16", "--grad-disk")
    assert_same(ref, gd)
    assert all(p.dtype == torch.bfloat16 for p in gd["params"].values())
    assert gd["grad_buffer_mapped"] is True and gd["grad_keys"] == 0 and ref["grad_keys"] == 0


def test_gradient_store_trains_the_same_and_resumes(tmp):
    # titan.hms.gradient_store: each gradient piece of the mapping is written to the store in backward (behind, on
    # the writer) and punched out of the mapping once on disk; the step reads it back, prefetched into one of two
    # buffers. Same bits as the mapped gradients, with accumulation and clipping, and through a checkpoint
    ref, = run(tmp, "gs_ref", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--grad-disk")
    gs, = run(tmp, "gs", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--grad-disk", "--grad-store")
    assert_same(ref, gs)
    assert ref["grads_stored"] == 0 and ref["grad_keys"] == 0 and ref["grad_bytes_punched"] == 0
    assert gs["grad_keys"] > 0 and gs["grads_stored"] >= gs["grad_keys"] * 6  # every piece, every step
    assert gs["grads_in_place"] == 0 and gs["grads_advised"] == 0  # nothing read from the mapping
    assert gs["grad_bytes_punched"] > 0  # (the 512x512 matrix's pieces span whole pages)
    # 4 bytes a parameter more written and read a step: the pieces
    assert gs["store_bytes_written"] - ref["store_bytes_written"] >= 6 * 4 * gs["numel"]
    saved, = run(tmp, "gs_save", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--grad-disk", "--grad-store",
                 "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck_gs")
    resumed, = run(tmp, "gs_resumed", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--grad-disk", "--grad-store",
                   "--load-dir", tmp / "ck_gs")
    assert_same(gs, resumed, steps=[3, 4, 5])


def test_gradient_store_with_titan_balanced_folds_the_clip_the_same(tmp):
    # ASDT (8-bit/4-bit state) reads the stored gradient with ZeRO-3's clip factor folded into its read
    ref, = run(tmp, "gsa_ref", "--mode", "hms", "--clip", 1.0, "--grad-disk", "--asdt", "--bf16")
    gs, = run(tmp, "gsa", "--mode", "hms", "--clip", 1.0, "--grad-disk", "--asdt", "--bf16", "--grad-store")
    assert_same(ref, gs)
    assert gs["grads_stored"] > 0 and gs["unscale"]["folded"] and gs["unscale"] == ref["unscale"]


def test_gradient_store_config_errors_name_the_fix():
    from titan_ds.config import TitanConfig
    from titan_ds.hms.install import HMSPillar
    from titan_ds.pillar import View
    for hms, ds, match in (({"gradient_buffer": "dram", "gradient_store": True}, {}, "set gradient_buffer to"),
                           ({"gradient_buffer": "disk", "gradient_store": True}, {"fp16": {"enabled": True}},
                            "use bf16")):
        cfg = TitanConfig.model_validate({"hms": {"nvme_path": "/tmp/titan_gs_cfg", **hms}})
        pillar = HMSPillar(cfg)
        errs = pillar.validate(View.of(cfg, ds, torch.nn.Linear(2, 2)))
        assert any(match in e for e in errs), errs
    # on by default: it steps aside (no error) where the buffer is in DRAM or the run is fp16
    for hms, ds in (({"gradient_buffer": "dram"}, {}), ({"gradient_buffer": "disk"}, {"fp16": {"enabled": True}})):
        cfg = TitanConfig.model_validate({"hms": {"nvme_path": "/tmp/titan_gs_cfg", **hms}})
        assert cfg.hms.gradient_store
        assert not [e for e in HMSPillar(cfg).validate(View.of(cfg, ds, torch.nn.Linear(2, 2)))
                    if "gradient_store" in e]


def test_disk_gradient_buffer_maps_a_sparse_unlinked_file(tmp_path):
    from titan_ds.hms.install import _DiskGradientBuffer
    buf = _DiskGradientBuffer(str(tmp_path))
    t = buf.alloc(1000, torch.float32)
    assert t.untyped_storage().filename is not None and t.numel() == 1000 and not t.any()
    assert buf.bytes == 4000 and buf.mapped is t and not list(tmp_path.iterdir())  # unlinked once mapped
    t += 1
    assert t.sum() == 1000
    # which allocation of DeepSpeed it replaces: tests/test_deepspeed_compat.py (the allocator seam)


def test_plain_zero_init_model_is_refused_with_the_fix(tmp):
    import titan_ds
    from titan_ds.config import TitanConfigError
    from titan_ds.hms.install import _adopted_swapper

    class P:  # stands for a parameter converted by deepspeed.zero.Init with DeepSpeed's own swapper
        ds_id, ds_status, nvme_swapper = 0, None, object()

    class M(torch.nn.Module):
        def parameters(self, recurse=True):
            return iter([P()])

    import deepspeed.runtime.zero.partition_parameters as pp
    orig = pp.is_zero_param
    pp.is_zero_param = lambda p: isinstance(p, P)
    try:
        with pytest.raises(TitanConfigError, match=r"titan_ds.zero_init\(ds_config\)"):
            _adopted_swapper(M())
    finally:
        pp.is_zero_param = orig
    assert callable(titan_ds.zero_init)


@pytest.mark.slow
def test_hms_equals_cpu_offload_with_clipping_and_grad_accumulation(tmp):
    for gas in (1, 2):
        ref, = run(tmp, f"cpu_g{gas}", "--mode", "cpu", "--clip", 1.0, "--gas", gas)
        hms, = run(tmp, f"hms_g{gas}", "--mode", "hms", "--clip", 1.0, "--gas", gas)
        assert_same(ref, hms)


@pytest.mark.slow
@pytest.mark.heavy
def test_resume_bit_exact_fresh_process_1rank(tmp):
    cont, = run(tmp, "hms_cont", "--mode", "hms", "--clip", 1.0)
    saved, = run(tmp, "hms_save", "--mode", "hms", "--clip", 1.0, "--steps", 3, "--save-at", 3,
                 "--save-dir", tmp / "ck_hms")
    loaded, = run(tmp, "hms_loaded", "--mode", "hms", "--clip", 1.0, "--steps", 3, "--load-dir", tmp / "ck_hms")
    assert_state_same(saved["state"], loaded["state"])  # every sub-group, small one included, right after load
    resumed, = run(tmp, "hms_resumed", "--mode", "hms", "--clip", 1.0, "--load-dir", tmp / "ck_hms")
    assert_same(cont, resumed, steps=[3, 4, 5])


@pytest.mark.slow
@pytest.mark.heavy
def test_deepspeed_own_nvme_swapper_loses_state_where_hms_does_not(tmp):
    """DeepSpeed's swappers over the titan aio-compatible handle (AsyncIOBuilder substituted in the three
    swap modules, seams 2.7 item 1): this isolates DeepSpeed's resume logic from the I/O backend."""
    saved, = run(tmp, "ds_save", "--mode", "ds_nvme", "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck_ds")
    loaded, = run(tmp, "ds_loaded", "--mode", "ds_nvme", "--steps", 3, "--load-dir", tmp / "ck_ds")
    big, small = saved["state"][0], saved["state"][1]
    assert big["fp32"].numel() * 4 >= (1 << 20) > small["fp32"].numel() * 4
    # the swappable sub-group's weights come back, its optimizer state does not (never read from the files)
    assert torch.equal(loaded["state"][0]["fp32"], big["fp32"])
    assert "exp_avg" in big and "exp_avg" not in loaded["state"][0]
    # the small in-RAM sub-group keeps its freshly initialised weights and has no optimizer state
    assert not torch.equal(loaded["state"][1]["fp32"], small["fp32"])
    assert "exp_avg" not in loaded["state"][1]
    # so the resumed trajectory departs from the continuous one at once
    cont, = run(tmp, "ds_cont", "--mode", "ds_nvme")
    resumed, = run(tmp, "ds_resumed", "--mode", "ds_nvme", "--load-dir", tmp / "ck_ds")
    assert cont["losses"][3] != resumed["losses"][3]
    # the same sequence with HMS restores everything (test_resume_bit_exact_fresh_process_1rank)
    hsaved, = run(tmp, "h_save", "--mode", "hms", "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck_h")
    hloaded, = run(tmp, "h_loaded", "--mode", "hms", "--steps", 3, "--load-dir", tmp / "ck_h")
    assert_state_same(hsaved["state"], hloaded["state"])
    assert_same(cont, run(tmp, "h_cont", "--mode", "hms")[0])  # same swapped trajectory as DeepSpeed's swapper


@pytest.mark.slow
def test_hms_two_ranks_equals_no_offload_and_resumes(tmp):
    ref = run(tmp, "w2_none", "--mode", "none", "--clip", 0, ranks=2)
    hms = run(tmp, "w2_hms", "--mode", "hms", "--clip", 0, ranks=2)
    for a, b in zip(ref, hms):
        assert_same(a, b)
    run(tmp, "w2_save", "--mode", "hms", "--clip", 0, "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck2",
        ranks=2)
    resumed = run(tmp, "w2_resumed", "--mode", "hms", "--clip", 0, "--load-dir", tmp / "ck2", ranks=2)
    for a, b in zip(hms, resumed):
        assert_same(a, b, steps=[3, 4, 5])


def test_the_swappers_keep_their_earlier_module():
    """titan_ds.hms.swapper, where both swappers lived, still names them (each now in its own module)."""
    from titan_ds.hms import optimizer_swapper, param_swapper, swapper
    assert swapper.HMSParamSwapper is param_swapper.HMSParamSwapper
    assert swapper.HMSOptimizerSwapper is optimizer_swapper.HMSOptimizerSwapper
    assert swapper.SWAP_MIN_NUMEL == optimizer_swapper.SWAP_MIN_NUMEL
