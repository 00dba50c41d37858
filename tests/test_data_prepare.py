"""`moetron data prepare` and the packed memory-mapped dataset, against the tokenizer run directly.

The tokenizers are trained in-process on a few sentences (nothing is downloaded); the token
file is read back with numpy, independently of moetron's reader.
"""

import gzip
import math
from pathlib import Path
import json
import random
import sys

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (installed with transformers)")

from moetron.cli import main  # noqa: E402
from moetron.data import FeistelPermutation, PackedBatches, PreparedCorpus, is_prepared  # noqa: E402
from moetron.data.prepare import prepare  # noqa: E402

prepare_module = sys.modules["moetron.data.prepare"]

SEP = "<|endoftext|>"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "héllo", "wörld", "日本語",
         "テキスト",
         "🙂", "👩‍👩‍👧", "e\u0301", "שלום", "naïve", "Ω", "\t", "data", "mixture", "of", "experts"]
# Unicode edge cases: combining marks, a ZWJ emoji sequence, right-to-left text, U+2028 (a line
# break to str.splitlines, not to a JSONL reader), CRLF, NUL, a character outside the BMP, and the
# separator's spelling inside a document (plain text, not a boundary).
EDGE_DOCS = ["e\u0301te\u0301 👩‍👩‍👧 שלום", "line\u2028separator and para\u2029graph", "crlf\r\nline",
             "nul\x00byte", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q", "a text that spells <|endoftext|> is one document"]


def _random_docs(rng: random.Random, n: int, max_words: int = 40) -> list[str]:
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, max_words))]
        docs.append(" ".join(words) + rng.choice(["", ".", "!\n"]))
    return docs


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[SEP], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_random_docs(random.Random(0), 200) + EDGE_DOCS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(tok_file):
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    tok.encode_special_tokens = True  # "<|endoftext|>" in a text is text
    return tok


def _reference(tok, docs: list[str]) -> tuple[list[int], list[int]]:
    """Token stream and document offsets, from the tokenizer run on each document directly."""
    sep = tok.token_to_id(SEP)
    stream, offsets = [], [0]
    for doc in docs:
        ids = tok.encode(doc, add_special_tokens=False).ids
        if ids:
            stream += ids + [sep]
            offsets.append(len(stream))
    return stream, offsets


def _read_back(folder, dtype="<u2") -> tuple[list[int], list[int], dict]:
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.fromfile(folder / "tokens.bin", dtype=dtype).tolist()
    offsets = np.fromfile(folder / "doc_index.bin", dtype="<i8").tolist()
    return tokens, offsets, meta


def _write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
            f.write("\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Several text and JSONL files (one gzipped, two in a folder) and the documents they hold, in order."""
    rng = random.Random(1)
    root = tmp_path_factory.mktemp("corpus")
    docs: list[str] = []
    a = _random_docs(rng, 1)[0] + "\nsecond line of the same file\n\nthird paragraph"
    (root / "a.txt").write_text(a, encoding="utf-8")
    docs.append(a)
    b = _random_docs(rng, 30) + EDGE_DOCS
    records = [{"id": i, "text": t, "meta": {"x": 1}} for i, t in enumerate(b)]
    records.insert(3, "   ")  # a blank line: skipped
    records.insert(7, {"text": ""})  # an empty document: skipped and counted
    _write_jsonl(root / "b.jsonl", records)
    docs += b
    c = _random_docs(rng, 20)
    _write_jsonl(root / "c.jsonl.gz", [{"text": t} for t in c], opener=gzip.open)
    docs += c
    sub = root / "more"
    sub.mkdir()
    d, e = _random_docs(rng, 2)
    (sub / "e.txt").write_text(e, encoding="utf-8")  # folders are read in sorted order: d before e
    (sub / "d.txt").write_text("\ufeff" + d, encoding="utf-8")  # a byte-order mark is dropped
    docs += [d, e]
    inputs = [root / "a.txt", root / "b.jsonl", root / "c.jsonl.gz", sub]
    return inputs, docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus, tok_file):
    inputs, docs = corpus
    out = tmp_path_factory.mktemp("prepared") / "data"
    summary = prepare(inputs, tok_file, out, log=lambda s: None, progress=False, batch_docs=7)
    return out, summary


def test_tokens_and_index_equal_the_tokenizer_run_on_each_document(prepared, corpus, tok, tok_file):
    out, summary = prepared
    stream, offsets = _reference(tok, corpus[1])
    tokens, index, meta = _read_back(out)
    assert tokens == stream and index == offsets
    assert len(offsets) - 1 == len(corpus[1])  # only the empty record was skipped
    assert (meta["num_tokens"], meta["num_documents"], meta["dtype"]) == (len(stream), len(corpus[1]), "uint16")
    assert meta["separator_id"] == tok.token_to_id(SEP) and meta["vocab_size"] == tok.get_vocab_size()
    assert meta["skipped_empty"] == 1 and summary.skipped_empty == 1
    assert [s["documents"] for s in meta["sources"]] == [1, 30 + len(EDGE_DOCS), 20, 1, 1]
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert tok.decode(tokens[offsets[5]: offsets[6] - 1]) == corpus[1][5]
    spelled = corpus[1].index(EDGE_DOCS[-1])
    assert tokens[offsets[spelled]: offsets[spelled + 1]].count(tok.token_to_id(SEP)) == 1  # only its own
    assert "documents" in summary.format() and str(len(stream)) in summary.format().replace(",", "")
    assert is_prepared(out)
    assert not [p for p in out.parent.iterdir() if p.name != "data"]  # no temporary folders left


def test_text_modes_split_lines_and_paragraphs(tmp_path, tok, tok_file):
    text = "first line\r\nsecond line\n\n\nthird para one\nthird para two\n  \nlast 🙂"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8", newline="")
    expected = {"line": ["first line", "second line", "third para one", "third para two", "last 🙂"],
                "paragraph": ["first line\r\nsecond line", "third para one\nthird para two", "last 🙂"],
                "file": [text]}
    for mode, docs in expected.items():
        out = tmp_path / mode
        prepare([tmp_path / "t.txt"], tok_file, out, text_mode=mode, log=lambda s: None, progress=False)
        tokens, index, _ = _read_back(out)
        assert (tokens, index) == _reference(tok, docs), mode


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    rng = random.Random(2)
    docs = [" ".join(f"w{rng.randrange(70_000)}" for _ in range(rng.randint(1, 30))) + " unknown" for _ in range(50)]
    _write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in docs])
    out = tmp_path / "out"
    summary = prepare([tmp_path / "d.jsonl"], tmp_path / "tok.json", out, text_key="body", log=lambda s: None)
    tokens, index, meta = _read_back(out, dtype="<u4")
    stream, offsets = _reference_with_sep(tok, docs, "</s>")
    assert meta["dtype"] == summary.dtype == "uint32" and meta["separator"] == "</s>"
    assert tokens == stream and index == offsets and max(tokens) > 65_535
    corpus = PreparedCorpus(out)
    assert corpus.document(3).tolist() == tok.encode(docs[3]).ids


def _reference_with_sep(tok, docs, sep):
    sep_id, stream, offsets = tok.token_to_id(sep), [], [0]
    for doc in docs:
        stream += tok.encode(doc, add_special_tokens=False).ids + [sep_id]
        offsets.append(len(stream))
    return stream, offsets


def test_clear_errors_name_the_file_and_line(tmp_path, tok_file):
    quiet = dict(log=lambda s: None, progress=False)
    good = tmp_path / "good.txt"
    good.write_text("some text", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        prepare([good], tmp_path / "missing.json", tmp_path / "o1", **quiet)
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="garbage.json: not a Hugging Face tokenizer"):
        prepare([good], tmp_path / "garbage.json", tmp_path / "o1", **quiet)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        prepare([good, bad], tok_file, tmp_path / "o2", **quiet)
    bad.write_text('{"text": "ok"}\n{"content": "x", "id": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no 'text' field.*'content'.*--text-key"):
        prepare([bad], tok_file, tmp_path / "o2", **quiet)
    bad.write_text('{"text": "ok"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
        prepare([bad], tok_file, tmp_path / "o2", **quiet)
    bad.write_text('{"text": "ok"}\n{"text": "lone \\ud800 surrogate"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*lone surrogate"):
        prepare([bad], tok_file, tmp_path / "o2", **quiet)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt:2: not valid UTF-8 .* at byte 14 of the file"):
        prepare([latin1], tok_file, tmp_path / "o3", **quiet)
    with pytest.raises(ValueError, match=r"latin1\.txt:2: not valid UTF-8 .* at byte 3 of the line"):
        prepare([latin1], tok_file, tmp_path / "o3", text_mode="line", **quiet)
    prepare([latin1], tok_file, tmp_path / "o3", errors="replace", **quiet)  # U+FFFD instead
    assert is_prepared(tmp_path / "o3")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('\n  \n{"text": ""}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"no documents in 1 input file\(s\) \(1 empty document"):
        prepare([empty], tok_file, tmp_path / "o4", **quiet)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        prepare([tmp_path / "nothing"], tok_file, tmp_path / "o4", **quiet)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare([tmp_path / "nope.txt"], tok_file, tmp_path / "o4", **quiet)
    with pytest.raises(ValueError, match="separator '<eot>' is not a token"):
        prepare([good], tok_file, tmp_path / "o4", separator="<eot>", **quiet)
    for name in ("o1", "o2", "o4"):
        assert not (tmp_path / name).exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_a_failure_midway_leaves_nothing_that_looks_complete(tmp_path, corpus, tok_file, monkeypatch):
    inputs, _ = corpus
    quiet = dict(log=lambda s: None, progress=False, batch_docs=4)
    calls = {"n": 0}
    real_write = prepare_module._write

    def failing_write(f, values):
        calls["n"] += 1
        if calls["n"] == 6:  # several batches are already on disk
            raise OSError("No space left on device")
        real_write(f, values)

    monkeypatch.setattr(prepare_module, "_write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        prepare(inputs, tok_file, tmp_path / "out", **quiet)
    assert list(tmp_path.iterdir()) == []
    calls["n"] = -10**9  # never fails
    # An existing prepared folder survives a failed --overwrite untouched, and a later one replaces it.
    first = prepare(inputs[:1], tok_file, tmp_path / "out", **quiet)
    before = (tmp_path / "out" / "tokens.bin").read_bytes()
    calls["n"] = 0
    with pytest.raises(OSError, match="No space left"):
        prepare(inputs, tok_file, tmp_path / "out", overwrite=True, **quiet)
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == before and is_prepared(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    calls["n"] = -10**9
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare(inputs, tok_file, tmp_path / "out", **quiet)
    second = prepare(inputs, tok_file, tmp_path / "out", overwrite=True, **quiet)
    assert second.tokens > first.tokens == len(before) // 2
    assert PreparedCorpus(tmp_path / "out").num_tokens == second.tokens
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # Re-preparing a folder of inputs into a folder inside it does not read the earlier output.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world", encoding="utf-8")
    prepare([src], tok_file, src / "prepared", **quiet)
    again = prepare([src], tok_file, src / "prepared", overwrite=True, **quiet)
    assert again.files == 1 and again.documents == 1
    # A folder that is not prepared data is never replaced.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a prepared-data folder"):
        prepare(inputs, tok_file, tmp_path / "mine", overwrite=True, **quiet)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_command_line_prepares_and_reports(tmp_path, corpus, tok_file, capsys):
    inputs, docs = corpus
    out = tmp_path / "cli"
    assert main(["data", "prepare", *map(str, inputs), "--tokenizer", str(tok_file), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{len(docs):,} documents" in printed and "prepared" in printed
    assert main(["data", "info", str(out)]) == 0
    assert f"{len(docs):,} documents" in capsys.readouterr().out
    assert main(["data", "prepare", str(inputs[0]), "--tokenizer", str(tmp_path / "no.json"), "-o",
                 str(tmp_path / "x")]) == 2
    assert "no.json" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 3}\n')
    assert main(["data", "prepare", str(bad), "--tokenizer", str(tok_file), "-o", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:2: field 'text' is not a string" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_missing_tokenizers_package_names_it(tmp_path, tok_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(ImportError, match="pip install tokenizers"):
        prepare_module.load_tokenizer(tok_file)


# ---- the packed dataset -------------------------------------------------------------------------

def test_feistel_permutation_is_a_bijection():
    for n in (1, 2, 3, 5, 17, 64, 1000, 4097):
        for key in (0, 12345):
            perm = FeistelPermutation(n, key)
            values = [perm(i) for i in range(n)]
            assert sorted(values) == list(range(n))
            if n >= 17:
                assert values != list(range(n))
    assert [FeistelPermutation(1000, 1)(i) for i in range(20)] != [FeistelPermutation(1000, 2)(i) for i in range(20)]


def test_batches_are_packed_next_token_windows_of_the_stream(prepared, corpus, tok):
    out, _ = prepared
    stream, _ = _reference(tok, corpus[1])
    seq_len, batch, micro = 16, 3, 4
    data = PackedBatches(out, seq_len, batch, seed=7, micro_batches_per_step=micro, model_vocab_size=320)
    n = data.num_sequences
    assert n == (len(stream) - 1) // seq_len
    seen, crossing = [], 0
    steps_per_epoch = -(-n // (batch * micro))
    for step in range(2 * steps_per_epoch):
        for index in range(micro):
            x, y = data.batch(step, index)
            assert x.shape == y.shape == (batch, seq_len) and x.dtype == y.dtype == torch.int64
            for row, s in enumerate(data.sequence_ids(step, index)):
                window = stream[s * seq_len: (s + 1) * seq_len + 1]
                assert x[row].tolist() == window[:-1] and y[row].tolist() == window[1:]
                crossing += int((x[row] == tok.token_to_id(SEP)).any())
                seen.append(s)
            assert 0 <= int(x.min()) and int(x.max()) < 320 and int(y.max()) < 320
    # Every sequence once per epoch, a different order in the next epoch.
    assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n: 2 * n]) == list(range(n))
    assert seen[:n] != seen[n: 2 * n] and seen[:n] != sorted(seen[:n])
    assert crossing > 0  # sequences do cross document boundaries


def test_batches_are_a_pure_function_of_seed_step_and_index(prepared):
    out, _ = prepared
    a = PackedBatches(out, 8, 2, seed=3, micro_batches_per_step=3)
    keys = [(s, i) for s in range(12) for i in range(3)]
    first = {k: a.batch(*k) for k in keys}
    b = PackedBatches(PreparedCorpus(out), 8, 2, seed=3, micro_batches_per_step=3)
    for k in random.Random(0).sample(keys, len(keys)):  # another instance, another order: a resumed run
        x, y = b.batch(*k)
        assert torch.equal(x, first[k][0]) and torch.equal(y, first[k][1])
    ids = [tuple(a.sequence_ids(*k)) for k in keys]
    assert len(set(ids)) == len(ids)  # micro-batches of a step (and of nearby steps) are disjoint
    other = PackedBatches(out, 8, 2, seed=4, micro_batches_per_step=3)
    assert [other.sequence_ids(*k) for k in keys[:6]] != [a.sequence_ids(*k) for k in keys[:6]]
    with pytest.raises(ValueError, match=r"index 3 is outside \[0, 3\)"):
        a.batch(0, 3)


def test_boundary_labels_can_be_ignored(prepared, tok):
    out, _ = prepared
    sep = tok.token_to_id(SEP)
    plain = PackedBatches(out, 32, 4, seed=1)
    masked = PackedBatches(out, 32, 4, seed=1, mask_boundary_labels=True)
    hits = 0
    for step in range(10):
        x, y = plain.batch(step)
        xm, ym = masked.batch(step)
        assert torch.equal(x, xm)
        at_boundary = x == sep
        hits += int(at_boundary.sum())
        assert (ym[at_boundary] == -100).all() and torch.equal(ym[~at_boundary], y[~at_boundary])
    assert hits > 0


def test_dataset_rejects_bad_folders_and_settings(prepared, tmp_path):
    out, _ = prepared
    with pytest.raises(ValueError, match="model.vocab_size=100"):
        PackedBatches(out, 8, 2, seed=0, model_vocab_size=100)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedBatches(out, 10**6, 2, seed=0)
    with pytest.raises(FileNotFoundError, match="moetron data prepare"):
        PreparedCorpus(tmp_path / "absent")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "tokens.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="did not finish"):
        PreparedCorpus(tmp_path / "half")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in out.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    with open(damaged / "tokens.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    with pytest.raises(ValueError, match="tokens.bin: .* bytes, meta.json says .*damaged"):
        PreparedCorpus(damaged)


def test_a_corpus_larger_than_memory_maps_and_samples(tmp_path):
    """A sparse 1 TiB token file: mapped read-only (a private copy-on-write map of it is refused)."""
    num_tokens = 1 << 39  # uint16: 1 TiB on disk, all zeros, no blocks allocated
    folder = tmp_path / "huge"
    folder.mkdir()
    try:
        with open(folder / "tokens.bin", "wb") as f:
            f.truncate(num_tokens * 2)
    except OSError as exc:
        pytest.skip(f"this filesystem has no 1 TiB sparse files ({exc})")
    np.array([0, num_tokens], dtype="<i8").tofile(folder / "doc_index.bin")
    (folder / "meta.json").write_text(json.dumps({
        "format": "moetron.packed", "version": 1, "dtype": "uint16", "vocab_size": 320, "num_tokens": num_tokens,
        "num_documents": 1, "separator": SEP, "separator_id": 0, "tokens_file": "tokens.bin",
        "index_file": "doc_index.bin"}))
    data = PackedBatches(folder, 64, 4, seed=0, micro_batches_per_step=2)
    x, y = data.batch(10**9, 1)
    assert x.shape == (4, 64) and not x.any() and not y.any()
    assert data.num_sequences == (num_tokens - 1) // 64
    assert len(set(data.sequence_ids(10**9, 1) + data.sequence_ids(10**9, 0))) == 8


def test_trainer_trains_on_a_prepared_folder(prepared, tmp_path):
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.setup import check_run_inputs
    from moetron.train.trainer import train

    folder = prepared[0] if isinstance(prepared, tuple) else prepared
    meta = json.loads((Path(folder) / "meta.json").read_text())
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), [
        f"train.data={folder}", f"model.vocab_size={meta['vocab_size']}", "model.num_layers=2",
        "train.seq_len=16", "train.micro_batch_size=2", "train.steps=8", "train.warmup_steps=1",
        f"train.metrics_file={tmp_path / 'm.jsonl'}"])
    history = train(recipe, log=lambda s: None)
    assert len(history) == 8 and all(math.isfinite(h["loss"]) for h in history)
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 8
    with pytest.raises(ValueError, match="moetron data prepare"):
        check_run_inputs(apply_overrides(get_recipe("qwen3-moe-tiny"), [f"train.data={tmp_path}"]))


# ---- long documents in bounded memory ------------------------------------------------------------


def _long_doc(rng: random.Random, words: int) -> str:
    """Words with single and multiple spaces, tabs, line breaks (also after spaces), Unicode."""
    seps = [" "] * 12 + ["  ", "\t", " \n", "\n", ".\n", "\n\n ", ", "]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(words)) + "end"


def test_long_documents_are_tokenized_in_pieces_with_the_whole_documents_tokens(tmp_path, tok, tok_file):
    rng = random.Random(7)
    docs = [_long_doc(rng, 3000), "short one", _long_doc(rng, 500)]
    quiet = dict(log=lambda s: None, progress=False, piece_chars=300, batch_chars=1000, batch_docs=3)
    (tmp_path / "f.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "l.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n", encoding="utf-8")
    _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    cases = {"file": ("f.txt", [docs[0]]), "line": ("l.txt", [d.replace("\n", " ") for d in docs]),
             "jsonl": ("d.jsonl", docs)}
    for mode, (name, want_docs) in cases.items():
        out = tmp_path / f"out-{mode}"
        prepare([tmp_path / name], tok_file, out, text_mode="line" if mode == "line" else "file", **quiet)
        assert _read_back(out)[:2] == _reference(tok, want_docs), mode
    paragraphs = [_long_doc(rng, 800).replace("\t", "tab").replace("\n\n", "\n") for _ in range(2)]  # no blank line
    (tmp_path / "p.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    prepare([tmp_path / "p.txt"], tok_file, tmp_path / "out-p", text_mode="paragraph", **quiet)
    assert _read_back(tmp_path / "out-p")[:2] == _reference(tok, [p.rstrip("\r\n") for p in paragraphs])
    # A run longer than a piece with nowhere to cut is refused, naming the file and what to do.
    (tmp_path / "solid.txt").write_text("x" * 5000, encoding="utf-8")
    with pytest.raises(ValueError, match=r"solid\.txt: document 1 has 300 characters in a row with no space"):
        prepare([tmp_path / "solid.txt"], tok_file, tmp_path / "out-solid", **quiet)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


_PEAK = """
import resource, sys
from moetron.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], sys.argv[3], text_mode="line", log=lambda s: None, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_long_line_takes_no_more_memory_than_a_short_one(tmp_path, tok_file):
    import os
    import subprocess

    rng = random.Random(3)
    chunk = " ".join(rng.choice(WORDS) for _ in range(20_000))
    peaks = {}
    for mb in (0.5, 6):
        path = tmp_path / f"{mb}.txt"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(int(mb * 1e6 / len(chunk.encode()))):
                f.write(chunk + " ")
        env = {**os.environ, "RAYON_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(tok_file), str(tmp_path / f"o{mb}")],
                                capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        peaks[mb] = int(result.stdout.split()[-1]) / 1024  # MB
    # Whole, the 6 MB line alone would take ~800 MB in the tokenizer; in pieces it adds next to nothing.
    assert peaks[6] < 1.3 * peaks[0.5] and peaks[6] - peaks[0.5] < 100, peaks


def test_a_full_disk_while_preparing_names_the_folder_and_keeps_nothing(tmp_path, corpus, tok_file, monkeypatch):
    import errno

    inputs, _ = corpus

    def full(f, values):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_module, "_write", full)
    with pytest.raises(OSError) as err:
        prepare(inputs, tok_file, tmp_path / "out", log=lambda s: None, progress=False)
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC and "\n" not in message
    assert f"preparing {tmp_path / 'out'} failed: No space left on device" in message and "GB free" in message
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
