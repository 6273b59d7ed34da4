"""Rewriting a Parquet file's footer, to make files whose footer lies (tests only).

The footer is a Thrift compact-protocol `FileMetaData` between the data and the trailing
`<length> PAR1`. This decodes it into nested lists, lets a test change a field, and writes it
back: the data pages stay byte for byte, only what the footer claims changes. Field ids are
parquet.thrift's: FileMetaData 3 num_rows, 4 row_groups; RowGroup 1 columns, 3 num_rows;
ColumnChunk 3 meta_data; ColumnMetaData 5 num_values, 6 total_uncompressed_size.
"""

from __future__ import annotations

import struct
from pathlib import Path

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
FILE_NUM_ROWS, FILE_ROW_GROUPS = 3, 4
GROUP_COLUMNS, GROUP_NUM_ROWS = 1, 3
CHUNK_META_DATA = 3
META_NUM_VALUES, META_UNCOMPRESSED = 5, 6


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        self.at += 1
        return self.data[self.at - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int):
        if kind in (TRUE, FALSE):
            return kind == TRUE
        if kind == BYTE:
            return self.byte()
        if kind in (I16, I32, I64):
            return self.zigzag()
        if kind == DOUBLE:
            self.at += 8
            return struct.unpack("<d", self.data[self.at - 8:self.at])[0]
        if kind == BINARY:
            n = self.varint()
            self.at += n
            return self.data[self.at - n:self.at]
        if kind in (LIST, SET):
            header = self.byte()
            size, element = header >> 4, header & 0x0F
            if size == 15:
                size = self.varint()
            return [element, [self.value(BYTE if element in (TRUE, FALSE) else element) for _ in range(size)]]
        if kind == MAP:
            size = self.varint()
            types = self.byte() if size else 0
            return [types, [(self.value(types >> 4), self.value(types & 0x0F)) for _ in range(size)]]
        if kind == STRUCT:
            fields, last = [], 0
            while True:
                header = self.byte()
                if header == STOP:
                    return fields
                delta, field_kind = header >> 4, header & 0x0F
                last = last + delta if delta else self.zigzag()
                fields.append([last, field_kind, self.value(field_kind)])
        raise ValueError(f"unknown thrift type {kind}")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            return bytes(out + bytes([n]))
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _encode(kind: int, value) -> bytes:
    if kind in (TRUE, FALSE):
        return b""  # a struct field's bool is in its header
    if kind == BYTE:
        return bytes([value])
    if kind in (I16, I32, I64):
        return _zigzag(value)
    if kind == DOUBLE:
        return struct.pack("<d", value)
    if kind == BINARY:
        return _varint(len(value)) + value
    if kind in (LIST, SET):
        element, items = value
        size = len(items)
        head = bytes([(size << 4) | element]) if size < 15 else bytes([0xF0 | element]) + _varint(size)
        return head + b"".join(_encode(BYTE if element in (TRUE, FALSE) else element, item) for item in items)
    if kind == MAP:
        types, items = value
        return _varint(len(items)) + (bytes([types]) if items else b"") + b"".join(
            _encode(types >> 4, k) + _encode(types & 0x0F, v) for k, v in items)
    if kind == STRUCT:
        out, last = bytearray(), 0
        for field_id, field_kind, field_value in value:
            field_kind = (TRUE if field_value else FALSE) if field_kind in (TRUE, FALSE) else field_kind
            delta = field_id - last
            out += bytes([(delta << 4) | field_kind]) if 0 < delta <= 15 else bytes([field_kind]) + _zigzag(field_id)
            out += _encode(field_kind, field_value)
            last = field_id
        return bytes(out + bytes([STOP]))
    raise ValueError(f"unknown thrift type {kind}")


def field(fields: list, field_id: int) -> list:
    """The [id, type, value] entry of `field_id` in a decoded struct."""
    return next(entry for entry in fields if entry[0] == field_id)


def read_footer(path: Path) -> tuple[bytes, list]:
    """(the file's bytes before the footer, its FileMetaData decoded)."""
    data = path.read_bytes()
    assert data[-4:] == b"PAR1"
    length = struct.unpack("<I", data[-8:-4])[0]
    return data[:-8 - length], _Reader(data[-8 - length:-8]).value(STRUCT)


def write_footer(path: Path, body: bytes, metadata: list) -> None:
    footer = _encode(STRUCT, metadata)
    path.write_bytes(body + footer + struct.pack("<I", len(footer)) + b"PAR1")


def set_file_num_rows(path: Path, num_rows: int) -> None:
    body, metadata = read_footer(path)
    field(metadata, FILE_NUM_ROWS)[2] = num_rows
    write_footer(path, body, metadata)


def set_row_group_num_rows(path: Path, group: int, num_rows: int, also_file: bool = True) -> None:
    """A row group's num_rows (and, when `also_file`, the file's to match: a consistent lie)."""
    body, metadata = read_footer(path)
    groups = field(metadata, FILE_ROW_GROUPS)[2][1]
    entry = field(groups[group], GROUP_NUM_ROWS)
    if also_file:
        field(metadata, FILE_NUM_ROWS)[2] += num_rows - entry[2]
    entry[2] = num_rows
    write_footer(path, body, metadata)


def set_column_chunk(path: Path, group: int, column: int, field_id: int, value: int) -> None:
    """One field of a column chunk's ColumnMetaData (META_NUM_VALUES, META_UNCOMPRESSED)."""
    body, metadata = read_footer(path)
    groups = field(metadata, FILE_ROW_GROUPS)[2][1]
    chunk = field(groups[group], GROUP_COLUMNS)[2][1][column]
    field(field(chunk, CHUNK_META_DATA)[2], field_id)[2] = value
    write_footer(path, body, metadata)
