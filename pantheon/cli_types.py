"""What the text of each command-line flag may be: argparse `type=` parsers, each refusing with
a line that says what it takes (cli.py turns it into one line on stderr and exit code 2)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None


def non_negative_float(text: str) -> float:
    value = number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def unit_float(text: str) -> float:
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def fraction(text: str) -> float:
    value = number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def finite_float(text: str) -> float:
    value = number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def n_predict(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value == 0 or value < -1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or -1 (to the window), got {text!r}")
    return value


def reasoning_budget(text: str) -> int:
    return 0 if text.strip() == "-1" else non_negative_int(text)  # llama-server's -1: unrestricted


def gguf_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value}")
    return value


def int_list(text: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8]; [] when any item is not an integer."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return []


def levels(text: str) -> str:
    levels = int_list(text)
    if not levels or min(levels) <= 0:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, e.g. 1,4,8; got {text!r}")
    return text


def dies(text: str) -> str:
    dies = int_list(text)
    if not dies or min(dies) < 0:
        raise argparse.ArgumentTypeError(f"takes comma-separated device ordinals, e.g. 0,1; got {text!r}")
    return text


def json_object(text: str) -> dict:
    """A JSON object's text, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}', got {text!r:.60}")
    return value


def cache_mib(text: str) -> int:
    """MiB, llama-server's --cache-ram: -1 no limit, 0 off."""
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < -1:
        raise argparse.ArgumentTypeError(f"must be MiB, -1 (no limit) or 0 (off), got {text!r}")
    return value
