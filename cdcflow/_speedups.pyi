# The compiled decoder's interface (see _speedups.c); cdcflow.spanner.records uses it.
from collections.abc import Callable, Mapping
from typing import Any

def configure(
    loads: Callable[[Any], Any],
    parse_timestamp: Callable[[str], Any],
    numeric: Callable[[Any], Any],
    json: Callable[[Any], Any],
    decimal: type,
    json_string: type,
    mod: type,
    mod_slots: tuple[str, ...],
    record: type,
    record_slots: tuple[str, ...],
    timestamp: type,
    timestamp_slots: tuple[str, ...],
    record_bytes: int,
    entry_bytes: int,
) -> None: ...
def decode(
    token: str,
    strings: list[str],
    bools: list[bool],
    lists: list[bytes],
    planner: Callable[[str, bytes], tuple[tuple[Any, ...], Any]],
    sizes: dict[int, int] | None,
) -> list[Any] | None: ...
def decode_values(
    values: Mapping[str, Any], converters: dict[str, Callable[[Any], Any]]
) -> dict[str, Any]: ...
def configure_walk(
    no_float: tuple[type, ...],
    other: Callable[[Any], bool],
    default: Callable[[Any], Any],
    timestamp: type,
    decimal: type,
    text_slot: str,
    float_text: Callable[[float], bytes],
) -> None: ...
def non_finite(value: Any) -> bool: ...
def json_default(value: Any) -> Any: ...
def json_line(element: Any) -> bytes | None: ...
