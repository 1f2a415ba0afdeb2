"""HMSOptimizerSwapper: which optimizer state tensors live in the store between steps (ASDT's
momentum goes to HMS, not only state shaped like the partition)."""
import torch

from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.optimizer_swapper import SWAP_MIN_NUMEL, HMSOptimizerSwapper


class _Opt:
    def __init__(self):
        self.state = {}
        self.param_groups = [{"params": []}]


def test_large_state_tensors_of_any_shape_and_dtype_are_swapped_and_come_back(tmp_path):
    n = 3 * SWAP_MIN_NUMEL
    opt = _Opt()
    sw = HMSOptimizerSwapper(None, None, str(tmp_path / "base"), opt, n, "cpu", torch.float32, None,
                             store=TensorStore([Tier(str(tmp_path / "store"))]))
    p = torch.nn.Parameter(torch.randn(n))
    p.ds_id = 7
    sw.initialize_parameters([p], [p.data.clone()])
    state = {
        "exp_avg": torch.randn(n),                                      # element-wise
        "momentum": torch.randint(0, 255, (n - 100,), dtype=torch.uint8),  # ASDT: active units' 8-bit codes
        "variance": torch.randint(0, 255, (n // 2,), dtype=torch.uint8),   # packed 4-bit codes
        "momentum_absmax": torch.rand(n // 256),                        # block scales: small, stay in RAM
        "second": torch.rand(8),
        "step": 3,
    }
    want = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    opt.state[p] = state
    sw.swap_out_optimizer_state(p)
    held = {k: v.numel() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    assert held == {"exp_avg": 0, "momentum": 0, "variance": 0, "momentum_absmax": n // 256, "second": 8}
    sw.swap_in_optimizer_state(p)
    for k, v in want.items():
        got = opt.state[p][k]
        assert (torch.equal(got, v) and got.dtype == v.dtype) if torch.is_tensor(v) else got == v, k
