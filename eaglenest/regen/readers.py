"""Incremental readers for source files: one record at a time, and damage reported instead of raised.

Public dumps are large (a 125 MB ShareGPT array) and often damaged (a truncated download). Parsing a file whole
costs memory in proportion to the file, delays the first sample by the whole parse, and loses every record to one
bad byte. These readers hold one record at a time, stop as soon as ``cap`` records are taken, and end a damaged file
with a :class:`Damage` after yielding every record before it.

Formats, by file name:

- ``.jsonl`` / ``.ndjson``: line by line. A line that is not JSON is one record (the adapter step quarantines it
  ``invalid_json`` and reading goes on at the next line); a line that is not UTF-8 likewise, with ``error`` set.
- ``.json``: a JSON array of records, streamed element by element (``ijson``); anything else is read as a stream of
  top-level JSON values, so a single (pretty-printed) object is one record and JSON Lines saved as ``.json`` work.
  A UTF-8 byte-order mark is skipped. A parse error ends the file with a :class:`Damage` (file, byte offset, the
  parser's message); a streaming parser cannot resynchronise after a broken element, so what follows is not read.
- ``.parquet`` / ``.pq``: row group by row group; an unreadable footer or row group ends the file with a Damage.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

BOM = b"\xef\xbb\xbf"
PARQUET_SUFFIXES = (".parquet", ".pq")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
LINE_SUFFIXES = (".jsonl", ".ndjson")
READ_CHUNK = 64 << 10
PARQUET_BATCH = 256


@dataclass(frozen=True)
class Record:
    """One record of a file: its 0-based position, the value (a parsed row, or a JSONL line's text)."""

    index: int
    value: Any
    where: str  # "<file> line N (byte B)" or "<file> #N": how an operator finds it
    error: str | None = None  # the line could not be decoded (it is quarantined with this detail)


@dataclass(frozen=True)
class Damage:
    """Where a file stopped being readable; the records before it were yielded."""

    file: str
    offset: int
    message: str
    records_before: int


Item = Record | Damage


def iter_file(path: str | Path, cap: int | None = None) -> Iterator[Item]:
    """Records of one file in file order, at most ``cap``; a damaged file ends with one :class:`Damage`."""
    path = Path(path)
    if cap is not None and cap <= 0:
        return
    if path.name.endswith(PARQUET_SUFFIXES):
        yield from _parquet(path, cap)
    elif path.name.endswith(LINE_SUFFIXES):
        yield from _lines(path, cap)
    else:
        yield from _json(path, cap)


def iter_rows(rows: Iterable[Any], name: str, cap: int | None = None) -> Iterator[Record]:
    """Records of an already-parsed row iterable (a hub dataset split), at most ``cap``."""
    for i, row in enumerate(rows):
        if cap is not None and i >= cap:
            return
        yield Record(i, row, f"{name} #{i}")


# ------------------------------------------------------------------------------------------------------- JSONL
def _lines(path: Path, cap: int | None) -> Iterator[Item]:
    n = 0
    offset = 0
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            start, offset = offset, offset + len(line)
            if lineno == 1 and line.startswith(BOM):
                line, start = line[len(BOM):], start + len(BOM)
            if not line.strip():
                continue
            if cap is not None and n >= cap:
                return
            where = f"{path.name} line {lineno} (byte {start})"
            try:
                text, error = line.decode("utf-8").rstrip("\r\n"), None
            except UnicodeDecodeError as e:
                text = line.decode("utf-8", errors="replace").rstrip("\r\n")
                error = f"{where}: not UTF-8 at byte {start + e.start} ({e.reason})"
            yield Record(n, text, where, error)
            n += 1


# -------------------------------------------------------------------------------------------------------- JSON
class _CountingReader:
    """The file as the parser sees it: counts the bytes handed out, optionally one byte at a time from ``slow_from``
    (to find the exact offset where the parser gives up)."""

    def __init__(self, fh: BinaryIO, start: int, slow_from: int | None = None):
        self.fh, self.pos, self.slow_from = fh, start, slow_from
        self.eof = False

    def read(self, size: int = -1) -> bytes:
        if size == 0:
            return b""
        if self.slow_from is not None and self.pos >= self.slow_from:
            size = 1
        elif self.slow_from is not None:
            size = min(size if size > 0 else READ_CHUNK, self.slow_from - self.pos)
        data = self.fh.read(size if size > 0 else READ_CHUNK)
        self.pos += len(data)
        self.eof = not data
        return data


def _json_start(fh: BinaryIO) -> tuple[int, bytes]:
    """(offset after a BOM, first non-blank byte) of a JSON file."""
    head = fh.read(len(BOM))
    start = len(BOM) if head == BOM else 0
    fh.seek(start)
    while True:
        chunk = fh.read(4096)
        if not chunk:
            return start, b""
        stripped = chunk.lstrip()
        if stripped:
            fh.seek(start)
            return start, stripped[:1]


def _json(path: Path, cap: int | None) -> Iterator[Item]:
    with open(path, "rb") as fh:
        start, first = _json_start(fh)
        if not first:
            yield Damage(str(path), start, "the file holds no JSON value (empty)", 0)
            return
        prefix, multiple = ("item", False) if first == b"[" else ("", True)
        import ijson  # only JSON arrays / multi-value JSON need it; JSONL and parquet do not

        reader = _CountingReader(fh, start)
        n = 0
        try:
            for value in ijson.items(reader, prefix, multiple_values=multiple, use_float=True,
                                     buf_size=READ_CHUNK):
                yield Record(n, value, f"{path.name} #{n}")
                n += 1
                if cap is not None and n >= cap:
                    return
        except Exception as e:  # noqa: BLE001 - any parser/IO failure is damage of this file, never fatal
            chunk_start = max(start, reader.pos - READ_CHUNK)
            yield Damage(str(path), _error_offset(path, start, multiple, chunk_start, reader.pos),
                         _message(e), n)


def _error_offset(path: Path, start: int, multiple: bool, chunk_start: int, fallback: int) -> int:
    """The byte where the parser gives up: parse again, feeding the failing chunk one byte at a time."""
    with open(path, "rb") as fh:
        fh.seek(start)
        reader = _CountingReader(fh, start, slow_from=chunk_start)
        import ijson

        try:
            for _ in ijson.parse(reader, multiple_values=multiple, buf_size=READ_CHUNK):
                pass
        except Exception:  # noqa: BLE001 - the failure we are locating
            if reader.eof:  # truncated: the damage is the end of the file
                return reader.pos
            return max(start, reader.pos - 1) if reader.pos > chunk_start else fallback
    return fallback


def _message(e: BaseException) -> str:
    """The parser's message on one line (yajl adds a multi-line excerpt with a caret)."""
    text = str(e)
    if text.startswith(("b'", 'b"')):
        text = text[2:-1].encode().decode("unicode_escape", errors="replace")
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"{type(e).__name__}: {first.strip()}"


# ----------------------------------------------------------------------------------------------------- parquet
def _parquet(path: Path, cap: int | None) -> Iterator[Item]:
    import pyarrow.parquet as pq

    n = 0
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - unreadable footer: nothing can be read
        yield Damage(str(path), 0, _message(e), 0)
        return
    md = pf.metadata
    for rg in range(md.num_row_groups):
        try:
            table = pf.read_row_group(rg)
        except Exception as e:  # noqa: BLE001 - a damaged row group ends the file here
            col = md.row_group(rg).column(0)
            offset = col.dictionary_page_offset or col.data_page_offset
            yield Damage(str(path), int(offset or 0), _message(e), n)
            return
        for batch in table.to_batches(max_chunksize=PARQUET_BATCH):
            for row in batch.to_pylist():
                yield Record(n, row, f"{path.name} #{n}")
                n += 1
                if cap is not None and n >= cap:
                    return
        del table
