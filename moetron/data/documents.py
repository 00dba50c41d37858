"""The documents of text / JSONL inputs, streamed as pieces of bounded size cut where a tokenizer cuts anyway.

A tokenizer holds ~100x a text's size while it encodes it, so one 100 MB line would need ~14 GB.
`document_pieces` yields `(piece, last)`: each document's text in pieces of at most `piece_chars`
characters, cut only between words - before a single space between two non-space characters, or
after a line break that follows one - where byte-level BPE (GPT-2, Llama 3) and Metaspace
pre-tokenizers split anyway, so the tokens equal those of the whole text. Text files (every
`--text-mode`) are read in blocks, never whole; a JSONL line is parsed whole. A run of
`piece_chars` characters with no such place is refused with a clear error.
Design notes: docs/data.md (`moetron/data/documents.py`).
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
from pathlib import Path
from typing import Iterator

BLOCK_BYTES = 1 << 20  # read size
PIECE_CHARS = 1 << 18  # characters per tokenizer input
_CUT = re.compile(r"(?<=\S) (?=\S)|(?<=\S\n)(?=\S)")


class Source:
    """A binary reader over a plain or gzip file that knows how far into the file it is."""

    def __init__(self, path: Path):
        self.path = path
        self.raw = open(path, "rb")
        self.stream = gzip.GzipFile(fileobj=self.raw) if path.suffix.lower() == ".gz" else self.raw

    def position(self) -> int:
        try:
            return self.raw.tell()
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        if self.stream is not self.raw:
            self.stream.close()
        self.raw.close()


def _utf8_error(path: Path, lineno: int, exc: UnicodeDecodeError, byte: int, where: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {byte} of the {where}); "
                      "re-encode the file as UTF-8 or pass --errors replace")


def _check_encodable(text: str, path: Path, lineno: int, errors: str) -> str:
    """JSON can spell lone surrogates (\\ud800), which are not text: reject or replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        if errors == "replace":
            return text.encode("utf-8", errors="replace").decode("utf-8")
        raise ValueError(f"{path}:{lineno}: the text holds a lone surrogate ({exc.object[exc.start:exc.end]!r} "
                         f"at character {exc.start}), which is not valid Unicode; fix the line or pass "
                         "--errors replace") from exc


def _jsonl_texts(source: Source, text_key: str, errors: str) -> Iterator[str | None]:
    path = source.path
    for lineno, raw in enumerate(source.stream, 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8", errors=errors)
        except UnicodeDecodeError as exc:
            raise _utf8_error(path, lineno, exc, exc.start, "line") from exc
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                             "expected one JSON object per line") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} field, "
                             f"got a {type(record).__name__}")
        if text_key not in record:
            keys = ", ".join(repr(k) for k in list(record)[:10])
            raise ValueError(f"{path}:{lineno}: no {text_key!r} field (the object has {keys or 'no keys'}); "
                             "name the text field with --text-key")
        text = record[text_key]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: field {text_key!r} is not a string (it holds {type(text).__name__} "
                             f"{str(text)[:40]})")
        yield _check_encodable(text, path, lineno, errors)
        yield None


def _file_texts(source: Source, errors: str) -> Iterator[str | None]:
    """A whole text file as one document, in decoded blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    done, lines, first = 0, 0, True
    while True:
        raw = source.stream.read(BLOCK_BYTES)
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            raise _utf8_error(source.path, lines + raw.count(b"\n", 0, max(exc.start, 0)) + 1, exc,
                              done + exc.start, "file") from exc
        if first and text:
            text, first = text.removeprefix("\ufeff"), False
        if text:
            yield text
        if not raw:
            yield None
            return
        done, lines = done + len(raw), lines + raw.count(b"\n")


def _line_texts(source: Source, mode: str, errors: str) -> Iterator[str | None]:
    """Non-blank lines ('line'), or runs of them ('paragraph', joined with their line breaks), without
    their final line break, as text pieces; None ends a document."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    lineno, line_byte = 1, 0
    open_doc = started = False  # a document is open / this line has shown a non-space
    waiting: list[str] = []  # this line so far, while it is all white space
    held = ""  # trailing line-break characters: dropped at a document's end, else emitted before more text
    while True:
        raw = source.stream.readline(BLOCK_BYTES)
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            raise _utf8_error(source.path, lineno, exc, line_byte + exc.start, "line") from exc
        if lineno == 1 and line_byte == 0:
            text = text.removeprefix("\ufeff")
        if not started and text.strip():
            started, text, waiting = True, "".join(waiting) + text, []
            if not open_doc:
                open_doc, held = True, ""
        elif not started:
            waiting.append(text)
        if started and text:
            text = held + text
            body = text.rstrip("\r\n")
            held = text[len(body):]
            if body:
                yield body
        if raw.endswith(b"\n") or not raw:
            if open_doc and (mode == "line" and started or not started):
                open_doc, held = False, ""
                yield None
            started, waiting, lineno, line_byte = False, [], lineno + 1, 0
        else:
            line_byte += len(raw)
        if not raw:
            if open_doc:
                yield None
            return


def safe_cut(text: str, limit: int) -> int | None:
    """The last place at or before `limit` where `text` may be cut (see the module doc), or None."""
    last = None
    for m in _CUT.finditer(text, 1, min(len(text), limit + 1) + 1):
        if m.start() <= limit:
            last = m.start()
    return last


def document_pieces(source: Source, fmt: str, *, text_key: str = "text", text_mode: str = "file",
                    errors: str = "strict", piece_chars: int = PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """`(piece, last)` for every document of `source` (see the module doc); `last` ends a document."""
    if fmt == "jsonl":
        texts = _jsonl_texts(source, text_key, errors)
    elif text_mode == "file":
        texts = _file_texts(source, errors)
    else:
        texts = _line_texts(source, text_mode, errors)
    buf, docs = "", 0
    for text in texts:
        if text is None:
            docs += 1
            yield buf, True
            buf = ""
            continue
        buf += text
        while len(buf) > piece_chars:
            cut = safe_cut(buf, piece_chars)
            if cut is None:
                raise ValueError(f"{source.path}: document {docs + 1} has {piece_chars:,} characters in a row with no "
                                 "space between words or line break to split it at, and tokenizing it whole needs "
                                 "~100x its size in memory; break the text into lines (or pass a larger "
                                 "piece_chars to prepare)")
            yield buf[:cut], False
            buf = buf[cut:]


def read_documents(source: Source, fmt: str, *, text_key: str = "text", text_mode: str = "file",
                   errors: str = "strict") -> Iterator[str]:
    """Whole documents of one input (each held in memory; `prepare` uses `document_pieces`)."""
    parts: list[str] = []
    for piece, last in document_pieces(source, fmt, text_key=text_key, text_mode=text_mode, errors=errors,
                                       piece_chars=1 << 62):
        parts.append(piece)
        if last:
            yield "".join(parts)
            parts = []
