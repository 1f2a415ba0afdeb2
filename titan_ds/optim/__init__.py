"""titan optimizer pillar: ASDT (sparse sign-momentum optimizer), BSPS (plasticity); TGSS is ``titan_ds.comm.tgss``."""
from .asdt import ASDT, reference_step
from .bsps import Plasticity
from .delta import apply_delta, save_delta

__all__ = ["ASDT", "reference_step", "Plasticity", "save_delta", "apply_delta"]
