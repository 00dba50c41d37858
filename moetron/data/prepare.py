"""`moetron data prepare`: text / JSONL files -> a memory-mapped token file with a document index.

Design notes: docs/data.md (`moetron/data/prepare.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from moetron.data.documents import PIECE_CHARS, Source, document_pieces, read_documents  # noqa: F401
from moetron.progress import ProgressBar

FORMAT = "moetron.packed"
FORMAT_VERSION = 1
TOKENS_FILE, INDEX_FILE, META_FILE, TOKENIZER_FILE = "tokens.bin", "doc_index.bin", "meta.json", "tokenizer.json"
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TEXT_MODES = ("file", "line", "paragraph")
# End-of-document tokens of common tokenizers, tried in this order when --separator is not given.
SEPARATOR_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>", "<|eos|>",
                        "[SEP]")
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
TYPECODES = {"uint16": "H", "uint32": _U32}


def load_tokenizer(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from a tokenizer.json file (or a folder holding one)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError("moetron data prepare needs the 'tokenizers' package (Hugging Face), which is not "
                          "installed: pip install tokenizers (or pip install 'moetron[data]')") from exc
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (expected a Hugging Face "
                                "tokenizer.json, or a folder that holds one)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type for malformed files
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from exc


def find_separator(tokenizer, name: str | None = None) -> tuple[str, int]:
    """`(token, id)` of the end-of-document separator: `name`, or the first usual one the tokenizer has."""
    if name is not None:
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise ValueError(f"separator {name!r} is not a token of this tokenizer; name one of its tokens "
                             "(e.g. its end-of-text token) with --separator")
        return name, token_id
    for candidate in SEPARATOR_CANDIDATES:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return candidate, token_id
    raise ValueError(f"the tokenizer has none of the usual end-of-document tokens ({', '.join(SEPARATOR_CANDIDATES)}); "
                     "name the token that separates documents with --separator TOKEN")


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named, and the files under folders named (recursively, sorted; hidden ones skipped)."""
    if not inputs:
        raise ValueError("no input files given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"input folder {str(path)!r} holds no files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {str(path)!r} does not exist")
    return files


def input_format(path: Path, fmt: str = "auto") -> str:
    """'jsonl' or 'text': by `fmt`, or for 'auto' by the suffix (.jsonl/.ndjson/.json, optionally .gz)."""
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return "jsonl" if suffixes and suffixes[-1] in JSONL_SUFFIXES else "text"


@dataclass
class PrepareSummary:
    output: Path
    files: int
    documents: int
    tokens: int
    skipped_empty: int
    input_bytes: int
    seconds: float
    dtype: str
    vocab_size: int
    separator: str
    separator_id: int
    sources: list = field(default_factory=list, repr=False)

    def format(self) -> str:
        size = (self.output / TOKENS_FILE).stat().st_size if (self.output / TOKENS_FILE).exists() else 0
        rate = self.input_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        lines = [f"prepared {self.output}",
                 f"  {self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}, "
                 f"vocabulary {self.vocab_size:,}; "
                 f"separator {self.separator!r} = {self.separator_id} after each document)",
                 f"  from {self.files:,} file(s), {_human_bytes(self.input_bytes)} in {self.seconds:.1f}s "
                 f"({rate:.1f} MB/s, {self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s); "
                 f"tokens.bin is {_human_bytes(size)}"]
        if self.skipped_empty:
            lines.append(f"  skipped {self.skipped_empty:,} empty document(s)")
        return "\n".join(lines)


def _human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def is_prepared(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a completed prepared-data folder (its meta.json names the format)."""
    try:
        return json.loads((Path(folder) / META_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 1e9:.2f} GB free"
    except OSError:
        return "free space unknown"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write(f, values: array) -> None:
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    values.tofile(f)


def prepare(inputs: Sequence[str | os.PathLike], tokenizer: str | os.PathLike, output: str | os.PathLike, *,
            text_key: str = "text", text_mode: str = "file", input_fmt: str = "auto", separator: str | None = None,
            overwrite: bool = False, errors: str = "strict", batch_docs: int = 1024, batch_chars: int = 1 << 20,
            piece_chars: int = PIECE_CHARS, log: Callable[[str], None] = print,
            progress: bool | None = None) -> PrepareSummary:
    """Tokenize `inputs` (files or folders of .txt / .jsonl[.gz]) into the prepared folder `output`.

    `text_mode` says what a document is in a text file: the whole 'file', each non-blank
    'line', or each blank-line-separated 'paragraph'. Text is read and tokenized in pieces of at
    most `piece_chars` characters cut between words (`moetron.data.documents`), so memory does not
    grow with a document's length; `batch_chars` bounds one tokenizer call. JSONL documents are the `text_key`
    field of each line's object. `separator` is the end-of-document token (default: the
    tokenizer's usual one); special tokens spelled in the text are tokenized as plain text, so
    only the separators prepare adds mark boundaries. Documents that tokenize to nothing are
    skipped and counted.
    `errors='replace'` turns invalid UTF-8 / lone surrogates into U+FFFD instead of failing.
    """

    if text_mode not in TEXT_MODES:
        raise ValueError(f"text_mode={text_mode!r}: choose one of {', '.join(TEXT_MODES)}")
    if input_fmt not in ("auto", "text", "jsonl"):
        raise ValueError(f"input format {input_fmt!r}: choose auto, text or jsonl")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors={errors!r}: choose strict or replace")
    if batch_docs < 1 or batch_chars < 1 or piece_chars < 1:
        raise ValueError("batch_docs, batch_chars and piece_chars must be >= 1")
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"output {str(output)!r} already exists; pass --overwrite to replace it")
    if output.exists() and not is_prepared(output):
        raise FileExistsError(f"output {str(output)!r} exists and is not a prepared-data folder; "
                              "refusing to replace it, choose another --output")
    files = expand_inputs(inputs)
    # An earlier run's output under an input folder is not input.
    inside = [p for p in files if output.resolve() in p.resolve().parents]
    files = [p for p in files if p not in inside]
    if not files:
        raise ValueError(f"no input files outside the output folder {str(output)!r}")
    tokenizer_path = Path(tokenizer) / TOKENIZER_FILE if Path(tokenizer).is_dir() else Path(tokenizer)
    tok = load_tokenizer(tokenizer_path)
    sep_token, sep_id = find_separator(tok, separator)
    # A document that spells "<|endoftext|>" must not fake a document boundary: special tokens
    # in the text are tokenized as the plain text they are (tokenizers >= 0.19).
    specials_as_text = hasattr(type(tok), "encode_special_tokens")
    if specials_as_text:
        tok.encode_special_tokens = True
    else:
        log("warning: this tokenizers version cannot encode special tokens as text; a document that spells "
            f"{sep_token!r} gets a separator inside it (pip install -U tokenizers)")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    typecode = TYPECODES[dtype]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    total_bytes = sum(p.stat().st_size for p in files)

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    bar = ProgressBar(total_bytes, unit="MB", scale=1e6, enabled=progress)
    start = last_log = time.perf_counter()
    num_tokens = num_docs = skipped = done_bytes = 0
    sources = []
    try:
        with open(tmp / TOKENS_FILE, "wb") as tokens_f, open(tmp / INDEX_FILE, "wb") as index_f:
            _write(index_f, array("q", [0]))
            for file_no, path in enumerate(files, 1):
                fmt = input_format(path, input_fmt)
                src = Source(path)
                counts = {"path": str(path), "format": fmt, "documents": 0, "tokens": 0, "skipped_empty": 0}
                try:
                    pieces = document_pieces(src, fmt, text_key=text_key, text_mode=text_mode, errors=errors,
                                             piece_chars=piece_chars)
                    doc_tokens = 0  # of the document whose pieces are being tokenized
                    while True:
                        batch, ends, chars = [], [], 0
                        for text, last in pieces:
                            batch.append(text)
                            ends.append(last)
                            chars += len(text)
                            if len(batch) >= batch_docs or chars >= batch_chars:
                                break
                        if not batch:
                            break
                        ids_buf, offsets = array(typecode), array("q")
                        for enc, last in zip(encode(batch, add_special_tokens=False), ends):
                            ids = enc.ids
                            try:
                                ids_buf.extend(ids)
                            except OverflowError as exc:
                                raise ValueError(f"{path}: the tokenizer produced a token id above {dtype}'s range "
                                                 f"although its vocabulary has {vocab_size} tokens") from exc
                            doc_tokens += len(ids)
                            if not last:
                                continue
                            if not doc_tokens:
                                counts["skipped_empty"] += 1
                                continue
                            ids_buf.append(sep_id)
                            num_tokens += doc_tokens + 1
                            offsets.append(num_tokens)
                            counts["tokens"] += doc_tokens + 1
                            doc_tokens = 0
                        if ids_buf and max(ids_buf) >= vocab_size:
                            raise ValueError(f"{path}: the tokenizer produced token id {max(ids_buf)}, outside its "
                                             f"vocabulary of {vocab_size}")
                        _write(tokens_f, ids_buf)
                        _write(index_f, offsets)
                        counts["documents"] += len(offsets)
                        num_docs += len(offsets)
                        now = time.perf_counter()
                        bar.update(done_bytes + src.position(), postfix=f"{num_docs:,} docs {num_tokens:,} tokens")
                        if not bar.enabled and now - last_log >= 10:
                            last_log = now
                            log(f"  {100 * (done_bytes + src.position()) / max(total_bytes, 1):5.1f}% of the input, "
                                f"{num_docs:,} documents, {num_tokens:,} tokens, file {file_no}/{len(files)}")
                finally:
                    src.close()
                done_bytes += path.stat().st_size
                skipped += counts["skipped_empty"]
                sources.append(counts)
                if not bar.enabled and len(files) <= 100:
                    log(f"  [{file_no}/{len(files)}] {path}: {counts['documents']:,} document(s), "
                        f"{counts['tokens']:,} tokens")
                bar.update(done_bytes)
            if num_docs == 0:
                raise ValueError(f"no documents in {len(files)} input file(s)"
                                 + (f" ({skipped} empty document(s) skipped)" if skipped else "")
                                 + ": nothing to prepare")
            for f in (tokens_f, index_f):
                f.flush()
                os.fsync(f.fileno())
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        seconds = time.perf_counter() - start
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "byte_order": "little",
                "vocab_size": vocab_size, "num_tokens": num_tokens, "num_documents": num_docs,
                "separator": sep_token, "separator_id": sep_id,
                "tokens_file": TOKENS_FILE, "index_file": INDEX_FILE, "tokenizer_file": TOKENIZER_FILE,
                "tokenizer_sha256": _sha256(tokenizer_path), "special_tokens_in_text": "text" if specials_as_text
                else "special", "text_key": text_key, "text_mode": text_mode,
                "errors": errors, "skipped_empty": skipped, "input_bytes": total_bytes,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sources": sources}
        with open(tmp / META_FILE, "w") as f:  # written last: its presence marks the folder complete
            json.dump(meta, f, indent=1, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        if output.exists():  # --overwrite of an earlier prepared folder: swap, then delete the old one
            old = output.parent / f".{output.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(output, old)
            os.rename(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, output)
    except OSError as exc:
        bar.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, FileNotFoundError) and exc.filename and Path(exc.filename) in files:
            raise
        where = exc.filename or f"writing into {tmp.name}"
        raise OSError(exc.errno, f"preparing {output} failed: {exc.strerror or exc} ({where}); "
                                 f"{_free_space(output.parent)} in {output.parent}; nothing was kept "
                                 "(the partial folder was removed)") from exc
    except BaseException:
        bar.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bar.close()
    return PrepareSummary(output=output, files=len(files), documents=num_docs, tokens=num_tokens,
                          skipped_empty=skipped, input_bytes=total_bytes, seconds=seconds, dtype=dtype,
                          vocab_size=vocab_size, separator=sep_token, separator_id=sep_id, sources=sources)
