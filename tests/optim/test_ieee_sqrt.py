"""asdt_math.ieee_sqrt: the correctly rounded square root the adaptive update divides by on every path (eager,
compiled, the C++ kernel, a GPU). ATen's CPU sqrt for fp32 (MKL's vml) is not correctly rounded, so the eager loop
cannot use it and still store what the kernel's vsqrtps stores (tests/optim/test_core_cpu.py checks the two bit for
bit); numpy's float32 sqrt is the IEEE one and is the reference here."""
import numpy as np
import torch

from titan_ds.optim.asdt_math import ieee_sqrt


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.numpy().view(np.uint32)


def test_ieee_sqrt_is_correctly_rounded_on_a_sample_of_every_binade():
    g = torch.Generator().manual_seed(0)
    random = torch.randint(0, 0x7F800000, (1 << 21,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0, 1, 2, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F800001, 0x7F7FFFFF, 0x7F800000],
                         dtype=torch.int32)  # 0, subnormals, the smallest normal, 1, the largest finite, +inf
    x = torch.cat([random, edges]).view(torch.float32)
    want = np.sqrt(x.numpy())
    assert np.array_equal(_bits(ieee_sqrt(x)), want.view(np.uint32))
    out = x.clone()
    assert ieee_sqrt(out, out=out) is out and np.array_equal(_bits(out), want.view(np.uint32))
    assert np.signbit(ieee_sqrt(torch.tensor([-0.0])).numpy()[0])  # sqrt(-0) = -0, as IEEE says
    assert torch.isnan(ieee_sqrt(torch.tensor([-1.0, float("nan")]))).all()


def test_ieee_sqrt_stays_on_the_tensors_device():
    """Off the CPU it is torch.sqrt (CUDA's is correctly rounded): no copy to the host (meta stands in for a GPU)."""
    x = torch.empty(1024, device="meta")
    assert ieee_sqrt(x).device.type == "meta"
    assert ieee_sqrt(x, out=x) is x
    h = torch.rand(8, dtype=torch.float64)
    assert torch.equal(ieee_sqrt(h), torch.sqrt(h))  # fp64 (the per-unit path): torch's own
