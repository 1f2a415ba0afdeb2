import pytest
import torch

import titan_ds
from titan_ds.engine import PILLARS, PillarEntry
from tests.helpers.equal_run import compare
from tests.helpers.launch import run_deepspeed


@pytest.mark.parametrize("stage", [0, 2])
def test_no_titan_section_is_bitwise_deepspeed(dist_env, stage):
    compare(stage)  # deepspeed.initialize vs titan_ds.initialize without and with an empty titan section


@pytest.mark.slow
def test_no_titan_section_is_bitwise_deepspeed_two_ranks():
    r = run_deepspeed("tests/helpers/equal_run.py", "0", "2", num_ranks=2)
    assert r.returncode == 0 and "EQUAL" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_pillar_order_is_documented():
    assert [p.key for p in PILLARS] == ["hms", "trd", "mlme", "optimizer", "compression"]


def test_titan_state_rides_in_checkpoints(dist_env, tmp_path, monkeypatch):
    """A pillar's registered state is saved in client_state and restored by engine.load_checkpoint."""
    import types
    store = {"value": torch.arange(3.0)}
    from titan_ds.pillar import Pillar as PillarBase
    fake = types.ModuleType("titan_ds._fake_pillar")

    class Fake(PillarBase):
        key = "trd"

        def apply(self, ctx):
            ctx.add_state("fake", lambda: {"v": store["value"].clone()}, lambda s: store.update(value=s["v"]))
            ctx.add_metrics(lambda: {"trd_compression_ratio": 2.0, "custom": 1})
    fake.PILLAR = Fake
    monkeypatch.setitem(__import__("sys").modules, "titan_ds._fake_pillar", fake)
    monkeypatch.setattr("titan_ds.engine.PILLARS", (PillarEntry("trd", "titan_ds._fake_pillar"),))
    from tests.helpers.equal_run import TINY, ds_config
    from titan_ds.models import GPT
    model = GPT(TINY)
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     config=ds_config(0, {"trd": {"rank": 2}}))
    assert engine.titan.collect_metrics() == {"trd_compression_ratio": 2.0, "custom": 1}
    engine.save_checkpoint(str(tmp_path), tag="t")
    store["value"] = torch.zeros(3)
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(store["value"], torch.arange(3.0))


def test_user_config_conflicting_with_pillar_flag_raises(dist_env):
    from titan_ds.config import TitanConfigError
    from tests.helpers.equal_run import TINY, ds_config
    from titan_ds.models import GPT
    cfg = dict(ds_config(1, {"optimizer": {}}), zero_allow_untested_optimizer=False)
    with pytest.raises(TitanConfigError, match="zero_allow_untested_optimizer=False .* conflicts"):
        titan_ds.initialize(model=GPT(TINY), config=cfg)
    cfg.pop("zero_allow_untested_optimizer")
    engine, *_ = titan_ds.initialize(model=GPT(TINY), config=cfg)  # titan sets the flag it needs
    assert engine.config["zero_allow_untested_optimizer"] is True
