"""titan_ds: train models that do not fit the accelerator, with DeepSpeed and a ``"titan"`` config section."""
from .config import TITANConfig, TitanConfig, TitanConfigError
from .engine import initialize
from .integrations import install, is_installed, uninstall
from .metrics import MemoryBreakdown, StepMetrics
from .trainer import TitanTrainer, build_titan_trainer

__version__ = "0.1.0"


def zero_init(ds_config, **init_kwargs):
    """The context to build a model that must never exist whole in RAM (``deepspeed.zero.Init``, with its
    parameters going straight to HMS when the config has ``titan.hms``): :func:`titan_ds.hms.install.zero_init`."""
    from .hms.install import zero_init as _zero_init
    return _zero_init(ds_config, **init_kwargs)


__all__ = ["initialize", "zero_init", "install", "uninstall", "is_installed", "TitanConfig", "TITANConfig", "TitanConfigError",
           "build_titan_trainer", "TitanTrainer", "StepMetrics", "MemoryBreakdown", "__version__"]
