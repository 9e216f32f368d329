"""YAML configs <-> trees of frozen dataclasses, with dotted command-line overrides.

Generic over any tree of dataclasses: a field's type annotation says how its YAML value is
checked and converted. Supported annotations: ``int``, ``float`` (ints accepted), ``bool``,
``str``, ``Literal[...]``, ``X | None`` / ``Optional[X]`` and other unions, ``tuple[X, ...]``,
``tuple[X, Y]``, ``list[X]``, ``dict[K, V]`` (``dict[str, Any]`` is a free-form mapping),
``Any``, and nested dataclasses. Every error names the dotted key it is about::

    cfg = load_config(TrainConfig, "configs/grpo.yaml", ["trainer.max_steps=10", "seed=3"])
    save_config(cfg, "runs/x/config.yaml")       # load_config reads it back to an equal object

YAML is read with one fix over PyYAML's YAML 1.1 resolver: ``1e-3`` and ``3E5`` are floats (YAML
1.1 requires a dot in the mantissa, so PyYAML would otherwise read them as strings). The same
resolver is used when writing, so a string that looks like such a float is quoted.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

_NoneType = type(None)

# YAML 1.1's float pattern plus mantissas without a dot (``1e-3``), the usual fix for PyYAML.
_FLOAT_PATTERN = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` reading ``1e-3`` as a float."""


class _Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` quoting strings that ``_Loader`` would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_PATTERN, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """Parses YAML text with safe loading (``1e-3`` is a float)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader is a SafeLoader)


def _dotted(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _check_dataclass(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"from_dict needs a dataclass type, got {cls!r}")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, path: str = "") -> T:
    """Builds a (nested) dataclass from a plain mapping, checking every value against its type.

    Keys absent from ``data`` take the dataclass defaults; nested dataclass fields recurse;
    lists become tuples for tuple-typed fields.

    Args:
      cls: a dataclass type (usually frozen).
      data: the mapping (e.g. parsed YAML); ``None`` means all defaults.
      path: dotted prefix of ``data`` within the whole config, used in error messages.

    Returns:
      An instance of ``cls``.

    Raises:
      ValueError: an unknown key (with the nearest valid key suggested), a missing required key,
        a value of the wrong type or outside its ``Literal`` choices, or a value rejected by the
        dataclass itself; the message names the dotted key.
    """
    _check_dataclass(cls)
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        where = f"config section {path!r}" if path else "the config"
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}: {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if not isinstance(key, str):
            raise ValueError(f"config keys must be strings, got {key!r} in {path or 'the config'}")
        if key not in fields:
            raise ValueError(_unknown_key_message(key, list(fields), path))
    kwargs = {}
    for name, field in fields.items():
        key = _dotted(path, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing required config key {key!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        where = f"config section {path!r}" if path else f"config {cls.__name__}"
        raise ValueError(f"invalid {where}: {err}") from err


# Keys that existed once: the message says what replaced them.
REMOVED_KEYS = {
    "model.dtype": "model.dtype was split in two: model.param_dtype (the master weights the "
    "optimizer updates, default float32) and model.compute_dtype (matmuls and activations: "
    "auto | float32 | bfloat16, default auto = bfloat16 on TPU/GPU, float32 on CPU)",
}


def _unknown_key_message(key: str, valid: list[str], path: str) -> str:
    if _dotted(path, key) in REMOVED_KEYS:
        return REMOVED_KEYS[_dotted(path, key)]
    message = f"unknown config key {_dotted(path, key)!r}"
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        return f"{message}; did you mean {_dotted(path, close[0])!r}?"
    return f"{message}; valid keys here: {', '.join(sorted(valid))}"


def _wrong_type(key: str, expected: str, value: Any) -> ValueError:
    return ValueError(
        f"config key {key!r} expects {expected}, got {type(value).__name__}: {value!r}"
    )


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Checks ``value`` against the annotation ``tp`` and converts it (lists -> tuples, ...)."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if value is None:
            raise ValueError(f"config key {key!r} expects a mapping ({tp.__name__}), got null")
        return from_dict(tp, value, path=key)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        # ``True == 1`` in Python, so the type must match as well as the value.
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError(f"config key {key!r} must be one of {args}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(args, value, key)
    if origin is tuple:
        return _convert_tuple(args, value, key)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _wrong_type(key, f"a list ({_type_name(tp)})", value)
        item_type = args[0] if args else Any
        return [_convert(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        return _convert_dict(args, value, key)
    if tp is _NoneType:
        if value is not None:
            raise _wrong_type(key, "null", value)
        return None
    return _convert_scalar(tp, value, key)


def _convert_union(args: tuple, value: Any, key: str) -> Any:
    if value is None:
        if _NoneType in args:
            return None
        raise _wrong_type(key, " | ".join(_type_name(a) for a in args), value)
    candidates = [a for a in args if a is not _NoneType]
    # An exact type match wins, so ``int | float`` keeps 3 an int.
    candidates.sort(key=lambda a: a is not type(value))
    errors = []
    for candidate in candidates:
        try:
            return _convert(candidate, value, key)
        except ValueError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    expected = " | ".join(_type_name(a) for a in args)
    raise _wrong_type(key, expected, value)


def _convert_tuple(args: tuple, value: Any, key: str) -> tuple:
    if not isinstance(value, list | tuple):
        raise _wrong_type(key, "a list", value)
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item_type = args[0] if args else Any
        return tuple(_convert(item_type, v, f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ValueError(
            f"config key {key!r} expects a list of {len(args)} items, got {len(value)}: {value!r}"
        )
    return tuple(_convert(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(args, value)))


def _convert_dict(args: tuple, value: Any, key: str) -> dict:
    if not isinstance(value, Mapping):
        raise _wrong_type(key, "a mapping", value)
    key_type, value_type = args if args else (Any, Any)
    return {
        _convert(key_type, k, f"{key} (key {k!r})"): _convert(value_type, v, _dotted(key, str(k)))
        for k, v in value.items()
    }


def _convert_scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise _wrong_type(key, "a bool (true / false)", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(key, "an int", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(key, "a float", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _wrong_type(key, "a string (quote it in YAML)", value)
        return value
    raise ValueError(f"config key {key!r} has an unsupported type annotation {_type_name(tp)}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass tree as plain YAML-able Python (dicts, lists, scalars).

    Tuples become lists; ``from_dict`` turns them back into tuples.

    Raises:
      ValueError: ``cfg`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"to_dict needs a dataclass instance, got {cfg!r}")
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Applies ``dotted.key=value`` overrides to a nested mapping (a copy; ``data`` is unchanged).

    Each value is parsed as YAML: ``true``, ``3``, ``1e-3``, ``[1, 2]``, ``null``, ``"3"`` (a
    string). Intermediate mappings are created as needed; whether the key exists is checked
    later by ``from_dict``.

    Args:
      data: the nested mapping (e.g. a parsed YAML file).
      overrides: strings ``a.b.c=value``.

    Returns:
      A new nested dict.

    Raises:
      ValueError: an override without ``=``, with an empty key segment, with unparsable YAML,
        or one that would descend into a non-mapping value.
    """
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    result = copy.deepcopy(dict(data))
    for override in overrides:
        if not isinstance(override, str) or "=" not in override:
            raise ValueError(f"malformed override {override!r}: expected dotted.key=value")
        dotted_key, text = override.split("=", 1)
        parts = dotted_key.strip().split(".")
        if any(not part for part in parts):
            raise ValueError(f"malformed override {override!r}: empty key segment")
        try:
            value = parse_yaml(text)
        except yaml.YAMLError as err:
            raise ValueError(f"override {override!r}: value is not valid YAML ({err})") from err
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                parent = ".".join(parts[: i + 1])
                raise ValueError(
                    f"override {override!r}: {parent!r} is {child!r}, not a mapping with keys"
                )
            node = child
        node[parts[-1]] = value
    return result


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Reads a YAML config (or the defaults), applies overrides and builds ``cls``.

    Args:
      cls: the root config dataclass.
      path: YAML file; ``None`` starts from ``cls``'s defaults.
      overrides: ``dotted.key=value`` strings applied after the file.

    Returns:
      An instance of ``cls``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: invalid YAML, a top level that is not a mapping, or any ``from_dict`` /
        ``apply_overrides`` error.
    """
    data: Any = {}
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {os.fspath(path)!r}")
        with open(path, encoding="utf-8") as f:
            try:
                data = parse_yaml(f.read())
            except yaml.YAMLError as err:
                raise ValueError(
                    f"config file {os.fspath(path)!r} is not valid YAML: {err}"
                ) from err
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ValueError(
                f"config file {os.fspath(path)!r} must hold a mapping at the top level, "
                f"got {type(data).__name__}"
            )
    return from_dict(cls, apply_overrides(data, list(overrides)))


def dump_yaml(cfg: Any) -> str:
    """The YAML text of a dataclass tree (keys in field order)."""
    return yaml.dump(
        to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Writes ``cfg`` as YAML that ``load_config(type(cfg), path, [])`` reads back equal.

    The file is written to a temporary name and renamed, so a reader never sees half of it.
    Parent directories are created.
    """
    text = dump_yaml(cfg)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
