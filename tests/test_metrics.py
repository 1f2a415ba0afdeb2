import torch

from titan_ds.metrics import ActivationCounter, StepMetrics, accounted_memory


def test_accounted_memory_plain_module():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mem = accounted_memory(m)
    n = sum(p.numel() for p in m.parameters())
    assert mem.parameters == 4 * n and mem.gradients == 0
    m(torch.randn(2, 8)).sum().backward()
    assert accounted_memory(m).gradients == 4 * n


def test_activation_counter_counts_saved_not_params():
    lin = torch.nn.Linear(64, 64, bias=False)
    c = ActivationCounter(lin)
    x = torch.randn(10, 64, requires_grad=True)
    with c.track():
        y = torch.relu(lin(x))
    # saved: x (for dW) and relu's output (for its backward); the weight is a parameter and is not counted
    assert c.bytes == 2 * 10 * 64 * 4, c.bytes
    y.sum().backward()


def test_step_metrics_update_routes_unknown_to_extra():
    m = StepMetrics()
    m.update({"hge_compression_ratio": 120.0, "foo": 1})
    assert m.hge_compression_ratio == 120.0 and m.compression_on and m.extra == {"foo": 1}


def test_wire_ratio_fields_and_the_seed_alias():
    m = StepMetrics()
    m.update({"wire_compression_ratio": 100.0, "wire_compression_ratio_run": 9.2})
    assert m.compression_on and m.hge_compression_ratio == 100.0 and m.wire_compression_ratio_run == 9.2
    assert m.extra == {} and m.to_dict()["hge_compression_ratio"] == 100.0
    m.hge_compression_ratio = 50.0
    assert m.wire_compression_ratio == 50.0
    assert not StepMetrics().compression_on
