"""The seed's Quick Start: ``build_titan_trainer(model, config)`` and ``trainer.step(batch, loss_fn)``.

Every step runs forward, backward and optimizer step through the DeepSpeed engine built by
``titan_ds.initialize``; it returns ``(loss, metrics: StepMetrics)``. ``loss`` is the step's loss as a detached
0-dim tensor on the engine's device (as the HF Trainer's ``training_step`` returns it), not a float: reading a
device value on the host waits for the device, so the step reads nothing and the caller reads the loss when it
logs it (``float(loss)``, ``f"{loss:.4f}"``, ``metrics.to_dict()``), on the steps it logs.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Union

import torch

from .config import TitanConfig, TitanConfigError, load_ds_config
from .engine import initialize
from .metrics import ActivationCounter, StepMetrics, accounted_memory
from .utils import ensure_dist_env, get_logger

__all__ = ["TitanTrainer", "build_titan_trainer", "default_ds_config"]

log = get_logger(__name__)


def default_ds_config(titan: TitanConfig, micro_batch: int = 1, lr: float = 1e-3) -> dict[str, Any]:
    """The ds_config the Quick Start uses when the user gives only a TitanConfig."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    if titan.hms is not None:  # HMS streams ZeRO-3 partitions; it needs DeepSpeed's NVMe offload switched on
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": titan.hms.nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": titan.hms.nvme_path},
        }
    cfg["titan"] = titan.to_section()
    cfg["titan"].pop("device", None)
    if titan.device != "auto":
        cfg["titan"]["device"] = titan.device
    return cfg


def _check_device(titan: Optional[TitanConfig]) -> None:
    if titan is None or titan.device == "auto":
        return
    from deepspeed.accelerator import get_accelerator
    have = get_accelerator().device_name()
    if titan.device == have:
        return
    if titan.device == "cuda" and have == "cpu":
        log.warning("titan: device='cuda' was asked for but this machine has no CUDA device; DeepSpeed's "
                    "accelerator is the CPU, so training runs there")
        return
    raise TitanConfigError([f"titan.device is {titan.device!r} but DeepSpeed's accelerator here is {have!r}; set "
                            f"DS_ACCELERATOR={titan.device} before launching, or use device='auto'"])


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu":  # asynchronous only from pinned memory
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _count_tokens(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        t = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
        return 0 if t is None else t.numel()
    if isinstance(batch, (list, tuple)) and batch:
        return _count_tokens(batch[0])
    return 0


class TitanTrainer:
    """Holds the DeepSpeed engine; ``step(batch, loss_fn)`` where ``loss_fn(model, batch) -> scalar loss``."""

    def __init__(self, engine: Any, optimizer: Any = None, lr_scheduler: Any = None):
        self.engine = engine
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_step = 0
        self._activations = ActivationCounter(engine.module)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def step(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, StepMetrics]:
        """One training step; returns ``(loss, metrics)`` without reading anything back from the device (see the
        module docstring). ``metrics.tokens_per_s`` is host time: on a GPU, that of queueing the step's work
        unless the step had to wait for the device."""
        engine = self.engine
        t0 = time.perf_counter()
        batch = _to_device(batch, engine.device)
        engine.train()
        with self._activations.track():  # forward and backward: a block recomputed in backward saves again there
            loss = loss_fn(engine, batch)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            engine.backward(loss)
        mem = accounted_memory(engine, activations=self._activations.bytes)  # grads exist until step()
        engine.step()
        dt = time.perf_counter() - t0
        self.global_step += 1
        m = StepMetrics(step=self.global_step, loss=loss.detach(), tokens_per_s=_count_tokens(batch) / dt,
                        memory=mem)
        if hasattr(engine, "was_step_applied"):
            m.skipped_step = not engine.was_step_applied()
        runtime = getattr(engine, "titan", None)
        if runtime is not None:
            m.update(runtime.collect_metrics())
        return m.loss, m

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None) -> None:
        self.engine.save_checkpoint(save_dir, tag=tag, client_state={"trainer_step": self.global_step})

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> None:
        path, client = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no checkpoint found in {load_dir!r}")
        self.global_step = int((client or {}).get("trainer_step", 0))


def build_titan_trainer(model: torch.nn.Module, config: Union[TitanConfig, Mapping[str, Any], str, None] = None,
                        *, ds_config: Union[Mapping[str, Any], str, None] = None, optimizer: Any = None,
                        lr: float = 1e-3, micro_batch: int = 1) -> TitanTrainer:
    """Build the production trainer.

    ``config`` is a :class:`TitanConfig` (the seed's flat keywords work too) or a whole ds_config (dict or json
    path) with a ``"titan"`` section. With a TitanConfig, ``ds_config`` may give the DeepSpeed part; otherwise
    :func:`default_ds_config` is used. Without a titan optimizer and without ``optimizer``, torch AdamW(lr) is the
    client optimizer.
    """
    ensure_dist_env()
    if isinstance(config, TitanConfig):
        titan = config
        ds = load_ds_config(ds_config) if ds_config is not None else default_ds_config(titan, micro_batch, lr)
        ds["titan"] = {k: v for k, v in titan.to_section().items() if not (k == "device" and v == "auto")}
    else:
        if ds_config is not None:
            raise TypeError("pass the ds_config either as `config` or as `ds_config`, not both")
        ds = load_ds_config(config)
        titan = TitanConfig.from_ds_config(ds)
    _check_device(titan)
    if optimizer is None and (titan is None or titan.optimizer is None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, opt, _, sched = initialize(model=model, optimizer=optimizer, config=ds)
    return TitanTrainer(engine, opt, sched)
