"""JSON Lines shards (`.jsonl`, `.jsonl.gz`): one JSON object a line, as schedulers and databases
export them. The id and text are keys named as Parquet columns are (--id-column, --text-column).

A row is a line with something on it; a blank line (spaces, tabs, a lone CR) holds no row, and
line numbers in messages count every line. A row that cannot be read whole is that row's error
(ROW_ERROR_COLUMN), never a dropped row: a missing key, a text that is not a string, an id that
is neither a string nor an integer. A line that is not a JSON object fails its shard, naming the
file and the line, as a damaged Parquet file does: nothing of it is committed, the others are.

The row count comes from a byte scan of the newlines (C speed, no JSON parsing) when the shard is
listed: one extra read of the file, because the commit's exactly-once check, `status`, the
progress bar and the Ray engine's longest-shard-first order all need it before the shard streams.
Memory is bounded as for Parquet, by LENGTHWISE_MAX_ROW_GROUP_BYTES: a longer line fails the
shard from the count, before it is parsed, and the stream holds at most that many bytes of lines
per block, whatever the line or the gzip ratio.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.offline.footer import ROW_GROUP_BYTES_VARIABLE, max_row_group_bytes, size_text
from pipeline.offline.readers.base import ROW_ERROR_COLUMN, Columns, ShardError, ShardFacts

NAME = "JSONL"
SUFFIXES = (".jsonl.gz", ".jsonl")
IN_FOLDERS = True  # a folder's *.jsonl and *.jsonl.gz files are its shards
COUNTED_BY = "its line count"
CHUNK_BYTES = 1 << 20  # read and decompressed this much at a time
SAMPLE_LINES = 100  # the first lines' keys are the shard's columns, for the checks made when it is listed
NOT_BLANK = re.compile(rb"[^ \t\r\n]")
BLANK_LINE = re.compile(rb"^[ \t\r]*\n", re.MULTILINE)
MAYBE_BLANK = (b"\n\n", b"\n ", b"\n\t", b"\n\r")  # a chunk without these has no blank line inside it
INT64 = (-(1 << 63), (1 << 63) - 1)


def _opened(f, url: str):
    return gzip.GzipFile(fileobj=f, mode="rb") if url.endswith(".gz") else f


def _chunks(stream) -> Iterator[bytes]:
    """The (decompressed) bytes in chunks; damaged or cut gzip data is an OSError, as damaged Parquet is."""
    try:
        while chunk := stream.read(CHUNK_BYTES):
            yield chunk
    except (zlib.error, EOFError) as error:
        raise gzip.BadGzipFile(f"damaged gzip data: {error}") from error


def _too_long(url: str, line: int, limit: int) -> str:
    return (f"{url}: line {line:,} is longer than the {size_text(limit)} a line may take ({ROW_GROUP_BYTES_VARIABLE}, "
            "the limit of a Parquet row group); split that row")


def count_rows(f, url: str, columns: Columns) -> ShardFacts:
    """The rows (lines with something on them), counted from the bytes; the keys of the first lines
    as the shard's columns. A line over the limit is the shard's problem, found without holding it:
    the count stops there."""
    limit = max_row_group_bytes(os.environ)
    rows = line = open_bytes = 0  # `line`: lines ended so far; `open_bytes`: of the line not ended yet
    open_has_text = False
    head, chunks = b"", 0  # the first chunk, and how many were read

    def too_long(number: int) -> ShardFacts:
        return ShardFacts(rows, _sample_columns(head, False), _too_long(url, number, limit))

    for chunk in _chunks(_opened(f, url)):
        head = chunk if not chunks else head
        chunks += 1
        newlines = chunk.count(b"\n")
        if not newlines:
            open_bytes += len(chunk)
            open_has_text = open_has_text or NOT_BLANK.search(chunk) is not None
            if open_bytes > limit:
                return too_long(line + 1)
            continue
        first, last = chunk.index(b"\n"), chunk.rindex(b"\n")
        if open_bytes + first > limit:
            return too_long(line + 1)
        rows += open_has_text or NOT_BLANK.search(chunk, 0, first) is not None
        inside = newlines - 1  # lines wholly in this chunk
        if inside and any(marker in chunk for marker in MAYBE_BLANK):
            inside -= len(BLANK_LINE.findall(chunk, first + 1, last + 1))
        if limit < last - first:  # a limit below a chunk's size: the lines inside it are measured too
            ends = first + np.flatnonzero(np.frombuffer(chunk, np.uint8, last - first + 1, first) == ord("\n"))
            over = np.flatnonzero(np.diff(ends) - 1 > limit)
            if len(over):
                return too_long(line + 2 + int(over[0]))
        rows += inside
        line += newlines
        open_bytes = len(chunk) - last - 1
        open_has_text = NOT_BLANK.search(chunk, last + 1) is not None
        if open_bytes > limit:
            return too_long(line + 1)
    return ShardFacts(rows + open_has_text, _sample_columns(head, chunks == 1))


def _sample_columns(head: bytes, whole: bool) -> dict[str, None] | None:
    """The keys of the objects among the first lines of `head` (the file's first chunk; `whole`: all
    of it), or None when none is one: an empty file, a first line longer than a chunk, lines that are
    not JSON (the stream names them)."""
    lines = head.split(b"\n", SAMPLE_LINES)
    if len(lines) > SAMPLE_LINES or not whole:
        lines.pop()  # the rest of the chunk, or a line it cuts
    keys: dict[str, None] = {}
    found = False
    for line in lines:
        try:
            row = json.loads(line.decode("utf-8-sig"))
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            found = True
            keys.update(dict.fromkeys(row))
    return keys if found else None


def open_batches(f, url: str, columns: Columns, block_rows: int) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Record batches of the named keys, at most `block_rows` rows and (but for one long line) the
    line limit's bytes each, with ROW_ERROR_COLUMN; the schema an empty shard's batch has."""
    limit = max_row_group_bytes(os.environ)
    schema = pa.schema([(name, pa.string()) for name in columns.names])

    def batches() -> Iterator[pa.RecordBatch]:
        block = BlockBuilder(columns)
        held = 0
        for number, line in _lines(_chunks(_opened(f, url)), url, limit):
            block.add(_parse(line, url, number))
            held += len(line)
            if len(block) == block_rows or held >= limit:
                yield block.take()
                held = 0
        if len(block):
            yield block.take()

    return schema, batches()


def _lines(chunks: Iterable[bytes], url: str, limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every line with something on it; a line longer than `limit` is
    refused before more of it is held."""
    number = 0
    pieces: list[bytes] = []  # the start of a line that runs past the chunks read so far
    held = 0
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) > 1 and pieces:
            parts[0] = b"".join([*pieces, parts[0]])
            pieces, held = [], 0
        for line in parts[:-1]:
            number += 1
            if len(line) > limit:
                raise ShardError(_too_long(url, number, limit))
            if NOT_BLANK.search(line):
                yield number, line
        pieces.append(parts[-1])
        held += len(parts[-1])
        if held > limit:
            raise ShardError(_too_long(url, number + 1, limit))
    last = b"".join(pieces)
    if NOT_BLANK.search(last):
        yield number + 1, last


def _parse(line: bytes, url: str, number: int) -> dict:
    """The line's object; a line that is not one fails the shard, naming the file and the line."""
    try:
        row = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))
    except UnicodeDecodeError as error:
        raise ShardError(f"{url}: line {number:,} is not UTF-8 (byte {error.start + 1}); fix or remove that line") \
            from None
    except json.JSONDecodeError as error:
        raise ShardError(f"{url}: line {number:,} is not JSON ({error.msg}: column {error.colno}); "
                         "fix or remove that line") from None
    except RecursionError:
        raise ShardError(f"{url}: line {number:,} is not JSON this reader takes (nested too deeply); fix or remove "
                         "that line") from None
    if not isinstance(row, dict):
        raise ShardError(f"{url}: line {number:,} is a JSON {json_kind(row)}, not an object; each line must be one "
                         "object with the id and text keys")
    return row


def json_kind(value) -> str:
    """The JSON name of a parsed value's type."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


class BlockBuilder:
    """One block's rows, turned into columns: the texts as strings; the ids as strings or integers,
    as the shard's first id is (a shard's id column has one type); a kept key as its string, or
    its JSON text for any other value. A row that cannot be read whole gets an error and no texts,
    so nothing of it runs."""

    def __init__(self, columns: Columns):
        self.columns = columns
        self.id_type: pa.DataType | None = None  # from the first block's first string or integer id
        self.rows: list[dict] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def take(self) -> pa.RecordBatch:
        rows, self.rows = self.rows, []
        errors: list[str | None] = [None] * len(rows)
        id_name = self.columns.id
        ids = [row.get(id_name) for row in rows]
        if self.id_type is None:
            first = next((value for value in ids if isinstance(value, str) or _is_int64(value)), "")
            self.id_type = pa.string() if isinstance(first, str) else pa.int64()
        for position, (row, value) in enumerate(zip(rows, ids)):
            errors[position] = self._id_error(row, value)
            if errors[position] is not None:
                ids[position] = None
        arrays = {id_name: _array(ids, self.id_type, id_name, errors)}
        for name in self.columns.texts:
            if name not in arrays:
                arrays[name] = _array(self._texts(rows, name, errors), pa.string(), name, errors)
        for name in self.columns.kept:
            if name not in arrays:
                arrays[name] = _array([_kept_value(row.get(name)) for row in rows], pa.string(), name, errors)
        failed = pa.array([error is not None for error in errors], pa.bool_())
        for name in self.columns.texts:  # a row with an error runs nothing
            if name != id_name:
                arrays[name] = pc.if_else(failed, pa.scalar(None, pa.string()), arrays[name])
        arrays[ROW_ERROR_COLUMN] = pa.array(errors, pa.string())
        return pa.RecordBatch.from_pydict(arrays)

    @staticmethod
    def _texts(rows: list[dict], name: str, errors: list) -> list:
        """The rows' values of text key `name`: a string or null; a row without it, or with another
        value, gets its error."""
        values = []
        for position, row in enumerate(rows):
            value = row.get(name)
            if value is not None and not isinstance(value, str):
                errors[position] = errors[position] or f"{name!r} is a JSON {json_kind(value)}, not a string"
                value = None
            elif name not in row:
                errors[position] = errors[position] or f"line has no key {name!r}"
            values.append(value)
        return values

    def _id_error(self, row: dict, value) -> str | None:
        if self.columns.id not in row:
            return f"line has no key {self.columns.id!r}"
        if value is None:
            return None  # a null id: the run says `id is null`, as for any format
        if isinstance(value, str) or _is_int64(value):
            if (self.id_type == pa.string()) == isinstance(value, str):
                return None
            kinds = ("a string", "integers") if isinstance(value, str) else ("an integer", "strings")
            return f"id is {kinds[0]}, but this shard's ids are {kinds[1]} (as its first id is)"
        if isinstance(value, int) and not isinstance(value, bool):
            return "id is an integer beyond 64 bits"
        return f"id is a JSON {json_kind(value)}, not a string or an integer"


def _is_int64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value <= INT64[1]


def _kept_value(value) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _array(values: list, kind: pa.DataType, name: str, errors: list) -> pa.Array:
    """`values` (each None or of `kind`) as an Arrow array; a string Arrow cannot hold (a lone
    surrogate, which JSON's \\ud800 escape makes) is null and its row's error."""
    try:
        return pa.array(values, kind)
    except UnicodeEncodeError:
        kept = []
        for position, value in enumerate(values):
            if isinstance(value, str) and not _encodes(value):
                errors[position] = errors[position] or f"{name!r} is not valid Unicode (a lone surrogate)"
                value = None
            kept.append(value)
        return pa.array(kept, kind)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
