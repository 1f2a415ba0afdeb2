import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.configs import all_configs
from titan_ds import TITANConfig, TitanConfig, TitanConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_five_mistakes_reported_at_once():
    section = {
        "trd": {"rank": 0},                          # 1 out of range
        "hms": {"dram_cache_mb": 10},                # 2 nvme_path missing
        "optimizer": {"density": 1.5},               # 3 out of range
        "mlme": {"attention": "flash9"},             # 4 not a choice
        "compresion": {"method": "hge"},             # 5 typo'd key
    }
    with pytest.raises(TitanConfigError) as ei:
        TitanConfig.from_ds_config({"titan": section})
    errs = ei.value.errors
    assert len(errs) == 5, errs
    text = str(ei.value)
    assert "titan.trd.rank must be >= 1, got 0" in text
    assert "titan.hms.nvme_path is required" in text
    assert "titan.optimizer.density must be <= 1" in text and "1.5" in text
    assert "titan.mlme.attention must be one of" in text and "'flash9'" in text
    assert "titan.compresion is not a known key" in text and "compression" in text


def test_auto_rejected_with_reason():
    with pytest.raises(TitanConfigError, match=r"titan.optimizer.lr is \"auto\".*explicit"):
        TitanConfig(optimizer={"lr": "auto"})


def test_missing_section_means_off_and_none():
    assert TitanConfig.from_ds_config({"train_micro_batch_size_per_gpu": 1}) is None
    cfg = TitanConfig.from_ds_config({"titan": {"trd": {"rank": 8}}})
    assert cfg.enabled_pillars == ["trd"] and cfg.hms is None and cfg.trd.rank == 8


def test_seed_flat_config_maps_onto_structure():
    flat = TITANConfig(device="cuda", use_trd=True, trd_rank=16, nvme_path="./titan_storage")
    structured = TitanConfig(device="cuda", trd={"rank": 16}, hms={"nvme_path": "./titan_storage"})
    assert flat == structured
    assert flat.enabled_pillars == ["hms", "trd"]


def test_plasticity_needs_optimizer():
    with pytest.raises(TitanConfigError, match="plasticity needs titan.optimizer"):
        TitanConfig(plasticity={})


def test_trd_rank_list_and_bad_regex():
    assert TitanConfig(trd={"rank": [4, 8, 4]}).trd.rank == [4, 8, 4]
    with pytest.raises(TitanConfigError, match=r"titan.trd.include is not a valid regular expression"):
        TitanConfig(trd={"include": ["(unclosed"]})


def test_from_path_and_bad_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"titan": {"mlme": {}}}))
    assert TitanConfig.from_ds_config(p).mlme.tile == 128
    with pytest.raises(TitanConfigError, match="does not exist"):
        TitanConfig.from_ds_config(tmp_path / "nope.json")
    p.write_text("{not json")
    with pytest.raises(TitanConfigError, match="not valid JSON"):
        TitanConfig.from_ds_config(p)
    with pytest.raises(TitanConfigError, match="must be an object"):
        TitanConfig.from_ds_config({"titan": [1, 2]})


@pytest.mark.parametrize("path", all_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = json.loads(path.read_text())
    TitanConfig.from_ds_config(cfg)  # raises on any problem
    assert "gradient_clipping" in cfg, "every shipped config sets gradient_clipping explicitly (DeepSpeed defaults to 1.0)"


_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=True) |
                       st.text(max_size=8) | st.just("auto"),
                       lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=12), ch, max_size=4),
                       max_leaves=12)
_keys = st.sampled_from(["hms", "optimizer", "plasticity", "compression", "trd", "mlme", "device", "rank", "nvme_path",
                         "lr", "density", "tile", "method", "include", "bogus"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values | st.dictionaries(_keys, _values, max_size=5), max_size=6))
def test_fuzz_only_titan_config_errors(section):
    try:
        TitanConfig.from_ds_config({"titan": section})
    except TitanConfigError as e:
        assert e.errors and all(m.startswith("titan") for m in e.errors), e.errors


def test_config_reference_is_current():
    from titan_ds.config_reference import render
    assert (ROOT / "docs" / "config_reference.md").read_text() == render(), \
        "regenerate: python -m titan_ds.config_reference > docs/config_reference.md"


def test_compression_methods_come_from_the_registry():
    """titan.compression.method's choices and the keys each method accepts are the compressor classes' own: every
    other key of the section is refused for that method, naming the key (a valid value, so only that check fires)."""
    import typing

    from titan_ds.comm import REGISTRY
    from titan_ds.config import CompressionConfig

    valid = {"ratio": 10.0, "error_feedback": False, "sketch_rows": 2, "seed": 1, "ratio_warmup_steps": 5,
             "momentum": 0.9, "local_clip": 1.0, "rank": 2, "min_compression": 3.0, "bits": 4, "chunk": 1024,
             "exchange": "sharded", "scale_dtype": "bf16"}
    # the preconditioner's keys are every compressing method's (checked in tests/comm/test_precondition.py and,
    # residuals_follow_lr, tests/comm/test_residuals_follow_lr.py), the local-update keys every method's (tests/comm/test_diloco.py)
    assert set(valid) | {"method", "warmup_steps", "momentum_masking", "ratio_warmup_start", "gather_share",
                         "precondition", "precondition_beta1", "precondition_beta2", "precondition_eps",
                         "residuals_follow_lr", "sync_every", "outer_lr", "outer_momentum",
                         "outer_nesterov", "allow_dense_parameter_gather"} == \
        set(CompressionConfig.model_fields), "a new titan.compression key: add a valid value here"
    assert typing.get_args(CompressionConfig.model_fields["method"].annotation) == tuple(REGISTRY)
    for name, cls in REGISTRY.items():
        assert set(cls.config_keys) <= set(CompressionConfig.model_fields), name
        for key, value in valid.items():
            if key in cls.config_keys:
                TitanConfig(compression={"method": name, key: value})
            else:
                with pytest.raises(TitanConfigError, match=f"titan.compression has {key}, which method='{name}' does not use"):
                    TitanConfig(compression={"method": name, key: value})
    with pytest.raises(TitanConfigError, match="titan.compression.method must be one of"):
        TitanConfig(compression={"method": "dgc"})


@pytest.mark.parametrize("comp,needle", [
    ({"method": "topk", "ratio": 100, "ratio_warmup_steps": 10, "ratio_warmup_start": 200},
     "ratio_warmup_start=200 must be below ratio=100"),
    ({"method": "topk", "ratio_warmup_start": 4}, "ratio_warmup_steps is 0"),
    ({"method": "topk", "momentum_masking": False}, "momentum is 0"),
    ({"method": "topk", "momentum": 1.0}, "titan.compression.momentum must be < 1"),
    ({"method": "topk", "local_clip": 0}, "titan.compression.local_clip must be > 0"),
    ({"method": "powersgd", "rank": 0}, "titan.compression.rank must be >= 1"),
    ({"method": "powersgd", "min_compression": 0.5}, "titan.compression.min_compression must be >= 1"),
])
def test_dgc_and_powersgd_keys_are_checked(comp, needle):
    with pytest.raises(TitanConfigError, match=needle):
        TitanConfig(compression=comp)


def test_dgc_and_powersgd_keys_reach_the_reducer():
    from titan_ds.engine import InitContext, prepare

    def reducer(**comp):
        c = InitContext(titan=TitanConfig(compression=comp), ds_config={}, model=None, world_size=2)
        return prepare(c)[-1].reducer

    r = reducer(method="topk", ratio=300, momentum=0.9, momentum_masking=False, local_clip=0.5,
                ratio_warmup_steps=40, ratio_warmup_start=4, warmup_steps=3)
    assert (r.dgc.momentum, r.dgc.momentum_masking, r.dgc.local_clip) == (0.9, False, 0.5)
    assert (r.ratio_warmup_steps, r.ratio_warmup_start, r.warmup_steps) == (40, 4, 3) and "momentum" in r.stores
    p = reducer(method="powersgd", rank=4, min_compression=3, seed=7)
    assert (p.compressor.rank, p.compressor.min_compression, p.compressor.seed) == (4, 3, 7) and "q" in p.stores
