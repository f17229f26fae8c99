"""Documents as training samples: a corpus of whole documents and a per-rank sampler that
draws an exact token budget of them (a document longer than the cap contributes a random piece
of ``cap`` tokens; the last one drawn is cut to fill the budget exactly).

The embedded corpus (``--data`` unset) is the Python standard library's own source: every
``.py`` file under it, outside ``site-packages`` and the test suites, one document each, in
sorted path order; every tenth file is held out for validation. Their sizes run from a few
hundred bytes to hundreds of kilobytes, a real long tail with nothing to download. A user's
``--data`` is a folder (one document per text or ``.py`` file, and the documents of its
``.jsonl`` files), a ``.jsonl`` file (one document per line, its ``"text"``), or a text file
whose documents are separated by blank lines.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowcomm.data.corpus import (
    JSONL_SUFFIX,
    TEXT_SUFFIXES,
    ByteTokenizer,
    make_generator,
    read_jsonl,
    read_utf8,
    text_files,
)

__all__ = [
    "EMBEDDED_DOCUMENTS",
    "DocumentCorpus",
    "DocumentSampler",
    "load_documents",
    "lognormal_texts",
    "stdlib_texts",
]

logger = logging.getLogger(__name__)

EMBEDDED_DOCUMENTS = "embedded:stdlib-source"
"""The :attr:`DocumentCorpus.source` of the default document corpus."""

MIN_DOC_TOKENS = 16
"""Documents shorter than this (in tokens) are dropped."""

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class DocumentCorpus:
    """Tokenized documents, split into training and validation ones."""

    train: list[torch.Tensor] = field(repr=False)
    val: list[torch.Tensor] = field(repr=False)
    vocab_size: int
    source: str

    def lengths(self) -> list[int]:
        return [len(d) for d in self.train]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(dirpath) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_texts() -> list[str]:
    """The embedded documents' texts: the standard library's ``.py`` files outside
    ``site-packages`` and the test suites, in sorted path order."""
    files = _stdlib_files()
    if not files:
        raise ValueError(
            "The embedded document corpus is the standard library's source, which this "
            "Python lacks: pass --data with a folder of documents."
        )
    return [f.read_text("utf-8", errors="replace") for f in files]


def lognormal_texts(
    count: int = 2000,
    *,
    median: int = 300,
    sigma: float = 1.2,
    cap: int = 8192,
    vocabulary: int = 5000,
    zipf: float = 1.1,
    seed: int = 0,
) -> list[str]:
    """A long-tailed corpus from a stated distribution, not from any real text: ``count``
    documents whose lengths in bytes are ``round(median * exp(sigma * z))`` for a standard
    normal ``z`` (log-normal: half the documents shorter than ``median``, about 1 in 300 at
    ``sigma`` 1.2 reaching ``cap``), clipped to ``[MIN_DOC_TOKENS + 2, cap]``; each is
    space-separated words drawn from a Zipf law of exponent ``zipf`` over ``vocabulary``
    made-up lower-case words of 2-9 letters (so that the model has something to learn),
    cut to its length. Deterministic for ``seed``."""
    if count < 10:
        raise ValueError(f"count={count}: documents mode needs at least 10 documents")
    gen = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    sizes = torch.randint(2, 10, (vocabulary,), generator=gen).tolist()
    words = [
        "".join(letters[i] for i in torch.randint(26, (n,), generator=gen).tolist()) for n in sizes
    ]
    ranks = torch.arange(1, vocabulary + 1, dtype=torch.float64)
    weights = ranks.pow(-zipf)
    z = torch.randn(count, generator=gen, dtype=torch.float64)
    lengths = (median * torch.exp(sigma * z)).round().clamp(MIN_DOC_TOKENS + 2, cap)
    texts = []
    for n in lengths.long().tolist():
        drawn = torch.multinomial(weights, n // 3 + 2, replacement=True, generator=gen).tolist()
        texts.append(" ".join(words[i] for i in drawn)[:n].ljust(n, "."))
    return texts


def _texts(path: str | None) -> tuple[list[str], str]:
    if path is None:
        return stdlib_texts(), EMBEDDED_DOCUMENTS
    p = Path(path).expanduser()
    if p.is_dir():
        files = text_files(p, TEXT_SUFFIXES | {JSONL_SUFFIX, ".py"})
        if not files:
            raise ValueError(
                f"Document folder {p} holds no text, .py or .jsonl files: add some, or point "
                "--data at a .jsonl file."
            )
        texts: list[str] = []
        for f in files:  # a .jsonl file: its documents; any other: one document
            texts.extend(read_jsonl(f) if f.suffix.lower() == JSONL_SUFFIX else [_read(f)])
        return texts, str(p.resolve())
    if not p.is_file():
        raise ValueError(f"--data {p} does not exist: pass a folder, a .jsonl or a text file.")
    if p.suffix.lower() == JSONL_SUFFIX:
        return read_jsonl(p), str(p.resolve())
    text = _read(p)
    return [d for d in text.split("\n\n") if d.strip()], str(p.resolve())


def _read(path: Path) -> str:
    """A text file's text with every line ending (CRLF, CR) made LF, as documents are split at
    blank lines."""
    return read_utf8(path).replace("\r\n", "\n").replace("\r", "\n")


def load_documents(path: str | os.PathLike[str] | None = None) -> DocumentCorpus:
    """Load and byte-tokenize documents (see the module docstring); every tenth document is
    held out for validation.

    Raises:
        ValueError: the path is missing or unreadable, or fewer than 10 documents of at least
            :data:`MIN_DOC_TOKENS` tokens remain.
    """
    texts, source = _texts(None if path is None else os.fspath(path))
    tok = ByteTokenizer()
    docs = [t for t in (tok.encode_tensor(x) for x in texts) if len(t) > MIN_DOC_TOKENS]
    if len(docs) < 10:
        raise ValueError(
            f"{source} has {len(docs)} documents of more than {MIN_DOC_TOKENS} tokens; "
            "documents mode needs at least 10 (one in ten is held out for validation)."
        )
    val = [d for i, d in enumerate(docs) if i % 10 == 9]
    train = [d for i, d in enumerate(docs) if i % 10 != 9]
    logger.debug("%d training and %d validation documents from %s", len(train), len(val), source)
    return DocumentCorpus(train=train, val=val, vocab_size=tok.vocab_size, source=source)


class DocumentSampler:
    """Draws this rank's documents: ``draw(tokens)`` returns ``(doc, start, length)`` pieces
    whose lengths (predicted tokens) sum to exactly ``tokens``; a piece's inputs are
    ``doc[start : start + length]`` and its targets the same shifted by one.

    Pieces are at most ``cap`` tokens: a longer document contributes a random window. The
    generator is seeded from ``(seed, rank)``, so each rank reads its own stream."""

    def __init__(self, corpus: DocumentCorpus, cap: int, *, seed: int, rank: int) -> None:
        if cap < MIN_DOC_TOKENS:
            raise ValueError(f"document cap {cap} is below {MIN_DOC_TOKENS} tokens.")
        self.docs = corpus.train
        self.cap = cap
        self.generator = make_generator(seed, 1_000_003 + rank)

    def draw(self, tokens: int) -> list[tuple[int, int, int]]:
        pieces: list[tuple[int, int, int]] = []
        left = tokens
        while left > 0:
            i = int(torch.randint(len(self.docs), (1,), generator=self.generator))
            n = len(self.docs[i]) - 1  # predictions the document holds
            length = min(n, self.cap, left)
            start = 0
            if n > length:
                start = int(torch.randint(n - length + 1, (1,), generator=self.generator))
            pieces.append((i, start, length))
            left -= length
        return pieces

    def piece(self, doc: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of a piece."""
        t = self.docs[doc][start : start + length + 1]
        return t[:-1], t[1:]
