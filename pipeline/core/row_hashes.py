"""Stable 64-bit hashes of a row's id and text (a pair job's: its text and its pair, as one key): what
dedupe, the duplicate-id count and tomorrow's `--reuse` recognise a row by (the text-hash files keep
them, so they never change). The tokenizer workers compute them, where the strings already are, so
that the main process handles hash columns, not rows."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def text_hash(value) -> int | None:
    """A stable 64-bit hash of a row's text (str or bytes); None for a null text."""
    if value is None:
        return None
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def pair_hash(text, pair) -> int | None:
    """A stable 64-bit hash of a row's text and its pair, as one key (None if either is null): the
    text's byte length comes first, so ("ab", "c") and ("a", "bc") differ."""
    if text is None or pair is None:
        return None
    first, second = (value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
                     for value in (text, pair))
    data = len(first).to_bytes(8, "little") + first + second
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def id_hash(value) -> int:
    """A stable 64-bit hash of an id value (type included: 1 and "1" differ)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


@dataclass
class HashColumns:
    """Consecutive rows' hashes as columns: `id_hashes` 0 for a null id; `text_hashes` 0 and
    `has_text_hash` False where the text or the id is null."""

    id_hashes: np.ndarray  # int64
    text_hashes: np.ndarray  # int64
    has_text_hash: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.id_hashes)

    def slice(self, start: int, end: int) -> HashColumns:
        return HashColumns(self.id_hashes[start:end], self.text_hashes[start:end], self.has_text_hash[start:end])


def hash_columns(ids: Sequence, texts: Sequence, pairs: Sequence | None = None) -> HashColumns:
    """The hashes of rows given as Python values; with `pairs`, each row's text hash is its
    (text, pair) hash (`pair_hash`), null where either is null."""
    rows = len(ids)
    id_hashes = np.fromiter((id_hash(v) if v is not None else 0 for v in ids), np.int64, rows)
    if pairs is None:
        has_text = np.fromiter((i is not None and t is not None for i, t in zip(ids, texts)), bool, rows)
        text_hashes = np.fromiter((text_hash(t) if ok else 0 for t, ok in zip(texts, has_text)), np.int64, rows)
    else:
        has_text = np.fromiter((i is not None and t is not None and p is not None
                                for i, t, p in zip(ids, texts, pairs)), bool, rows)
        text_hashes = np.fromiter((pair_hash(t, p) if ok else 0 for t, p, ok in zip(texts, pairs, has_text)),
                                  np.int64, rows)
    return HashColumns(id_hashes, text_hashes, has_text)


def concat_hash_columns(parts: Sequence[HashColumns]) -> HashColumns:
    return HashColumns(np.concatenate([p.id_hashes for p in parts]), np.concatenate([p.text_hashes for p in parts]),
                       np.concatenate([p.has_text_hash for p in parts]))
