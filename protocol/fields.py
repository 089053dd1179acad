"""A request's header fields and tensor frames checked against its type's schema."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .errors import _bad, _describe
from .messages import (
    REQUEST_FIELDS,
    REQUEST_TENSORS,
    FieldSpec,
    MessageType,
    TensorSpec,
)
from .tensors import WireTensor

_FAST_KINDS = frozenset({"int", "bool", "int_list", "float", "str"})
_INT_TYPE = frozenset({int})


@dataclass(frozen=True)
class _Fields:
    """A type's header fields as `_field_values` checks them, built once at import."""

    specs: tuple[FieldSpec, ...]
    checks: dict[str, tuple[str, Any, Any]]  # name -> (kind, minimum, limit)
    required: frozenset
    defaults: dict[str, Any]  # every field's default, in spec order (the order the values come back in)

    @classmethod
    def of(cls, specs: tuple[FieldSpec, ...]) -> "_Fields":
        assert all(spec.kind in _FAST_KINDS for spec in specs), "a kind _field_values cannot check"
        assert all(None not in (spec.minimum, spec.limit) for spec in specs if spec.kind in ("int", "float")), \
            "_field_values compares a number with both bounds"
        return cls(specs, {spec.name: (spec.kind, spec.minimum, spec.limit) for spec in specs},
                   frozenset(spec.name for spec in specs if spec.required),
                   {spec.name: spec.default for spec in specs})


_REQUEST_SCHEMA = {mtype: _Fields.of(specs) for mtype, specs in REQUEST_FIELDS.items()}
# per type, its tensor frames' specs by name; a batch carries tensor 'hidden' alone
_TENSOR_SPECS = {mtype: {spec.name: spec for spec in specs} for mtype, specs in REQUEST_TENSORS.items()}


def _check_int(value: Any, what: str, minimum: Optional[int], limit: Optional[int]) -> int:
    if type(value) is not int:  # `type is`, not isinstance: True/False are ints in Python
        raise _bad(f"{what} must be an int, got {_describe(value)}")
    if (minimum is not None and value < minimum) or (limit is not None and value >= limit):
        low = "" if minimum is None else f"{minimum} <= "
        high = "" if limit is None else f" < {limit}"
        raise _bad(f"{what} = {value} is out of range ({low}x{high})")
    return value


def _ints_within(values: list, minimum: Optional[int], limit: Optional[int]) -> bool:
    """Whether every item is an int in [minimum, limit): the common case, checked without a call per item."""
    if not _INT_TYPE.issuperset(map(type, values)):  # `type is int`: True/False are ints in Python, not ids
        return False
    if not values:
        return True
    return (minimum is None or min(values) >= minimum) and (limit is None or max(values) < limit)


def _present_value(value: Any, spec: FieldSpec, mtype: MessageType) -> Any:
    """A present field's value, checked against its spec; the error message is built only for a refusal."""
    kind = spec.kind
    if kind == "int":
        if type(value) is int and (spec.minimum is None or value >= spec.minimum) and (
                spec.limit is None or value < spec.limit):
            return value
        return _check_int(value, f"field '{spec.name}' of {mtype.value}", spec.minimum, spec.limit)
    if kind == "bool" and type(value) is bool:
        return value
    if kind == "int_list" and type(value) is list and _ints_within(value, spec.minimum, spec.limit):
        return value
    what = f"field '{spec.name}' of {mtype.value}"
    if kind == "bool":
        raise _bad(f"{what} must be a bool, got {_describe(value)}")
    if kind == "float":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _bad(f"{what} must be a finite number, got {_describe(value)}")
        if (spec.minimum is not None and value < spec.minimum) or (spec.limit is not None and value > spec.limit):
            raise _bad(f"{what} = {value} is out of range ({spec.minimum} <= x <= {spec.limit})")
        return float(value)
    if kind == "str":  # limit: the most characters
        if type(value) is not str:
            raise _bad(f"{what} must be a string, got {_describe(value)}")
        if spec.limit is not None and len(value) > spec.limit:
            raise _bad(f"{what} is {len(value)} characters, more than {spec.limit}")
        if spec.minimum is not None and len(value) < spec.minimum:
            raise _bad(f"{what} is {len(value)} characters, fewer than {spec.minimum}")
        return value
    if kind == "int_list":
        if type(value) is not list:
            raise _bad(f"{what} must be a list of ints, got {_describe(value)}")
        if not _ints_within(value, spec.minimum, spec.limit):
            for i, item in enumerate(value):  # the first bad item names itself
                _check_int(item, f"{what}[{i}]", spec.minimum, spec.limit)
        return value
    raise AssertionError(f"schema kind {spec.kind!r} has no validator")


def _field_values(header: dict, fields: _Fields, mtype: MessageType) -> dict[str, Any]:
    """Every field of `fields` from `header`, in spec order: checked where present, the default where absent and
    optional. The common case, every required field present and every value good, is checked by the header's keys
    alone; anything else goes through `_ordered_field_values`, so the first bad field in spec order is reported."""
    if fields.required <= header.keys():
        values = fields.defaults.copy()
        checks = fields.checks
        for name, value in header.items():
            check = checks.get(name)
            if check is None:  # v, type, id, tensors; a batch item's rows
                continue
            kind, minimum, limit = check
            if kind == "int":
                good = type(value) is int and minimum <= value < limit
            elif kind == "int_list":
                good = type(value) is list and _ints_within(value, minimum, limit)
            elif kind == "bool":
                good = type(value) is bool
            elif kind == "float":  # an int (made a float there) goes through the ordered checks
                good = type(value) is float and math.isfinite(value) and minimum <= value <= limit
            else:  # str
                good = type(value) is str and (limit is None or len(value) <= limit) and \
                    (minimum is None or len(value) >= minimum)
            if not good:
                break
            values[name] = value
        else:
            return values
    return _ordered_field_values(header, fields.specs, mtype)


def _ordered_field_values(header: dict, specs: tuple[FieldSpec, ...], mtype: MessageType) -> dict[str, Any]:
    """`_field_values` field by field, in spec order (so the first bad one is the one reported)."""
    values = {}
    for spec in specs:
        name = spec.name
        if name in header:
            values[name] = _present_value(header[name], spec, mtype)
        elif spec.required:
            raise _bad(f"missing field '{name}' of {mtype.value}")
        else:
            values[name] = spec.default
    return values


def _request_tensors(found: dict[str, WireTensor], by_name: dict[str, TensorSpec], mtype: MessageType) -> dict:
    for name, tensor in found.items():
        spec = by_name.get(name)
        if spec is None:
            allowed = sorted(by_name) or "none"
            raise _bad(f"{mtype.value} does not take tensor '{name}' (allowed: {allowed})")
        if len(tensor.shape) != spec.ndim:
            raise _bad(f"tensor '{name}' must be {spec.ndim}-D, got shape {list(tensor.shape)}")
        if tensor.dtype not in spec.dtypes:
            raise _bad(f"tensor '{name}' must be one of {sorted(spec.dtypes)}, got {tensor.dtype}")
    return {name: found.get(name) for name in by_name}
