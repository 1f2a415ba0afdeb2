"""titan optimizer pillar: ASDT (sparse sign-momentum optimizer), BSPS (plasticity), TGSS sketches."""
from .asdt import ASDT, reference_step
from .bsps import Plasticity
from .delta import apply_delta, save_delta
from .sketch import CountMinSketch, CountSketch

__all__ = ["ASDT", "reference_step", "Plasticity", "CountSketch", "CountMinSketch", "save_delta", "apply_delta"]
