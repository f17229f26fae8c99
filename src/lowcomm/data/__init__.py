"""Training data: the embedded corpus, a byte tokenizer and deterministic batch sampling."""

from lowcomm.data.corpus import (
    EMBEDDED_SOURCE,
    JSONL_SUFFIX,
    MIN_TEXT_BYTES,
    TEXT_SUFFIXES,
    BatchSampler,
    ByteTokenizer,
    Corpus,
    embedded_text,
    eval_batches,
    get_batch,
    load_corpus,
    load_text,
    make_generator,
    read_jsonl,
    read_utf8,
    text_files,
)

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
