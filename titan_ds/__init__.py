"""titan_ds: train models that do not fit the accelerator, with DeepSpeed and a ``"titan"`` config section."""
from .config import TITANConfig, TitanConfig, TitanConfigError
from .engine import initialize
from .metrics import MemoryBreakdown, StepMetrics
from .trainer import TitanTrainer, build_titan_trainer

__version__ = "0.1.0"

__all__ = ["initialize", "TitanConfig", "TITANConfig", "TitanConfigError", "build_titan_trainer", "TitanTrainer",
           "StepMetrics", "MemoryBreakdown", "__version__"]
