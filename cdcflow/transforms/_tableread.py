"""Reading WriteTables output back: the Arrow schema of a version's files, from its schema
file, and of a whole table (every version's columns), for pyarrow.dataset, pyarrow.csv and
DuckDB readers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import fsspec
import orjson
import pyarrow as pa

from cdcflow.transforms._tablerows import Schema, csv_columns

__all__ = ["file_schema", "table_schema"]


def file_schema(schema_file: bytes | str | Mapping[str, Any]) -> pa.Schema:
    """The Arrow schema of a table's files of one version, from its schema file
    ``<table>/_schema/v<k>.json`` (the bytes, the text or the parsed document).

    For CSV, the files' columns in order (Debezium rows flattened to ``before.<column>``,
    ``source.table``, ...) with their types: what ``pyarrow.csv.ConvertOptions(
    column_types=...)`` needs to read them typed. For Parquet, the files' own schema
    (timestamps in microseconds for a table written with ``timestamp_unit="us"``). For
    JSON lines, the types
    the JSON values stand for (timestamps are RFC 3339 text, decimals text, bytes base64).
    Raises ValueError for anything but a schema file WriteTables wrote.
    """
    if isinstance(schema_file, Mapping):
        data = orjson.dumps(dict(schema_file))
    else:
        data = schema_file.encode() if isinstance(schema_file, str) else schema_file
    try:
        doc = orjson.loads(data)
        arrow = Schema.parse(data).arrow(doc.get("rows", "flat"), doc.get("format", "parquet"),
                                         "us" if doc.get("timestamp_unit") == "us" else "ns")
    except (KeyError, TypeError, ValueError) as exc:
        msg = f"not a WriteTables schema file ({exc}); pass the contents of _schema/v<k>.json"
        raise ValueError(msg) from exc
    return pa.schema(csv_columns(arrow)) if doc.get("format") == "csv" else arrow


#: The columns a date-partitioned table's directories add (``date=YYYY-MM-DD/hour=HH``).
_PARTITIONS = {"day": [pa.field("date", pa.date32())],
               "hour": [pa.field("date", pa.date32()), pa.field("hour", pa.int32())]}


def table_schema(url: str, *, storage_options: Mapping[str, Any] | None = None) -> pa.Schema:
    """The Arrow schema of every version of a table together: ``url`` is the table's
    directory (``"lake/Orders"``, ``"s3://lake/cdc/Orders"``); the columns of its schema
    files, oldest version first, then columns later versions added, then the partition
    columns ``date`` (and ``hour``) of a table written with ``partition_by``. Pass it as
    ``pyarrow.dataset.dataset(url, schema=..., partitioning="hive")`` to read the files of
    all versions (a column a file lacks reads as null). Raises ValueError when the table
    has no schema file, or when a column changed its type between versions (read each
    version apart).
    """
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    fs.invalidate_cache()  # the versions written since this process last listed them too
    names = fs.glob(root.rstrip("/") + "/_schema/v*.json")
    found = sorted((int(m.group(1)), n) for n in names
                   if (m := re.search(r"/v(\d+)\.json$", n)))
    if not found:
        msg = f"no schema files under {url}/_schema: is it a table directory WriteTables wrote?"
        raise ValueError(msg)
    docs = [fs.cat_file(n) for _, n in found]
    schemas = [file_schema(doc) for doc in docs]
    partition_by = orjson.loads(docs[-1]).get("partition_by", "none")
    try:
        return pa.unify_schemas([*schemas, pa.schema(_PARTITIONS.get(partition_by, []))])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        msg = f"the versions of {url} do not unify ({exc}); read each version's files apart"
        raise ValueError(msg) from exc
