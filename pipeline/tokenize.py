"""Tokenizing on a pool of CPU processes: texts in, flat numpy token arrays out.

The main process loads the model's fast tokenizer once and hands its serialized form to
the workers, which rebuild it with the `tokenizers` library alone (no torch, no
transformers import per worker). Results cross the process boundary as numpy arrays, not
per-token Python objects. A text that cannot be tokenized becomes a row error.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK_ROWS = 256  # texts per pool task: large enough to amortise IPC, small enough to spread


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer: its JSON, the truncation length, pad id."""

    tokenizer_json: str
    max_length: int
    pad_token_id: int


@dataclass
class EncodedRows:
    """Token ids of consecutive rows, flattened; rows with an error have length 0."""

    token_ids: np.ndarray  # int32, all rows' ids concatenated
    offsets: np.ndarray  # int64, len(rows) + 1; row i is token_ids[offsets[i]:offsets[i+1]]
    truncated: np.ndarray  # bool, the text was longer than max_length tokens
    errors: list  # str or None per row
    encode_s: float  # worker time spent tokenizing

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.errors)


def load_tokenizer_spec(model_path: str, max_length: int) -> TokenizerSpec:
    """Load the model's fast tokenizer once, truncating at max_length and never padding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise RuntimeError(f"{model_path} has no fast tokenizer (tokenizer.json); lengthwise needs one")
    backend.no_padding()
    backend.enable_truncation(max_length=max_length)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TokenizerSpec(backend.to_str(), max_length, int(pad_token_id))


def row_error(text) -> str | None:
    """Why a text value cannot be tokenized, or None if it can."""
    if text is None:
        return "text is null"
    if not isinstance(text, str):
        return f"text is a {type(text).__name__}, not a string"
    if not text.strip():
        return "text is empty or whitespace only"
    return None


_worker_tokenizer = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the pool
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_str(spec.tokenizer_json)


def encode_texts(texts: Sequence) -> EncodedRows:
    """Tokenize one chunk of texts with this process's tokenizer (set by _init_worker)."""
    started = time.perf_counter()
    errors = [row_error(text) for text in texts]
    good = [text for text, error in zip(texts, errors) if error is None]
    encodings = _worker_tokenizer.encode_batch(good) if good else []
    lengths = np.zeros(len(texts), dtype=np.int64)
    truncated = np.zeros(len(texts), dtype=bool)
    good_positions = np.flatnonzero(np.array([e is None for e in errors], dtype=bool))
    lengths[good_positions] = [len(e.ids) for e in encodings]
    truncated[good_positions] = [bool(e.overflowing) for e in encodings]
    token_ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int32, count=int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return EncodedRows(token_ids, offsets, truncated, errors, time.perf_counter() - started)


def concat_encoded(parts: Sequence[EncodedRows]) -> EncodedRows:
    """Join encoded chunks of consecutive rows into one."""
    lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
    return EncodedRows(
        token_ids=np.concatenate([p.token_ids for p in parts]) if parts else np.zeros(0, np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        truncated=np.concatenate([p.truncated for p in parts]) if parts else np.zeros(0, bool),
        errors=[e for p in parts for e in p.errors],
        encode_s=sum(p.encode_s for p in parts),
    )


class TokenizerPool:
    """A pool of tokenizer processes (spawned, never forked); workers=0 tokenizes in-process.

    `submit` returns at once so tokenizing the next window overlaps the model running on
    the current one; `result` waits for it.
    """

    def __init__(self, spec: TokenizerSpec, workers: int, chunk_rows: int = CHUNK_ROWS):
        self.spec = spec
        self.chunk_rows = chunk_rows
        self._pool = None
        if workers > 0:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(workers, initializer=_init_worker, initargs=(spec,))
        else:
            _init_worker(spec)

    def submit(self, texts: list) -> list:
        chunks = [texts[i:i + self.chunk_rows] for i in range(0, len(texts), self.chunk_rows)]
        if self._pool is None:
            return [encode_texts(chunk) for chunk in chunks]
        return [self._pool.apply_async(encode_texts, (chunk,)) for chunk in chunks]

    def result(self, pending: list) -> EncodedRows:
        return concat_encoded([p if self._pool is None else p.get() for p in pending])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
