"""Recipe configs: a YAML file plus ``key=value`` overrides, validated into a frozen dataclass.

An unknown key or a value of the wrong type is a one-line error that names the key, e.g.
``mnft.recipes: config key 'lr_typo' unknown (did you mean 'lr'?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mnft.core import limits, yamlfile
from mnft.core.errors import InputError, MnftError

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(InputError):
    """A bad config file, key or value (exit code 2)."""


class RecipeError(MnftError):
    """An expected failure while training (exit code 1): printed as one line."""


@dataclass(frozen=True)
class TrainConfig:
    # model and data
    model: str = "tiny"  # "tiny" (built locally, cached) or a local directory with config.json + weights
    model_cache_dir: str | None = None  # where "tiny" is built; default $XDG_CACHE_HOME/mnft/models
    model_dtype: str = "auto"  # auto | float32 | bfloat16 (dtype the base weights are loaded in)
    data_path: str | None = None  # JSONL with instruction/response; default: the bundled dataset
    max_seq_len: int = 128
    packing: bool = False
    # run
    output_dir: str = "runs/{recipe}"  # may contain {recipe}, {rank}, {node_rank} (no shared filesystem)
    resume: str = "none"  # none (also null) | latest | PATH to a checkpoints/step-N directory
    overwrite: bool = False  # resume=none in an output_dir holding checkpoints: delete them instead of refusing
    max_steps: int = 60
    seed: int = 0
    # optimisation
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = False
    max_consecutive_skips: int = 5  # abort after this many non-finite steps in a row
    # checkpoints and logging
    save_every: int = 0  # 0: never (only the final export)
    keep_last: int = 2
    save_final: bool = True
    log_every: int = 1
    tensorboard: bool = True  # used only when the tensorboard package is installed
    # fault injection, for tests: the last rank's loss is NaN / one of its gradients is inf at these steps;
    # every rank exits hard after a step; every rank's parameter checksum goes into each metrics line
    debug_nan_steps: list[int] = field(default_factory=list)
    debug_inf_grad_steps: list[int] = field(default_factory=list)
    debug_crash_after_step: int = 0
    debug_rank_checksums: bool = False
    debug_sample_ids: bool = False  # every rank's dataset row ids of the step go into each metrics line


@dataclass(frozen=True)
class LoraConfig(TrainConfig):
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    export_merged: bool = False  # also write output_dir/merged: base + adapters merged, loadable without PEFT


@dataclass(frozen=True)
class FullConfig(TrainConfig):
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (less memory, more comms)


SCHEMAS = {"lora": LoraConfig, "full": FullConfig}
CHOICES = {
    "model_dtype": ("auto", "float32", "bfloat16"),
    "mixed_precision": ("auto", "bf16", "fp32"),
}


def _coerce(key: str, value: object, tp: object) -> object:
    """Coerce a YAML or command-line value to the field type; raise ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):  # "X | None"
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and value.strip().startswith("["):
            try:  # a --set value (one argument: the OS bounds it) or a config's string: aliases stay shared objects
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"config key '{key}' expects a list like [a, b], got {limits.shown(value)} "
                                  f"({str(e).splitlines()[0]})") from None
            except RecursionError:  # [[[[… nested past Python's recursion limit
                raise ConfigError(f"config key '{key}' expects a list like [a, b], got {limits.shown(value)} (nested too deep)") from None
        elif isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1", "on"):
                return True
            if str(value).lower() in ("false", "no", "0", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):
                raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
            return number
        if tp is str:
            if value is None or isinstance(value, (dict, list)):  # YAML null is not the string "None"
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"unsupported config type {tp!r}")
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"config key '{key}' expects {'an' if name[0] in 'aeiou' else 'a'} {name}, got {value!r}")


def _check_values(cfg: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")
    positive = ["max_steps", "micro_batch_size", "grad_accum_steps", "max_seq_len", "log_every", "keep_last",
                "max_consecutive_skips"]
    positive += ["lora_rank"] if isinstance(cfg, LoraConfig) else []
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(cfg, key)!r}")
    for key in ("lr", "warmup_steps", "weight_decay", "max_grad_norm", "save_every", "min_lr_ratio"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {getattr(cfg, key)!r}")
    if len(cfg.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.adam_betas):
        raise ConfigError(f"config key 'adam_betas' expects two floats in [0, 1), got {cfg.adam_betas!r}")
    if cfg.overwrite and cfg.resume != "none":
        raise ConfigError(f"config key 'overwrite' deletes checkpoints before a fresh run: it needs resume=none, "
                          f"got resume={cfg.resume}")
    if isinstance(cfg, LoraConfig) and not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"config key 'lora_dropout' must be in [0, 1), got {cfg.lora_dropout!r}")
    if isinstance(cfg, LoraConfig) and not cfg.lora_target_modules:
        raise ConfigError("config key 'lora_target_modules' must name at least one module")


def load_config(recipe: str, argv: list[str]) -> TrainConfig:
    """Build the config of ``recipe`` from ``[config=PATH] key=value ...`` (the command line after -m)."""
    schema = SCHEMAS[recipe]
    fields = typing.get_type_hints(schema)  # name -> type (annotations are strings under __future__)
    path = CONFIG_DIR / f"{recipe}.yaml"
    overrides: list[tuple[str, str]] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {arg!r} is not key=value")
        if key == "config":
            path = Path(value)
        else:
            overrides.append((key, value))
    try:  # within mnft's limits of input (size, lines, nesting, aliases: mnft.core.yamlfile), as a job file
        raw = yamlfile.load(yamlfile.read_text(path, "config file", "config=PATH"), str(path)) or {}
    except InputError as e:
        raise ConfigError(f"config file {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of key: value")
    values = {}
    for key, value in list(raw.items()) + overrides:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1) or sorted(
                (f for f in fields if str(key).startswith(f) or f.startswith(str(key))), key=len, reverse=True)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"config key '{key}' unknown{hint}")
        if key == "resume" and (value is None or str(value).strip().lower() in ("none", "null", "~", "")):
            value = "none"  # `resume=null` / `resume:` mean no resume, not a directory named "null"
        values[key] = _coerce(key, value, fields[key])
    cfg = schema(**values)
    _check_values(cfg)
    return cfg


def config_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
