"""Tests for lowcomm.data: corpus loading, byte tokenizer, deterministic batch sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowcomm.data import (
    EMBEDDED_SOURCE,
    MIN_TEXT_BYTES,
    BatchSampler,
    ByteTokenizer,
    eval_batches,
    get_batch,
    load_corpus,
    load_text,
    make_generator,
    read_jsonl,
    text_files,
)

LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 200  # 9000 bytes


def test_embedded_corpus_is_nonempty_and_deterministic() -> None:
    a = load_text(None)
    b = load_text()
    assert a == b
    assert len(a.encode("utf-8")) > 100_000
    assert "lambda" in a


def test_load_corpus_embedded_split() -> None:
    corpus = load_corpus(val_fraction=0.1)
    assert corpus.source == EMBEDDED_SOURCE
    assert corpus.vocab_size == 256
    assert corpus.train.dtype == torch.int64 and corpus.train.dim() == 1
    assert corpus.val.dtype == torch.int64 and corpus.val.dim() == 1
    total = len(corpus.train) + len(corpus.val)
    assert total == len(load_text().encode("utf-8"))
    assert len(corpus.val) == pytest.approx(0.1 * total, abs=1)
    tok = ByteTokenizer()
    assert tok.decode(torch.cat([corpus.train, corpus.val])) == load_text()


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — ✓ 日本"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text).tolist() == ids
    assert tok.vocab_size == 256
    # A sample cut mid-character decodes without raising.
    assert tok.decode(ids[:2]).startswith("h")
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


def test_load_single_file(tmp_path: Path) -> None:
    f = tmp_path / "book.dat"  # any suffix is accepted for an explicit file
    f.write_text(LONG_TEXT, encoding="utf-8")
    assert load_text(f) == LONG_TEXT
    assert load_text(str(f)) == LONG_TEXT
    corpus = load_corpus(f, val_fraction=0.25)
    assert corpus.source == str(f.resolve())
    assert len(corpus.val) == len(LONG_TEXT) - int(len(LONG_TEXT) * 0.75)


def test_a_jsonl_file_is_read_as_its_documents_texts(tmp_path: Path) -> None:
    # the JSON syntax is not training text: each line's "text", the documents a blank line apart
    texts = [f"document {i}: " + "words " * 100 for i in range(8)]
    texts[3] = "a line\u2028separator JSON may hold unescaped, and é漢字"
    lines = [json.dumps({"text": t, "id": i}, ensure_ascii=i % 2 == 0) for i, t in enumerate(texts)]
    f = tmp_path / "corpus.JSONL"
    f.write_text("\r\n".join(lines[:4]) + "\n\n  \n" + "\n".join(lines[4:]) + "\n", "utf-8")
    assert read_jsonl(f) == texts
    assert load_text(f) == "\n\n".join(texts)
    assert '"text"' not in load_text(f)
    corpus = load_corpus(f)
    assert len(corpus.train) + len(corpus.val) == len("\n\n".join(texts).encode("utf-8"))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "invalid JSON: Expecting value"),
        ("[1, 2]", "a JSON array"),
        ('"just a string"', "a JSON string"),
        ('{"content": "x", "id": 1}', "its keys are ['content', 'id']"),
        ('{"text": null}', 'its "text" is a JSON null'),
        ('{"text": 5}', 'its "text" is a JSON number'),
        ('{"text": "a \\ud800 b"}', 'its "text" holds the unpaired surrogate \\ud800'),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
    ],
    ids=["not-json", "array", "string", "no-text", "null", "number", "surrogate", "deep"],
)
def test_a_jsonl_line_that_is_not_a_document_is_named(
    tmp_path: Path, line: str, problem: str
) -> None:
    f = tmp_path / "corpus.jsonl"
    good = json.dumps({"text": LONG_TEXT})
    f.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_text(f)
    message = str(info.value)
    assert message.startswith(f'{f}:3 is not a JSON object with a "text" string ({problem}')
    assert message.endswith('write one document per line as {"text": "..."}.')


def test_load_folder_recursive_sorted(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.md").write_text("B" * 3000, encoding="utf-8")
    (tmp_path / "a.txt").write_text("A" * 3000, encoding="utf-8")
    (tmp_path / "sub" / "c.RST").write_text("C" * 3000, encoding="utf-8")
    (tmp_path / "ignored.py").write_text("X" * 3000, encoding="utf-8")
    (tmp_path / ".hidden" / "d.txt").write_text("D" * 3000, encoding="utf-8")
    text = load_text(tmp_path)
    assert text == "\n".join(["A" * 3000, "B" * 3000, "C" * 3000])
    # a .jsonl shard among them contributes its documents' text, in path order
    (tmp_path / "sub" / "e.JSONL").write_text(
        "\n".join(json.dumps({"text": t}) for t in ("E1" * 50, "E2" * 50)), encoding="utf-8"
    )
    shard = "\n\n".join(["E1" * 50, "E2" * 50])
    assert load_text(tmp_path) == "\n".join(["A" * 3000, "B" * 3000, "C" * 3000, shard])


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="does not exist") as info:
        load_text(missing)
    assert str(missing) in str(info.value)


def test_text_files_picks_suffixes_in_any_case_and_skips_hidden(tmp_path: Path) -> None:
    (tmp_path / "b" / ".git").mkdir(parents=True)
    for name in ("a.MD", "b/c.md", "b/.d.md", "b/.git/e.md", "b/f.py", "g.txt"):
        (tmp_path / name).write_text("x", encoding="utf-8")
    assert [p.name for p in text_files(tmp_path, {".md"})] == ["a.MD", "c.md"]
    assert [p.name for p in text_files(tmp_path, [".PY", ".Txt"])] == ["f.py", "g.txt"]
    assert [p.name for p in text_files(tmp_path)] == ["a.MD", "c.md", "g.txt"]  # text and .jsonl


def test_folder_without_text_files(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"\x00" * 10_000)
    with pytest.raises(ValueError, match="no text files") as info:
        load_text(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    f = tmp_path / "latin.txt"
    f.write_bytes("café ".encode("latin-1") * 2000)
    with pytest.raises(ValueError, match="not valid UTF-8") as info:
        load_text(f)
    assert str(f) in str(info.value)


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret.txt"
    f.write_text(LONG_TEXT, encoding="utf-8")

    def deny(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    # chmod does not stop root, so simulate the OS refusing the read.
    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(ValueError, match="Cannot read") as info:
        load_text(f)
    assert str(f) in str(info.value)


def test_unreadable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    def deny(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", deny)
    with pytest.raises(ValueError, match="Cannot read folder") as info:
        load_text(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_empty_path_string() -> None:
    with pytest.raises(ValueError, match="empty string"):
        load_text("")


def test_text_too_short(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text("too short", encoding="utf-8")
    with pytest.raises(ValueError, match=str(MIN_TEXT_BYTES)) as info:
        load_text(f)
    assert str(f) in str(info.value)


@pytest.mark.parametrize("val_fraction", [0.0, 0.5, -0.1, 1.0])
def test_bad_val_fraction(val_fraction: float) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(val_fraction=val_fraction)


def test_get_batch_shapes_shift_and_determinism() -> None:
    tokens = torch.arange(1000, dtype=torch.int64)
    x, y = get_batch(tokens, 8, 32, torch.Generator().manual_seed(5))
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == torch.int64
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(y[:, -1], x[:, -1] + 1)  # contiguous: tokens are consecutive
    x2, y2 = get_batch(tokens, 8, 32, torch.Generator().manual_seed(5))
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_get_batch_reaches_the_last_token_and_stays_in_range() -> None:
    tokens = torch.arange(10, dtype=torch.int64)
    x, y = get_batch(tokens, 200, 9, torch.Generator().manual_seed(0))
    assert int(y.max()) == 9 and int(x.min()) == 0


def test_get_batch_split_too_short() -> None:
    with pytest.raises(ValueError, match="block_size=16"):
        get_batch(torch.arange(16), 2, 16, torch.Generator().manual_seed(0))


def test_make_generator_per_rank_streams() -> None:
    tokens = torch.arange(10_000, dtype=torch.int64)
    a0, _ = get_batch(tokens, 4, 16, make_generator(0, 0))
    a0_again, _ = get_batch(tokens, 4, 16, make_generator(0, 0))
    a1, _ = get_batch(tokens, 4, 16, make_generator(0, 1))
    b0, _ = get_batch(tokens, 4, 16, make_generator(1, 0))
    assert torch.equal(a0, a0_again)
    assert not torch.equal(a0, a1)
    assert not torch.equal(a0, b0)


def test_batch_sampler_matches_get_batch() -> None:
    tokens = torch.arange(5000, dtype=torch.int64)
    sampler = BatchSampler(tokens, 4, 16, seed=7, rank=2)
    gen = make_generator(7, 2)
    it = iter(sampler)
    for _ in range(3):
        x, y = next(it)
        ex, ey = get_batch(tokens, 4, 16, gen)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_eval_batches_deterministic_and_spanning() -> None:
    tokens = torch.arange(1000, dtype=torch.int64)
    batches = eval_batches(tokens, 4, 32, 3)
    again = eval_batches(tokens, 4, 32, 3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (4, 32)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        torch.testing.assert_close(y[:, :-1], x[:, 1:])
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert int(starts[0]) == 0
    assert int(batches[-1][1][-1, -1]) == 999  # last window ends at the last token
    gaps = starts.diff()
    assert int(gaps.max() - gaps.min()) <= 1  # evenly spaced


def test_eval_batches_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_batches"):
        eval_batches(torch.arange(100), 2, 8, 0)
    with pytest.raises(ValueError, match="needs at least"):
        eval_batches(torch.arange(5), 2, 8, 1)
