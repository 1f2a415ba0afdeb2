"""titan_ds: train models that do not fit the accelerator, with DeepSpeed and a ``"titan"`` config section."""
from .config import TITANConfig, TitanConfig, TitanConfigError
from .engine import initialize
from .integrations import install, is_installed, uninstall
from .metrics import MemoryBreakdown, StepMetrics
from .trainer import TitanTrainer, build_titan_trainer

__version__ = "0.1.0"

__all__ = ["initialize", "install", "uninstall", "is_installed", "TitanConfig", "TITANConfig", "TitanConfigError",
           "build_titan_trainer", "TitanTrainer", "StepMetrics", "MemoryBreakdown", "__version__"]
