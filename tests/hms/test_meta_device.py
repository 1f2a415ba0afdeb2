"""HMS with the module's parameters on a device (``meta`` here): HMS only ever handles the host side.

Under ZeRO-3 with NVMe offload (what titan.hms requires for parameters and optimizer state) each parameter's
partition ``ds_tensor`` and every fp32 master and optimizer-state partition are host tensors; DeepSpeed itself
copies a partition to the device when it gathers the parameter (``p.ds_tensor.to(current_device)`` in
``partition_parameters.py``). So HMS has no device-side staging of its own: its swappers and store read and write
host tensors only, whatever device the parameter is on. This test runs the parameter swapper's whole cycle for
parameters on meta (a device with no data: any read or write of one would raise) and checks the partitions come
back bit for bit and the device-side parameters are left as they were.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.param_swapper import HMSParamSwapper, PartitionedParamStatus


def _param(ds_id: int, numel: int) -> torch.nn.Parameter:
    """A ZeRO-3 parameter as HMS sees it: released on the device (0 elements) and its host partition."""
    p = torch.nn.Parameter(torch.empty(0, device="meta"))
    p.ds_id = ds_id
    p.ds_tensor = torch.randn(numel)
    p.ds_tensor.ds_numel = numel
    p.ds_tensor.status = PartitionedParamStatus.AVAILABLE
    return p


class NoDeviceOps(TorchDispatchMode):
    """Fails on any op that reads or writes a meta (device) tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves((args, kwargs or {}))):
            raise AssertionError(f"HMS touched a device tensor: {func}")
        return func(*args, **(kwargs or {}))


def test_param_swapper_cycle_with_device_parameters(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    swapper = HMSParamSwapper(store, buffer_count=4)
    params = [_param(i, n) for i, n in enumerate((300, 17, 4096))]
    values = [p.ds_tensor.clone() for p in params]
    with NoDeviceOps():
        _cycle(swapper, params, values)
    assert all(p.device.type == "meta" and p.shape == (0,) for p in params)
    store.close()


def _cycle(swapper: HMSParamSwapper, params: list, values: list) -> None:
    swapper.swap_out_and_release(params)
    assert all(p.ds_tensor.numel() == 0 and p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
               for p in params)
    swapper.swap_in(params, async_op=True)
    swapper.synchronize_reads()
    for p, v in zip(params, values):
        assert p.ds_tensor.device.type == "cpu" and torch.equal(p.ds_tensor, v)
    new = [v + 1 for v in values]  # the optimizer step's new values (host fp32 partitions under NVMe offload)
    swapper.swap_out_partitioned_params(params, new)
    buffers = [swapper.get_buffer(p, p.ds_tensor.ds_numel) for p in params]
    swapper.swap_in(params, async_op=False, swap_in_buffers=buffers)
    for p, v in zip(params, new):
        assert torch.equal(p.ds_tensor, v)
