"""How settings resolve into one ``BenchmarkConfig``: one CLI flag per field, TOML presets and files.

Precedence (the MLPerf rule): field defaults < preset TOML < ``--config`` TOML < CLI flags.
Every field is validated against the range or choices in its metadata; an error names the
field, the bad value and what is allowed. ``load_config`` returns a frozen ``BenchmarkConfig``
that callers pass down explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any, Callable

from dlrmv4.config import SECTIONS, SYNTHETIC_SIZES, YAMBDA_SIZES, BenchmarkConfig
from dlrmv4.errors import UserError, one_line

PRESET_DIR = Path(__file__).parent / "configs"
DEFAULT_PRESET = "synthetic-tiny"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _section_fields() -> list[tuple[str | None, dataclasses.Field]]:
    out: list[tuple[str | None, dataclasses.Field]] = []
    for f in dataclasses.fields(BenchmarkConfig):
        if f.name in SECTIONS:
            out.extend((f.name, sf) for sf in dataclasses.fields(SECTIONS[f.name]))
        else:
            out.append((None, f))
    return out


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One typed flag per config field (flat names, unique across sections)."""
    parser.add_argument(
        "--preset", default=DEFAULT_PRESET, help=f"named preset from {PRESET_DIR.name}/ (default {DEFAULT_PRESET})"
    )
    parser.add_argument("--config", default=None, help="TOML file applied on top of the preset")
    group = parser.add_argument_group("configuration (CLI wins over files)")
    for section, f in _section_fields():
        parsers: dict[type, Callable[[str], Any]] = {int: int, float: float, str: str, bool: _parse_bool}
        kind = parsers[_field_type(f)]
        meta = f.metadata
        extra = f" [{meta['min']}..{meta['max']}]" if meta.get("min") is not None else ""
        group.add_argument(
            _flag(f.name),
            dest=f"cfg__{section or ''}__{f.name}",
            type=kind,
            default=None,
            metavar=_field_type(f).__name__.upper(),
            help=f"{meta.get('help', '')}{extra} ({section or 'run'})",
        )


def _field_type(f: dataclasses.Field) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool}[
        f.type if isinstance(f.type, str) else f.type.__name__
    ]


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist")
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {one_line(exc)}")


def _merge_toml(values: dict[tuple[str | None, str], Any], data: dict[str, Any], origin: str) -> None:
    known = {(s, f.name) for s, f in _section_fields()}
    for key, val in data.items():
        if key in SECTIONS:
            if not isinstance(val, dict):
                raise UserError(f"{origin}: [{key}] must be a table")
            for sub, subval in val.items():
                if (key, sub) not in known:
                    raise UserError(f"{origin}: unknown key {key}.{sub}")
                values[(key, sub)] = subval
        elif (None, key) in known:
            values[(None, key)] = val
        else:
            raise UserError(f"{origin}: unknown key {key}")


def _check(section: str | None, f: dataclasses.Field, value: Any) -> Any:
    name = f"{section}.{f.name}" if section else f.name
    want = _field_type(f)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise UserError(f"config field {name} must be {want.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every range check
        raise UserError(f"config field {name}={value} must be a finite number")
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise UserError(f"config field {name}={value!r} is not one of {', '.join(map(str, meta['choices']))}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise UserError(
            f"config field {name}={value} is outside the allowed range "
            f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        )
    return value


def build_config(values: dict[tuple[str | None, str], Any]) -> BenchmarkConfig:
    """Validated config from (section, field) -> value; missing fields keep their defaults."""
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    top: dict[str, Any] = {}
    fields_by_key = {(s, f.name): f for s, f in _section_fields()}
    for (section, name), value in values.items():
        checked = _check(section, fields_by_key[(section, name)], value)
        (sections[section] if section else top)[name] = checked
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name not in sections[section]:
                _check(section, f, f.default)
    cfg = BenchmarkConfig(**top, **{s: SECTIONS[s](**kv) for s, kv in sections.items()})
    validate_relations(cfg)
    return cfg


def validate_relations(cfg: BenchmarkConfig) -> None:
    ds = cfg.dataset
    allowed = YAMBDA_SIZES if ds.source == "yambda" else SYNTHETIC_SIZES
    if ds.size not in allowed:
        raise UserError(
            f"config field dataset.size={ds.size!r} is not valid for source {ds.source!r}; "
            f"choose one of {', '.join(allowed)}"
        )
    if cfg.model.num_position_buckets < cfg.sampler.max_seq_len:
        raise UserError(
            f"config field model.num_position_buckets={cfg.model.num_position_buckets} must be at least "
            f"sampler.max_seq_len={cfg.sampler.max_seq_len} (one position per token)"
        )
    if cfg.sampler.per_pool_length < 1:
        raise UserError(
            f"config field sampler.max_seq_len={cfg.sampler.max_seq_len} leaves no history "
            "(needs at least 12: 9 reserved tokens + 3 pools)"
        )


def load_config(
    preset: str | None = DEFAULT_PRESET,
    config_file: str | None = None,
    overrides: dict[tuple[str | None, str], Any] | None = None,
) -> BenchmarkConfig:
    values: dict[tuple[str | None, str], Any] = {}
    if preset:
        path = PRESET_DIR / f"{preset}.toml"
        if not path.exists():
            raise UserError(f"unknown preset {preset!r}; available: {', '.join(list_presets())}")
        _merge_toml(values, _read_toml(path), f"preset {preset}")
    if config_file:
        _merge_toml(values, _read_toml(Path(config_file)), str(config_file))
    values.update(overrides or {})
    return build_config(values)


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    overrides: dict[tuple[str | None, str], Any] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__", 2)
            overrides[(section or None, name)] = value
    return load_config(args.preset, args.config, overrides)


def to_dict(cfg: BenchmarkConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: BenchmarkConfig) -> str:
    lines: list[str] = []
    data = to_dict(cfg)
    for key, val in data.items():
        if not isinstance(val, dict):
            lines.append(f"{key} = {_toml_value(val)}")
    for key, val in data.items():
        if isinstance(val, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in val.items())
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)
