"""Generate docs/config_reference.md from the config models (``python -m titan_ds.config_reference``).

The reference is derived from the same pydantic models that validate the section, so it cannot drift: a test
checks that the committed file equals what this prints.
"""
from __future__ import annotations

import inspect
import sys
import typing
from typing import Any

from pydantic import BaseModel

from . import config as C

__all__ = ["render"]

_SECTIONS = [("titan", C.TitanConfig), ("titan.trd", C.TRDConfig), ("titan.mlme", C.MLMEConfig),
             ("titan.optimizer", C.OptimizerConfig), ("titan.plasticity", C.PlasticityConfig),
             ("titan.hms", C.HMSConfig), ("titan.compression", C.CompressionConfig)]


def _type(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin is typing.Union:
        return " or ".join(_type(a) for a in args if a is not type(None)) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "object"
    return getattr(ann, "__name__", str(ann))


def _constraints(field: Any) -> str:
    out = []
    for m in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{op} {v}")
    return ", ".join(out)


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`".replace("|", "\\|")
    v = field.default
    return "off (absent)" if v is None else f"`{v!r}`".replace("|", "\\|")


def render() -> str:
    lines = ["# The \"titan\" section: reference", "",
             "Generated from `titan_ds/config.py` by `python -m titan_ds.config_reference`; do not edit by hand.",
             "A missing sub-section means that pillar is off. Unknown keys, out-of-range values and `\"auto\"` are",
             "errors, all reported at once (`TitanConfigError`), each naming the key.", ""]
    for name, model in _SECTIONS:
        doc = inspect.cleandoc(model.__doc__ or "")
        lines += [f"## `{name}`", "", doc, "", "| key | type | default | constraint |", "|---|---|---|---|"]
        for key, field in model.model_fields.items():
            lines.append(f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {_constraints(field)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
