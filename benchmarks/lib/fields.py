"""``FIELD=VALUE`` text parsed by a dataclass's own field types (no guessing from the text's shape).

Used for experiment configs and for obfuscation variants (ObfuscationParams' fields), so ``noise_shape=fisher``
is a string because the field is one, and ``h=128`` an int because ``h`` is an int.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any


def _parse(tp: Any, text: str, name: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        problems = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _parse(arg, text, name)
            except ValueError as e:
                problems.append(str(e))
        raise ValueError("; ".join(problems))
    if origin in (tuple, list):
        items = [t for t in text.split(",") if t != ""] if text else []
        item_type = args[0] if args else str
        values = [_parse(item_type, t.strip(), name) for t in items]
        return tuple(values) if origin is tuple else values
    if origin is dict or tp is dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object, got {text!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON object, got {text!r}")
        return value
    if tp is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {text!r}") from None
    if tp is str or tp is Any:
        return text
    raise ValueError(f"{name}: cannot parse a value of type {tp!r} from text")


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_assignments(cls: type, assignments: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["k=v", ...]`` -> {field: typed value} for dataclass ``cls``; ValueError naming the bad item."""
    types_ = field_types(cls)
    out: dict[str, Any] = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"expected FIELD=VALUE, got {item!r}")
        if name not in types_:
            raise ValueError(f"unknown field {name!r}; fields: {', '.join(types_)}")
        out[name] = _parse(types_[name], text.strip(), name)
    return out


def to_jsonable(obj: Any) -> Any:
    """A dataclass (or nested values) as plain JSON values; tuples become lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj
