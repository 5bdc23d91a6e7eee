"""The command line's flags made from the configs' fields (paxkv.config.option), and the configs read back.

Adding a field to EngineConfig or LoadConfig adds its flag, with the field's default and help: there is no
second list of defaults, enums or names to keep in step.
"""

import dataclasses
import re
import types
import typing

from absl import flags

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}
_SIZE_UNITS.update({"g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40})


def parse_memory_size(text: str) -> int:
    """Bytes from a size such as "512MiB", "2GiB", "1.5G" or "1000000".

    Args:
      text: a number with an optional unit (B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB; case-insensitive).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 512MiB, 2GiB or a byte count")
    try:
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    except OverflowError:
        raise ValueError(f"memory size {text!r} is too large") from None
    if size < 1:
        raise ValueError(f"memory size {text!r} is not positive")
    return size


def format_memory_size(num_bytes: int) -> str:
    """The shortest exact binary size for a byte count: 1073741824 -> "1GiB", 1000 -> "1000"."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or field.name


def _base_type(annotation):
    """int for `int | None`, str for `str | dict | None`: the type a flag's text is read as."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def define_flags(config_class, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Define one absl flag per field of `config_class` (a dataclass of paxkv.config.option fields).

    Args:
      config_class: EngineConfig or LoadConfig.
      flag_values: where to define them.
    """
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.metadata.get("nested"):
            define_flags(field.metadata["nested"], flag_values)
            continue
        name, help_text, kind = _flag_name(field), field.metadata["help"], field.metadata.get("kind")
        base = _base_type(hints[field.name])
        if kind == "negated":
            flags.DEFINE_bool(name, not field.default, help_text, flag_values=flag_values)
        elif kind == "memory":
            flags.DEFINE_string(name, format_memory_size(field.default), help_text, flag_values=flag_values)
        elif field.metadata.get("choices"):
            flags.DEFINE_enum(name, field.default, list(field.metadata["choices"]), help_text, flag_values=flag_values)
        elif base is bool:
            flags.DEFINE_bool(name, field.default, help_text, flag_values=flag_values)
        elif base is int:
            flags.DEFINE_integer(name, field.default, help_text, flag_values=flag_values)
        elif base is float:
            flags.DEFINE_float(name, field.default, help_text, flag_values=flag_values)
        else:
            flags.DEFINE_string(name, field.default, help_text, flag_values=flag_values)


def config_from_flags(config_class, flag_values: flags.FlagValues = flags.FLAGS):
    """The `config_class` the flags describe; ValueError (naming the flag) when one cannot be read or is invalid.

    Args:
      config_class: EngineConfig or LoadConfig.
      flag_values: the parsed flags.
    """
    values = {}
    for field in dataclasses.fields(config_class):
        if field.metadata.get("nested"):
            values[field.name] = config_from_flags(field.metadata["nested"], flag_values)
            continue
        name, kind = _flag_name(field), field.metadata.get("kind")
        value = flag_values[name].value
        if kind == "negated":
            value = not value
        elif kind == "memory":
            try:
                value = 0 if value.strip() == "0" else parse_memory_size(value)
            except ValueError as e:
                raise ValueError(f"--{name}: {e}") from None
        values[field.name] = value
    return config_class(**values)
