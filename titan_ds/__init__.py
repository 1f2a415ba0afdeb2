"""titan_ds: train models that do not fit the accelerator, with DeepSpeed and a ``"titan"`` config section."""
from .deepspeed_compat import check_version as _check_deepspeed

_check_deepspeed()  # a DeepSpeed outside the supported range fails here, naming both (titan_ds.deepspeed_compat)

from .config import TITANConfig, TitanConfig, TitanConfigError  # noqa: E402
from .engine import initialize  # noqa: E402
from .integrations import install, is_installed, uninstall  # noqa: E402
from .metrics import MemoryBreakdown, StepMetrics  # noqa: E402
from .trainer import TitanTrainer, build_titan_trainer  # noqa: E402

__version__ = "0.1.0"


def zero_init(ds_config, **init_kwargs):
    """The context to build a model that must never exist whole in RAM (``deepspeed.zero.Init``, with its
    parameters going straight to HMS when the config has ``titan.hms``): :func:`titan_ds.hms.install.zero_init`."""
    from .hms.install import zero_init as _zero_init
    return _zero_init(ds_config, **init_kwargs)


__all__ = ["initialize", "zero_init", "install", "uninstall", "is_installed", "TitanConfig", "TITANConfig", "TitanConfigError",
           "build_titan_trainer", "TitanTrainer", "StepMetrics", "MemoryBreakdown", "__version__"]
