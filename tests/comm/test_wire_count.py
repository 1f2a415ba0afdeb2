"""titan's wire counter (titan_ds/comm/wire.py: count_collectives) sees every collective a DeepSpeed run makes:
at every ZeRO stage, on 2 real ranks, its received bytes and calls equal an independent count taken one layer
lower (torch's C++ ProcessGroup methods), including ZeRO's parameter all-gathers that DeepSpeed's backend binds
at start-up and the initial parameter broadcast."""
from __future__ import annotations

import json

import pytest
import torch


def test_a_backend_that_bound_the_functions_before_the_count_is_counted_and_restored(monkeypatch):
    """DeepSpeed's TorchBackend binds torch.distributed.all_gather_into_tensor / reduce_scatter_tensor in its
    constructor; a count entered later must still see calls made through those bindings, and give them back."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist

    from titan_ds.comm.wire import WireCount, count_collectives

    class Backend:  # stands for a started TorchBackend: the two attributes its constructor binds
        def __init__(self):
            self.all_gather_function = dist.all_gather_into_tensor
            self.reduce_scatter_function = dist.reduce_scatter_tensor

    backend = Backend()
    monkeypatch.setattr(ds_comm, "cdb", backend)
    original = backend.all_gather_function
    count = WireCount()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    with count_collectives(count):
        assert backend.all_gather_function is not original
        assert backend.all_gather_function.__wrapped__ is original
        # the wrapper counts, then calls through; no process group here, so the call itself fails after counting
        with pytest.raises(Exception):
            backend.all_gather_function(output_tensor=torch.empty(16), input_tensor=torch.empty(4))
    assert backend.all_gather_function is original and backend.reduce_scatter_function is dist.reduce_scatter_tensor
    assert count.calls == {"all_gather_into_tensor": 1}
    assert count.received == 3 * 4 * 4  # (W - 1) * 16 bytes


@pytest.mark.slow
def test_titan_count_equals_the_process_group_count_at_every_zero_stage(tmp_path):
    from tests.helpers.launch import ROOT, run_deepspeed
    out = tmp_path / "wire.json"
    proc = run_deepspeed(ROOT / "tests/comm/multirank_wire.py", "--stages", "0,1,2,3", "--steps", "3",
                         "--out", str(out), timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for stage in ("0", "1", "2", "3"):
        r = res[stage]
        assert r["titan"] == r["independent"] and r["titan_calls"] == r["independent_calls"], (stage, r)
        assert r["titan_calls"].get("broadcast", 0) > 0, (stage, r)  # initialize's parameter broadcast
    for stage in ("1", "2", "3"):  # ZeRO 1-3 all-gather the parameters: the traffic a late count missed
        assert res[stage]["titan_calls"].get("all_gather_into_tensor", 0) >= 3, (stage, res[stage])
    assert res["1"]["titan"] > res["0"]["titan"]
