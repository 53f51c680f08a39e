"""Typed configuration: frozen dataclasses, read from TOML, overridden by ``key=value`` strings.

A config is a (nested) frozen dataclass whose fields are ``bool``, ``int``, ``float``, ``str``,
``Literal[...]`` choices, ``X | None``, ``tuple[X, ...]`` or another such dataclass (a TOML
table). ``load_config(Cls, toml_path, ["train.lr=3e-4", ...])`` starts from ``Cls()``'s
defaults, applies the file, then the overrides, in that order. Every mistake is a
``ConfigError`` that names the key and says what is valid: an unknown key lists the keys of its
table (with a "did you mean"), a bad value names the expected type or the allowed choices.
Nothing is modified in place, so a rejected override leaves the config as it was.

Override values are TOML values (``3e-4``, ``true``, ``"text"``, ``[1, 2]``); a value that is
not valid TOML is taken as a bare string, so ``mode=async`` works without quotes. A ``float``
field takes finite numbers only (``nan`` and ``inf`` would pass every range check written as
``x < 0``). A table with
a ``name`` key takes a plain value as its name: ``task=lookup`` is ``task.name=lookup``.
``to_toml(cfg)`` writes a config back (``None`` fields are left out: they mean "default").
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import tomli_w

from asyncflow_core.contracts.errors import ConfigError

T = TypeVar("T")


def read_toml(toml_path: str | Path) -> dict[str, Any]:
    """The TOML file's tables; ``ConfigError`` naming the file when it cannot be read, is not
    UTF-8 or is not valid TOML."""
    path = Path(toml_path)
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
    except RecursionError:
        raise ConfigError(
            f"config file {str(path)!r} nests arrays or tables too deeply to read"
        ) from None


def load_config(
    cls: type[T],
    toml_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    retired: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
) -> T:
    """``cls()`` updated by the TOML file (if any) and then by each ``key=value`` override.
    Each override is checked as it is applied (its section's ``validate``, with the override
    named in the error); the whole config's ``validate`` runs once, after the last one, so
    settings that depend on each other may come in any order. ``retired``: dotted keys ``cls``
    no longer has, with the value they had by default; a file that holds one of them at that
    value (written by an older version, which wrote every key) loads without it. ``data``: the
    file's tables, already read (``read_toml``), in place of reading ``toml_path`` (which then
    only names it in errors)."""
    cfg = cls()
    if data is None and toml_path is not None:
        data = read_toml(toml_path)
    if data is not None:
        if retired:
            data = without_retired(data, retired, known=set(keys(cfg)))
        cfg = merge(cfg, data, where="" if toml_path is None else f"{Path(toml_path).name}: ")
    if not overrides:
        return cfg
    for item in overrides:
        cfg = apply_override(cfg, item, check=False)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def without_retired(
    data: Mapping[str, Any],
    retired: Mapping[str, Any],
    *,
    known: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """A copy of nested ``data`` without the ``retired`` keys (dotted) that hold their retired
    value and are not ``known``; tables left empty go too."""

    def strip(node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in node.items():
            full = f"{prefix}{k}"
            if isinstance(v, Mapping):
                inner = strip(v, f"{full}.")
                if inner or not v:
                    out[k] = inner
            elif not (full in retired and full not in known and _same(retired[full], v)):
                out[k] = v
        return out

    return strip(data, "")


def _same(a: Any, b: Any) -> bool:
    """Equal and of one kind (``False`` is not ``0``; ``30`` is ``30.0``)."""
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return bool(a == b)
    return type(a) is type(b) and a == b


def merge(cfg: T, data: Mapping[str, Any], *, where: str = "") -> T:
    """A copy of ``cfg`` with the keys of ``data`` (nested mappings for nested tables) set."""
    return _merge(cfg, data, prefix="", where=where)


def apply_override(cfg: T, item: str, *, check: bool = True) -> T:
    """A copy of ``cfg`` with one ``dotted.key=value`` override applied (``check=False``:
    without the top level's ``validate``, for a caller that validates once at the end)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {item!r} is not of the form key=value (e.g. train.lr=3e-4); keys: "
            f"{', '.join(keys(cfg))}"
        )
    value = _parse_value(text.strip())
    data: dict[str, Any] = {}
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return _merge(cfg, data, prefix="", where=f"--set {item}: ", check=check)


def keys(cfg: object, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config, e.g. ``["rl.steps", "train.lr", ...]``."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += keys(value, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def to_dict(cfg: object) -> dict[str, Any]:
    """The config as nested plain dicts (tuples become lists; ``None`` fields left out)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def to_toml(cfg: object) -> str:
    """The config as TOML text that ``load_config`` reads back to an equal config."""
    return tomli_w.dumps(to_dict(cfg))


# --------------------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string
    except RecursionError:
        raise ConfigError(f"override value {text[:40]!r}... nests too deeply to read") from None
    if list(parsed) != ["v"]:  # "1\nseed = 3" would set a second key: it is one string
        return text
    return parsed["v"]


def _merge(cfg: T, data: Mapping[str, Any], *, prefix: str, where: str, check: bool = True) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}{prefix.rstrip('.') or 'the config'} is a table; got {data!r}, expected "
            f"keys {', '.join(f.name for f in dataclasses.fields(cfg))}"
        )
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for name, value in data.items():
        full = f"{prefix}{name}"
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            valid = ", ".join(f"{prefix}{n}" for n in sorted(names))
            raise ConfigError(f"{where}unknown key {full!r}{hint}; valid keys here: {valid}")
        current = getattr(cfg, name)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            if not isinstance(value, Mapping) and "name" in {
                f.name for f in dataclasses.fields(current)
            }:
                value = {"name": value}  # `task=lookup` is short for `task.name=lookup`
            changes[name] = _merge(current, value, prefix=f"{full}.", where=where)
        else:
            changes[name] = _coerce(value, hints[name], full, where)
    out = dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
    validate = getattr(out, "validate", None)
    if check and callable(validate):
        try:
            validate()
        except ConfigError as e:  # the same kind of error (a PlatformError, say), placed
            raise type(e)(f"{where}{e}") from None
    return out


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """``value`` checked (and converted where lossless) against the field type ``tp``."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}{key} must be {expected}, got {value!r}")

    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise bad(f"one of {', '.join(repr(c) for c in choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key, where)
            except ConfigError as e:
                errors.append(e)
        names = " or ".join(_type_name(o) if o is not type(None) else "none" for o in options)
        raise bad(names)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple):
            raise bad(f"a list of {_type_name(args[0]) if args else 'values'}")
        inner = args[0] if args else Any
        return tuple(
            v if inner is Any else _coerce(v, inner, f"{key}[{i}]", where)
            for i, v in enumerate(value)
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond float's range
                raise bad("a finite number") from None
            if math.isfinite(number):
                return number
            raise bad("a finite number")
        raise bad("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if tp is Any:
        return value
    raise ConfigError(f"{where}{key}: fields of type {_type_name(tp)} cannot be set from a config")


__all__ = ["apply_override", "keys", "load_config", "merge", "read_toml", "to_dict", "to_toml"]
