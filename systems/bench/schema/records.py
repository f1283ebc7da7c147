"""Typed records: a benchmark's point and measurements as JSON, and back, with every field checked.

A record is a dataclass's fields by name, each value in its JSON form: a Precision by its name, a
Checkpointing or a choice (a StrEnum) by its text, a nested dataclass as a record, tuples as lists. Reading one
back converts each value to its field's declared type and refuses what does not fit: a missing field, a field
the dataclass does not have (a history saved by a newer schema), a value of another type. A field named after a
Python keyword carries a trailing underscore (`pass_`); its key is the word.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing

from systems.levers.checkpointing import Checkpointing
from systems.precision import Precision, get_precision

# The version of the histories this code writes and reads; 3 added the fused kernels and regional compilation to the
# full-step and checkpointing points, 4 to the leaderboard's, and at 5 training points hold their TrainSpec
# (systems.bench.migrate rewrites older histories).
SCHEMA = 5


class SchemaError(ValueError):
    """A record that is not what its kind declares."""


class NewerSchema(SchemaError):
    """A record with kinds or fields this code does not know: saved by a newer systems-lab."""


def check_schema(history: dict) -> None:
    """A history of ours names the schema it was saved with: an older one (or none) is migrated once, a newer one
    needs newer code. A plain pytest-benchmark history names none and has nothing to check."""
    schema = history.get("systems_lab_schema")
    ours = schema is not None or "systems_lab" in (history.get("machine_info") or {})
    if not ours or schema == SCHEMA:
        return
    if schema is None or (isinstance(schema, int) and schema < SCHEMA):
        saved = "before the benchmark schema" if schema is None else f"with schema {schema}"
        raise SchemaError(f"saved {saved} (this code reads {SCHEMA}); migrate it once with "
                          "`python -m systems.bench.migrate FILE`")
    raise NewerSchema(f"saved with schema {schema!r} (this code reads {SCHEMA}): a newer schema? update systems-lab")


def to_record(value):
    """The JSON form of a dataclass, or of one of its field values."""
    if isinstance(value, Precision):
        return value.name
    if isinstance(value, (Checkpointing, enum.Enum)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {_key(f): to_record(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_record(item) for item in value]
    if isinstance(value, dict):
        return {key: to_record(item) for key, item in value.items()}
    return value


def from_record(cls: type, record, where: str = ""):
    """The dataclass `cls` from its record, each field converted to its declared type."""
    where = where or cls.__name__
    if not isinstance(record, dict):
        raise SchemaError(f"{where}: a record of {cls.__name__} is a JSON object, got {record!r}")
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(record.keys() - fields.keys())
    if unknown:
        raise NewerSchema(f"{where}: unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                          f"(saved by a newer schema?)")
    missing = sorted(fields.keys() - record.keys())
    if missing:
        raise SchemaError(f"{where}: missing field{'s' * (len(missing) > 1)} {', '.join(missing)}")
    hints = _hints(cls)
    return cls(**{f.name: _typed(hints[f.name], record[key], f"{where}.{key}") for key, f in fields.items()})


def _key(field: dataclasses.Field) -> str:
    return field.name.removesuffix("_")


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _typed(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise SchemaError(f"{where}: null where {hint} is needed")
        (hint,) = [arg for arg in args if arg is not type(None)]
        return _typed(hint, value, where)
    if value is None:
        raise SchemaError(f"{where}: null where {getattr(hint, '__name__', hint)} is needed")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: a list is needed, got {value!r}")
        items = [_typed(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: an object is needed, got {value!r}")
        return {key: _typed(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if dataclasses.is_dataclass(hint) and hint not in (Precision, Checkpointing):
        return from_record(hint, value, where)
    try:
        return _scalar(hint, value)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"{where}: {exc}") from None


def _scalar(hint, value):
    if hint is Precision:
        return get_precision(value)
    if hint is Checkpointing:
        return Checkpointing.parse(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is dict and isinstance(value, dict):
        return value
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise TypeError(f"{value!r} is not a {hint.__name__}")
    return value
