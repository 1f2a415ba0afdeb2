"""The seed's flat keywords for the ``"titan"`` section: ``TITANConfig(device="cuda", use_trd=True, trd_rank=16,
nvme_path="./x")`` (the seed's Quick Start, ``examples/quickstart.py``). :func:`structured` maps them onto the
structured section that :class:`titan_ds.config.TitanConfig` parses (``TITANConfig`` is that class, which calls
it), so range checks and their messages are the structured section's."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from .config_errors import SECTION, TitanConfigError, describe

__all__ = ["FLAT_KEYS", "structured"]

# The seed's flat TITANConfig keywords; :func:`_from_flat` says where each lands in the structured section.
FLAT_KEYS = {
    "device", "use_trd", "trd_rank", "nvme_path", "dram_cache_mb", "use_mlme", "use_asdt", "density",
    "lr", "use_bsps", "use_hge", "compression_ratio", "use_tgss",
}


class _SeedFlat(BaseModel):
    """The seed's flat keywords, type-checked before they are mapped onto the structured section."""
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=False)

    device: Literal["auto", "cpu", "cuda"] = "auto"
    use_trd: bool = False
    trd_rank: Optional[Union[int, list[int]]] = None
    nvme_path: Optional[str] = None
    dram_cache_mb: Optional[int] = None
    use_mlme: bool = False
    use_asdt: bool = False
    use_bsps: bool = False
    density: Optional[float] = None
    lr: Optional[float] = None
    use_hge: bool = False
    use_tgss: bool = False
    compression_ratio: Optional[float] = None


def _from_flat(flat: _SeedFlat) -> dict[str, Any]:
    """Map the seed's flat keywords onto the structured section (range checks happen there)."""
    out: dict[str, Any] = {"device": flat.device}
    if flat.use_trd or flat.trd_rank is not None:
        out["trd"] = {} if flat.trd_rank is None else {"rank": flat.trd_rank}
    if flat.nvme_path is not None:
        out["hms"] = {"nvme_path": flat.nvme_path}
        if flat.dram_cache_mb is not None:
            out["hms"]["dram_cache_mb"] = flat.dram_cache_mb
    if flat.use_mlme:
        out["mlme"] = {}
    if flat.use_asdt or flat.use_bsps:
        out["optimizer"] = {k: getattr(flat, k) for k in ("density", "lr") if getattr(flat, k) is not None}
    if flat.use_bsps:
        out["plasticity"] = {}
    if flat.use_hge or flat.use_tgss:
        out["compression"] = {"method": "hge" if flat.use_hge else "tgss"}
        if flat.compression_ratio is not None:
            out["compression"]["ratio"] = flat.compression_ratio
    return out


def structured(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` unchanged when it holds no flat keyword (``device`` alone is both forms'), else the structured
    section its flat keywords mean; a mix of the two forms, or a flat keyword of the wrong type, raises."""
    flat_keys = FLAT_KEYS.intersection(data) - {"device"}
    if not flat_keys:
        return data
    mixed = sorted(set(data) - FLAT_KEYS)
    if mixed:
        raise TitanConfigError([f"titan mixes the seed's flat keywords ({', '.join(sorted(flat_keys))}) with "
                                f"structured sections ({', '.join(mixed)}); use one form"])
    try:
        flat = _SeedFlat(**data)
    except ValidationError as e:
        raise TitanConfigError([f"{SECTION}.{'.'.join(map(str, err['loc']))} {describe(err)}"
                                for err in e.errors()]) from None
    return _from_flat(flat)
