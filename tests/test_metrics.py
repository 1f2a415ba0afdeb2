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


class _Block(torch.nn.Module):
    """x + b(relu(a(x))): saves x (for dA), relu's output (for relu and dB; one storage), nothing for the add."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def _step_activations(recompute: bool, vocab: int = 0, n=32, d=64, layers=4) -> tuple[int, int]:
    """(the counter's figure after forward, after forward + backward) of one step of ``layers`` blocks."""
    from titan_ds.inject.recompute import recomputed
    torch.manual_seed(0)
    blocks = [_Block(d) for _ in range(layers)]
    for b in blocks:
        if recompute:
            b.__class__ = recomputed(_Block)
    m = torch.nn.Sequential(*blocks, *([torch.nn.Linear(d, vocab)] if vocab else []))
    c = ActivationCounter(m)
    x = torch.randn(n, d, requires_grad=True)
    with c.track():
        loss = m(x).pow(2).mean()
        forward = c.bytes
        loss.backward()
    return forward, c.bytes


def test_activations_are_the_peak_over_backward_where_recompute_saves_again():
    """recompute_blocks: forward keeps each block's input (4 B x n x d each) and the loss's input; in backward the
    last block's internals (its input, shared, and relu's output: 4 B x n x 4d) are saved again beside the 4
    block inputs still waiting, after the loss's input is freed: a peak above the forward figure, counted."""
    n, d, L = 32, 64, 4
    forward, step = _step_activations(recompute=True, n=n, d=d, layers=L)
    assert forward == (L + 1) * n * d * 4
    assert step == L * n * d * 4 + n * 4 * d * 4 > forward


def test_activations_without_a_backward_peak_are_the_forward_figure():
    """Without recompute nothing is saved in backward: the step's figure is what forward saved (every block's x
    and relu output, the loss's input). With recompute but a head whose saved input and logits outweigh a block's
    internals, the peak is still forward's: the head's tensors are freed before any block is recomputed."""
    n, d, L = 32, 64, 4
    forward, step = _step_activations(recompute=False, n=n, d=d, layers=L)
    assert step == forward == L * (n * d + n * 4 * d) * 4 + n * d * 4
    forward, step = _step_activations(recompute=True, vocab=1024, n=n, d=d, layers=L)
    assert step == forward == (L + 1) * n * d * 4 + n * 1024 * 4


def test_to_dict_reads_device_values_once_logged():
    """The loss and a pillar's device counters stay tensors in StepMetrics (not read in the step); to_dict reads
    them to Python values, nested ones included, so the record is JSON."""
    import json
    from titan_ds.metrics import host_values
    m = StepMetrics(step=3, loss=torch.tensor(2.5))
    m.update({"asdt_changed_elements": torch.tensor(7), "plasticity": {"growth": 2}, "v": [torch.tensor([1, 2])]})
    assert isinstance(m.loss, torch.Tensor) and isinstance(m.extra["asdt_changed_elements"], torch.Tensor)
    d = m.to_dict()
    assert d["loss"] == 2.5 and type(d["loss"]) is float
    assert d["extra"]["asdt_changed_elements"] == 7 and type(d["extra"]["asdt_changed_elements"]) is int
    assert d["extra"]["v"] == [[1, 2]] and d["plasticity"] == {"growth": 2}
    json.dumps(d)
    assert host_values((torch.tensor(True), 1.5, "x")) == (True, 1.5, "x")
