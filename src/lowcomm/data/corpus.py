"""Text corpora, a byte-level tokenizer and batch sampling for the ``lowcomm train`` job.

Nothing here downloads anything: the default corpus is the English help text that ships with
Python itself (:mod:`pydoc_data.topics`, about 0.46 MB), and the tokenizer maps UTF-8 bytes to
ids 0..255. That keeps experiments self-contained and reproducible on machines without network
access, which is the setting lowcomm targets.

Determinism is the main design constraint: data-parallel experiments compare optimisers by
their loss curves, so the same seed must give the same batches. :func:`get_batch` draws only
from the :class:`torch.Generator` it is given (use :func:`make_generator` to seed one per
``(seed, rank)`` so workers see different data), and :func:`eval_batches` uses no randomness at
all so validation loss is measured on identical windows across runs and algorithms.

Example::

    corpus = load_corpus()                                  # embedded corpus
    gen = make_generator(seed=0, rank=rank)
    x, y = get_batch(corpus.train, batch_size=16, block_size=128, generator=gen)
    val = eval_batches(corpus.val, batch_size=16, block_size=128, num_batches=8)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "EMBEDDED_SOURCE",
    "JSONL_SUFFIX",
    "MIN_TEXT_BYTES",
    "TEXT_SUFFIXES",
    "BatchSampler",
    "ByteTokenizer",
    "Corpus",
    "embedded_text",
    "eval_batches",
    "get_batch",
    "load_corpus",
    "load_text",
    "make_generator",
    "read_jsonl",
    "read_utf8",
    "text_files",
]

logger = logging.getLogger(__name__)

EMBEDDED_SOURCE = "embedded:pydoc_data.topics"
"""The :attr:`Corpus.source` of the default corpus."""

MIN_TEXT_BYTES = 4096
"""Smallest text (in UTF-8 bytes, i.e. tokens) :func:`load_text` accepts for training."""

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".text"})
"""File suffixes (matched case-insensitively) that :func:`load_text` reads from a folder as
text (besides :data:`JSONL_SUFFIX`)."""

JSONL_SUFFIX = ".jsonl"
"""The suffix (matched case-insensitively) of a JSON Lines file of documents
(:func:`read_jsonl`), named or in a folder."""

_CORPUS_SUFFIXES = TEXT_SUFFIXES | {JSONL_SUFFIX}
"""What :func:`load_text` reads from a folder (and :func:`text_files` finds by default)."""


class ByteTokenizer:
    """UTF-8 byte tokenizer: every byte is a token, so any text encodes and nothing is unknown.

    A learned vocabulary would compress better but needs training or a download; for comparing
    communication strategies the tokenizer only has to be fixed and lossless.
    """

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor (fast path for whole corpora)."""
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a model sample cut mid-character) becomes U+FFFD.

        Raises:
            ValueError: an id is outside ``0..255``.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        try:
            raw = bytes(ids)
        except ValueError as exc:
            raise ValueError(
                f"ByteTokenizer.decode got an id outside 0..255 ({exc}): "
                "pass ids produced by ByteTokenizer.encode or a vocab-256 model."
            ) from exc
        return raw.decode("utf-8", errors="replace")


def embedded_text() -> str:
    """The default corpus: Python's own help topics, joined in sorted topic order.

    Deterministic for a given Python version (the text is part of the standard library, so it
    can differ slightly between Python releases).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some minimal distro builds strip pydoc_data
        raise ValueError(
            "The embedded corpus needs the standard-library module pydoc_data, which this "
            "Python lacks: pass a text file or folder path instead."
        ) from exc
    return "\n\n".join(topics[name] for name in sorted(topics))


_JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
    dict: "object",
}


def _document_text(line: str) -> str:
    """The ``"text"`` of one JSON Lines record; a ValueError saying what the line is instead."""
    try:
        record = json.loads(line)
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {_JSON_KINDS.get(type(record), 'value')}")
    if "text" not in record:
        raise ValueError(f"its keys are {sorted(record)[:5]}")
    text = record["text"]
    if not isinstance(text, str):
        raise ValueError(f'its "text" is a JSON {_JSON_KINDS.get(type(text), "value")}')
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # an escaped lone surrogate is not UTF-8 text
        raise ValueError(
            f'its "text" holds the unpaired surrogate \\u{ord(e.object[e.start]):04x}'
        ) from None
    return text


def read_jsonl(path: Path) -> list[str]:
    """The documents of a JSON Lines file: the ``"text"`` string of every line, in order (blank
    lines skipped).

    Raises:
        ValueError: the file is unreadable or not UTF-8, or a line is not a JSON object whose
            ``"text"`` is a UTF-8 string (naming the line and what it is).
    """
    docs = []
    # lines end at "\n" only: str.splitlines() would also cut at U+2028 and the other
    # separators JSON allows unescaped inside a string
    for n, line in enumerate(read_utf8(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            docs.append(_document_text(line))
        except ValueError as e:
            raise ValueError(
                f'{path}:{n} is not a JSON object with a "text" string ({e}): write one '
                'document per line as {"text": "..."}.'
            ) from None
    return docs


def text_files(folder: Path, suffixes: Collection[str] | None = None) -> list[Path]:
    """The files under ``folder`` whose suffix is one of ``suffixes``, in any case (default:
    :data:`TEXT_SUFFIXES` and :data:`JSONL_SUFFIX`), recursively, sorted by relative path.

    Hidden files and folders (names starting with ``.``) are skipped, and not entered, so that
    a corpus folder that is also a repository or holds a virtualenv does not pull in ``.git`` or
    ``.venv``; symbolic links to folders are not followed.

    Raises:
        ValueError: a folder under ``folder`` (or itself) cannot be listed, naming it.
    """
    wanted = _CORPUS_SUFFIXES if suffixes is None else {s.lower() for s in suffixes}

    def fail(exc: OSError) -> None:
        where = exc.filename or folder
        raise ValueError(
            f"Cannot read folder {where}: {exc.strerror or exc}; check its permissions."
        ) from exc

    found: list[Path] = []
    for root, dirs, files in os.walk(folder, onerror=fail, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith(".") and Path(name).suffix.lower() in wanted:
                found.append(Path(root) / name)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def read_utf8(path: Path) -> str:
    """The UTF-8 text of the file at ``path``, exactly as stored (line endings kept).

    Raises:
        ValueError: the file cannot be read or is not UTF-8, naming it and the fix.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(
            f"Cannot read {path}: {exc.strerror or exc}; check that it exists and is readable."
        ) from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not valid UTF-8 (bad byte at offset {exc.start}): re-encode it as UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8) or remove it."
        ) from exc


def _file_text(path: Path) -> str:
    """A file's training text: a JSON Lines file's documents a blank line apart, any other file
    as it is."""
    if path.suffix.lower() == JSONL_SUFFIX:
        return "\n\n".join(read_jsonl(path))
    return read_utf8(path)


def load_text(path: str | os.PathLike[str] | None = None) -> str:
    """Load training text from ``path``, or the embedded corpus when ``path`` is None.

    A file is read whatever its suffix (the caller named it explicitly), except that a
    ``.jsonl`` file is read as JSON Lines (:func:`read_jsonl`: one document per line, its
    ``"text"``), its documents joined by a blank line. A folder contributes every file whose
    suffix is in :data:`TEXT_SUFFIXES` or is ``.jsonl`` (read so), recursively, in sorted path
    order, joined with a newline. Files must be UTF-8: decoding is strict because a silently
    mangled corpus (a binary or Latin-1 file) is worse than an error.

    Raises:
        ValueError: the path is missing or unreadable, a folder holds no text files, a file is
            not UTF-8, a ``.jsonl`` line is not a document, or the text is shorter than
            :data:`MIN_TEXT_BYTES` bytes.
    """
    if path is None:
        return embedded_text()
    if not os.fspath(path):
        # Path("") means the current directory, which is never what an empty setting meant.
        raise ValueError(
            "Corpus path is an empty string: pass a text file or folder, or omit it (None) to "
            "use the embedded corpus."
        )
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"Corpus path {p} does not exist: pass an existing text file or folder, "
            "or omit it to use the embedded corpus."
        )
    if p.is_dir():
        files = text_files(p)
        if not files:
            suffixes = "/".join(sorted(_CORPUS_SUFFIXES))
            raise ValueError(
                f"Corpus folder {p} contains no text files ({suffixes}): add some, "
                "or point at a single file."
            )
        text = "\n".join(_file_text(f) for f in files)
        logger.debug("loaded %d text files from %s", len(files), p)
    elif p.is_file():
        text = _file_text(p)
    else:
        raise ValueError(
            f"Corpus path {p} is neither a regular file nor a folder: pass a text file or folder."
        )
    n_bytes = len(text.encode("utf-8"))
    if n_bytes < MIN_TEXT_BYTES:
        raise ValueError(
            f"Corpus at {p} has only {n_bytes} bytes of text; training needs at least "
            f"{MIN_TEXT_BYTES} bytes: use a larger file or folder."
        )
    return text


@dataclass
class Corpus:
    """A tokenized corpus split into a training and a validation token stream."""

    train: torch.Tensor = field(repr=False)
    """Training token ids, 1-D int64 (the first ``1 - val_fraction`` of the stream)."""
    val: torch.Tensor = field(repr=False)
    """Validation token ids, 1-D int64 (the last ``val_fraction`` of the stream)."""
    vocab_size: int
    """Size of the token vocabulary (256 for the byte tokenizer)."""
    source: str
    """Where the text came from: :data:`EMBEDDED_SOURCE` or the resolved path."""


def load_corpus(path: str | os.PathLike[str] | None = None, *, val_fraction: float = 0.1) -> Corpus:
    """Load text with :func:`load_text`, byte-tokenize it and split off the tail for validation.

    The split is contiguous (not shuffled) so validation windows never overlap training text.

    Raises:
        ValueError: ``val_fraction`` is outside ``(0, 0.5)``, or as :func:`load_text`.
    """
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(
            f"val_fraction={val_fraction!r} is invalid: it must satisfy 0 < val_fraction < 0.5 "
            "(e.g. 0.1)."
        )
    text = load_text(path)
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode_tensor(text)
    n_train = int(len(tokens) * (1.0 - val_fraction))
    source = EMBEDDED_SOURCE if path is None else str(Path(path).expanduser().resolve())
    return Corpus(
        train=tokens[:n_train].clone(),
        val=tokens[n_train:].clone(),
        vocab_size=tokenizer.vocab_size,
        source=source,
    )


def make_generator(seed: int, rank: int = 0) -> torch.Generator:
    """A CPU :class:`torch.Generator` seeded from ``(seed, rank)``.

    The pair is hashed rather than added so that e.g. ``(seed=1, rank=0)`` and
    ``(seed=0, rank=1)`` give unrelated streams.
    """
    digest = hashlib.blake2b(f"lowcomm-data:{seed}:{rank}".encode(), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest, "little"))
    return gen


def _check_window_args(tokens: torch.Tensor, batch_size: int, block_size: int, what: str) -> None:
    if tokens.dim() != 1:
        raise ValueError(f"{what}: tokens must be 1-D, got shape {tuple(tokens.shape)}.")
    if batch_size <= 0 or block_size <= 0:
        raise ValueError(
            f"{what}: batch_size={batch_size} and block_size={block_size} must be positive."
        )
    if len(tokens) < block_size + 1:
        raise ValueError(
            f"{what}: split has {len(tokens)} tokens but a window of block_size={block_size} "
            f"needs at least {block_size + 1}: use more text, a larger split or a smaller "
            "block_size."
        )


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(block_size + 1)
    chunk = tokens[starts[:, None] + offsets]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def get_batch(
    split_tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random contiguous windows: ``x`` of shape ``(batch_size, block_size)`` and ``y = x`` + 1.

    The only randomness is one draw from ``generator``, so the batch sequence is a pure
    function of the generator's seed. Tensors stay on CPU; move them to the model's device.

    Raises:
        ValueError: the split is shorter than ``block_size + 1`` tokens or sizes are not positive.
    """
    _check_window_args(split_tokens, batch_size, block_size, "get_batch")
    high = len(split_tokens) - block_size
    starts = torch.randint(high, (batch_size,), generator=generator)
    return _windows(split_tokens, starts, block_size)


def eval_batches(
    val_tokens: torch.Tensor, batch_size: int, block_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: ``batch_size * num_batches`` evenly spaced windows.

    The windows run from the start to the end of the split (they overlap when the split is
    short), with no randomness, so every run and every algorithm is scored on the same text.

    Raises:
        ValueError: the split is shorter than ``block_size + 1`` tokens or sizes are not positive.
    """
    _check_window_args(val_tokens, batch_size, block_size, "eval_batches")
    if num_batches <= 0:
        raise ValueError(f"eval_batches: num_batches={num_batches} must be positive.")
    n = batch_size * num_batches
    max_start = len(val_tokens) - block_size - 1
    starts = torch.arange(n, dtype=torch.int64) * max_start // max(n - 1, 1)
    x, y = _windows(val_tokens, starts, block_size)
    return [
        (x[i : i + batch_size].clone(), y[i : i + batch_size].clone())
        for i in range(0, n, batch_size)
    ]


class BatchSampler:
    """Endless iterator of training batches for one worker, seeded from ``(seed, rank)``.

    A thin wrapper over :func:`get_batch` and :func:`make_generator` so the training loop does
    not have to carry the generator around.
    """

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, block_size: int, *, seed: int, rank: int = 0
    ) -> None:
        _check_window_args(tokens, batch_size, block_size, "BatchSampler")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = make_generator(seed, rank)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)`` batch."""
        return get_batch(self.tokens, self.batch_size, self.block_size, self.generator)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()
