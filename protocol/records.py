"""Request records built from checked values without their dataclass __init__, and copied with a new id."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .messages import BATCH_RECORD_TYPES, RECORD_TYPES, Request

# Per record type, its fields in order (what the encoders walk).
_FIELD_NAMES = {record: tuple(f.name for f in dataclasses.fields(record))
                for record in (*RECORD_TYPES.values(), *BATCH_RECORD_TYPES.values())}
_FIELD_SETS = {record: frozenset(names) for record, names in _FIELD_NAMES.items()}
# Per record type, the default of each field that has one: a decoded record is filled in from these (_record).
_DEFAULTS = {record: {f.name: f.default for f in dataclasses.fields(record) if f.default is not dataclasses.MISSING}
             for record in RECORD_TYPES.values()}
assert not any(hasattr(record, "__post_init__") or any(f.default_factory is not dataclasses.MISSING
                                                        for f in dataclasses.fields(record))
               for record in _FIELD_NAMES), "_record and with_id build records without their __init__"


def _record(record_type: type, *values: dict) -> Request:
    """`record_type(**values)`, the dicts of `values` merged in order, for values the decoder has checked, built
    without the frozen dataclass's __init__ (which sets each of a FORWARD's ~20 fields through object.__setattr__:
    most of the time of decoding a batch item): the records have no __post_init__ and no default factories, so the
    defaults and then the values in the instance's __dict__ are the same record."""
    record = object.__new__(record_type)
    fields = record.__dict__
    fields.update(_DEFAULTS[record_type])
    for part in values:
        fields.update(part)
    return record


def new_record(record_type: type, values: Mapping[str, Any]) -> Request:
    """`record_type(**values)`, built as the decoder builds its records (no __init__: a FORWARD's ~25 fields one
    object.__setattr__ each were most of the time of a coordinator's per-item record); a name that is not a
    field is a TypeError, as __init__ would raise."""
    unknown = values.keys() - _FIELD_SETS[record_type]
    if unknown:
        raise TypeError(f"{record_type.__name__} has no field(s) {sorted(unknown)}")
    return _record(record_type, values)


def with_id(record: Any, request_id: int) -> Any:
    """`dataclasses.replace(record, id=request_id)`, the same fields in the same order, without the dataclass
    __init__ (one object.__setattr__ for each of a FORWARD's ~25 fields, on every send); a record whose
    __dict__ is not exactly its fields goes through replace."""
    names = _FIELD_NAMES.get(type(record))
    values = record.__dict__
    if names is None or len(values) != len(names) or not values.keys() <= _FIELD_SETS[type(record)]:
        return dataclasses.replace(record, id=request_id)
    copy = object.__new__(type(record))
    copy.__dict__.update({name: values[name] for name in names}, id=request_id)
    return copy
