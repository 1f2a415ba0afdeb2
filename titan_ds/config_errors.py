"""How a ``"titan"`` section's problems are reported: :class:`TitanConfigError` (every problem at once), and the
messages made from pydantic's errors, each naming the key as the user wrote it
(``titan.optimizer.density must be in (0, 1], got 1.5``). The models are in :mod:`titan_ds.config`."""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

__all__ = ["SECTION", "TitanConfigError", "find_auto", "describe", "format_errors"]

SECTION = "titan"


class TitanConfigError(ValueError):
    """Every problem found in a ``"titan"`` section, reported at once.

    ``errors`` is the list of messages, each starting with the key path (``titan.hms.prefetch ...``).
    """

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        n = len(self.errors)
        head = f"{n} problem{'s' if n != 1 else ''} in the \"titan\" config section:"
        super().__init__("\n  - ".join([head, *self.errors]))


def find_auto(obj: Any, path: str) -> list[str]:
    """A message for every ``"auto"`` value under ``obj`` (whose key path is ``path``)."""
    found = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            found += find_auto(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += find_auto(v, f"{path}[{i}]")
    elif isinstance(obj, str) and obj == "auto":
        found.append(f"{path} is \"auto\": the titan section takes explicit values only (HF accelerate "
                     f"fills \"auto\" from TrainingArguments and rejects unknown keys); write the value")
    return found


def _key_path(loc: tuple[Any, ...]) -> str:
    path = SECTION
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("int", "list[int]", "function-after[_rank(), union[int,list[int]]]"):
            continue  # pydantic's union branch labels are not user keys
        else:
            path += f".{part}"
    return path


def describe(err: dict[str, Any], known: str = "") -> str:
    """One pydantic error as the end of a message (``must be >= 1, got 0``)."""
    kind, msg, val = err["type"], err["msg"], err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "is not a known key (typo?); remove it" + (f"; known keys here: {known}" if known else "")
    if kind == "missing":
        return "is required"
    if kind in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}, got {val!r}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {val!r}"
    if kind in ("float_parsing", "float_type", "int_parsing", "int_type", "int_from_float"):
        return f"must be a {'whole ' if kind.startswith('int') else ''}number, got {val!r}"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false, got {val!r}"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    return f"{msg}, got {val!r}"


def _known_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return ""
        model = inner[0]
    return ", ".join(model.model_fields)


def format_errors(e: ValidationError, root: type[BaseModel]) -> list[str]:
    """One message per key of ``e`` (raised by the model ``root``), an unknown key's naming the known ones."""
    seen: dict[str, str] = {}
    for err in e.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("int", "list[int]"))))
        path = _key_path(loc)
        text = f"{path} {describe(err, _known_keys(root, loc))}"
        # A union (rank: int | list[int]) reports one error per branch; keep the first per key.
        seen.setdefault(path + ":" + err["type"].split("_")[0], text)
    msgs = list(dict.fromkeys(seen.values()))
    # union branches of the same key: keep one message per key
    by_key: dict[str, str] = {}
    for m in msgs:
        by_key.setdefault(m.split(" ", 1)[0], m)
    return list(by_key.values())
