"""The command line's values: argument types that refuse bad text with the fix, and a
run's typed options from its flags and ``--set`` pairs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cdcflow.durations import parse_duration, parse_size
from cdcflow.errors import PipelineDefinitionError, UserInputError
from cdcflow.launch import LATENCY_PRESETS, OptionSpec

__all__ = ["convert", "duration", "key_value", "port", "positive_int", "run_options"]


def duration(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds < 0:
        msg = f"{text!r} is negative; give a duration such as 30s"
        raise argparse.ArgumentTypeError(msg)
    return seconds


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"{text!r} is not a positive whole number"
        raise argparse.ArgumentTypeError(msg)
    return value


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        msg = f"{text!r} is not key=value"
        raise argparse.ArgumentTypeError(msg)
    return key.strip(), value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        msg = f"{text!r} is not a port: give 1 to 65535, or 0 for a free one"
        raise argparse.ArgumentTypeError(msg)
    return value


# --master and --conf have flags of their own; --set does not take them.
_FLAG_ONLY = ("master", "conf")
_WORDS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def convert(key: str, text: str, spec: OptionSpec) -> Any:
    """Turn ``--set`` text into the option's type (durations become seconds)."""
    word = text.strip().lower()
    if spec.optional and word in ("none", ""):
        return None
    try:
        if spec.kind == "bool":
            return _WORDS[word]
        if spec.kind == "duration":
            return parse_duration(text)
        if spec.kind == "size":
            return parse_size(text)
        if spec.kind == "int":
            return int(text)
    except (KeyError, ValueError, PipelineDefinitionError):
        msg = f"--set {key}={text}: {key} takes {spec.describe()}"
        raise UserInputError(msg) from None
    if spec.kind == "any":  # a plugin runner's parameter without a type: read it as Python
        return _literal(text)
    return text


def _literal(text: str) -> Any:
    """``text`` as the number, True/False or None it spells, else the text itself."""
    word = text.strip()
    if word in ("True", "true"):
        return True
    if word in ("False", "false"):
        return False
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            continue
    return text


def run_options(
    args: argparse.Namespace, specs: dict[str, OptionSpec], runner_name: str, base: Path
) -> dict[str, Any]:
    """The typed keyword options of a run, from the flags and ``--set`` pairs."""
    settable = {k: s for k, s in specs.items() if k not in _FLAG_ONLY}
    options: dict[str, Any] = {}
    for key, text in args.settings:
        key = key.replace("-", "_")
        spec = settable.get(key)
        if spec is None:
            valid = sorted(set(settable) - {"base_dir"})
            msg = (
                f"--set {key}: unknown option for the {runner_name} runner; valid keys: "
                f"{', '.join(valid)}"
            )
            raise UserInputError(msg)
        options[key] = convert(key, text, spec)
    for flag in ("duration", "max_batches", "batch_interval"):
        value = getattr(args, flag)
        if value is not None:
            options[flag] = value
    for flag in ("reset", "takeover", "strict"):
        if getattr(args, flag):
            options[flag] = True
    for key, value in LATENCY_PRESETS.get(args.latency or "", {}).items():
        options.setdefault(key, value)
    options.setdefault("base_dir", str(base))  # relative sink paths: next to the file
    for flag in _FLAG_ONLY:
        value = getattr(args, flag)
        if not value:
            continue
        if flag not in specs:
            msg = f"--{flag} applies to the spark runner, not {runner_name}; drop it or use " \
                  "--runner spark"
            raise UserInputError(msg)
        options[flag] = dict(value) if flag == "conf" else value
    return options
