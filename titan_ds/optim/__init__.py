"""titan optimizer pillar: ASDT (sparse sign-momentum optimizer), BSPS (plasticity), TGSS sketches."""
from .sketch import CountMinSketch, CountSketch

__all__ = ["CountSketch", "CountMinSketch"]
