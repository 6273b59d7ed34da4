"""Tokenizing on a pool of CPU processes: texts in, flat numpy token arrays out.

The main process loads the model's fast tokenizer once and hands its serialized form to
the workers, which rebuild it with the `tokenizers` library alone (no torch, no
transformers import per worker). Results cross the process boundary as numpy arrays, not
per-token Python objects. A text that cannot be tokenized becomes a row error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.core.pairs import carries_pair_types, encode_pairs, whole_tokenizer
from pipeline.core.process_memory import prepare_streaming_memory
from pipeline.core.row_hashes import HashColumns, concat_hash_columns, hash_columns
from pipeline.core.segments import RowSegments, concat_segments, empty_segments, split_text
from pipeline.core.shared_arrays import ArrayInMemory, InSlot, TokenSlot, as_python, chunk_of, into_slot
from pipeline.core.textcut import check_text, encode_long_text, has_long_word, text_cut_for, word_limit_for
from pipeline.core.worker_pool import WorkerPool

# texts per pool task: at least the first, so that handing results over (the caller unpickles each, holding the
# GIL) costs little a row; at most the second; within that, 4 tasks per worker of each submit
CHUNK_ROWS = (256, 2048)


def chunk_rows_for(rows: int, workers: int, bounds: tuple[int, int] = CHUNK_ROWS) -> int:
    """Rows per pool task for a submit of `rows` texts to `workers` processes."""
    return max(bounds[0], min(bounds[1], -(-rows // (4 * max(1, workers)))))
@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer and prepare texts as the model expects."""

    tokenizer_json: str
    max_length: int
    pad_token_id: int
    prompt: str = ""  # put before every text (sentence-transformers prompts)
    lowercase: bool = False  # lower-case prompt + text first (sentence-transformers do_lower_case)
    segment_length: int = 0  # --long-text split: rows longer than max_length become segments of at most this
    # many tokens (pipeline/core/segments.py); 0 = truncate them
    pair: bool = False  # the job's rows are a text and its pair, encoded as one sequence (pipeline/core/pairs.py)
    pair_types: bool = False  # a pair's texts have different token types (BERT): they travel with the batch


def rows_without_error(errors: list) -> np.ndarray:
    """Per row, whether its error is None. A list without any error, the usual case, is counted in C
    (1 ns a row, against 25 for a test a row in Python)."""
    if errors.count(None) == len(errors):
        return np.ones(len(errors), dtype=bool)
    return np.array([error is None for error in errors], dtype=bool)


@dataclass
class EncodedRows:
    """Token ids of consecutive rows, flattened; rows with an error have length 0."""

    token_ids: np.ndarray  # int32, all rows' ids concatenated
    offsets: np.ndarray  # int64, len(rows) + 1; row i is token_ids[offsets[i]:offsets[i+1]]
    truncated: np.ndarray  # bool, the text was longer than max_length tokens
    errors: list  # str or None per row
    encode_s: float  # worker time spent tokenizing
    cut_tokens: np.ndarray | None = None  # int64, tokens truncation cut off each row (None: nothing cut)
    segments: RowSegments | None = None  # --long-text split: the segments of rows longer than max_length
    hashes: HashColumns | None = None  # the rows' id and text hashes, where their ids were given
    type_ids: np.ndarray | None = None  # int8 beside token_ids: a pair's token types, where they differ

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def full_lengths(self) -> np.ndarray:
        """Each row's length had it not been truncated: what a --max-length covering the data needs."""
        return self.lengths if self.cut_tokens is None else self.lengths + self.cut_tokens

    def __len__(self) -> int:
        return len(self.errors)

    def with_segments(self) -> EncodedRows:
        """What runs of these rows under --long-text split: the rows, then their segments (position
        len(self) + i is segment i); themselves when nothing was split."""
        segments = self.segments
        if segments is None or not len(segments):
            return self
        return EncodedRows(np.concatenate([self.token_ids, segments.token_ids]),
                           np.concatenate([self.offsets, self.offsets[-1] + segments.offsets[1:]]),
                           np.concatenate([self.truncated, np.zeros(len(segments), bool)]),
                           self.errors + [None] * len(segments), 0.0)

    def scored_positions(self, rows: np.ndarray) -> np.ndarray:
        """Positions in `with_segments()` of what runs for `rows`: each row that fit, the segments of each
        that was split."""
        segments = self.segments
        if segments is None or not len(segments):
            return rows
        split = np.isin(segments.row, rows)
        return np.concatenate([rows[~np.isin(rows, segments.row)], len(self) + np.flatnonzero(split)])


def load_tokenizer_spec(model_path: str, max_length: int, trust_remote_code: bool = False, prompt: str = "",
                        lowercase: bool = False, pair: bool = False) -> TokenizerSpec:
    """Load the model's fast tokenizer once, truncating at max_length and never padding; `pair`:
    the job's rows are pairs of texts (`carries_pair_types`: whether their token types travel)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise RuntimeError(f"{model_path} has no fast tokenizer (tokenizer.json); lengthwise needs one")
    backend.no_padding()
    backend.enable_truncation(max_length=max_length)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TokenizerSpec(backend.to_str(), max_length, int(pad_token_id), prompt, lowercase, pair=pair,
                         pair_types=pair and carries_pair_types(tokenizer))


def count_prompt_tokens(spec: TokenizerSpec) -> int:
    """Leading tokens the prompt takes in every row: the prompt tokenized alone, less a
    trailing special token (how sentence-transformers counts it for `include_prompt: false`)."""
    if not spec.prompt:
        return 0
    from tokenizers import Tokenizer

    encoding = Tokenizer.from_str(spec.tokenizer_json).encode(prepare_text(spec, ""))
    return len(encoding.ids) - (1 if encoding.special_tokens_mask and encoding.special_tokens_mask[-1] else 0)


def prepare_text(spec: TokenizerSpec, text: str) -> str:
    """The string the tokenizer sees for a row's text."""
    text = spec.prompt + text
    return text.lower() if spec.lowercase else text


_worker_tokenizer = None
_worker_whole_tokenizer = None  # a pair job's: truncation off
_worker_spec: TokenizerSpec | None = None


def _init_worker(spec: TokenizerSpec, in_worker: bool = True) -> None:
    global _worker_tokenizer, _worker_whole_tokenizer, _worker_spec
    if in_worker:
        # Ctrl-C and a group SIGTERM reach the workers too; the parent decides how to stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the pool
        threading.Thread(target=_exit_with_parent, name="lengthwise-parent-watch", daemon=True).start()
        prepare_streaming_memory()  # it converts each task's Arrow texts (pipeline/core/process_memory.py)
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    _worker_whole_tokenizer = whole_tokenizer(spec.tokenizer_json) if spec.pair else None
    _worker_spec = spec


def write_spec_file(spec: TokenizerSpec) -> str:
    """The spec in a temporary file, for the workers to read. Spawn hands a new process its
    arguments through a pipe while the parent itself still holds the pipe's read end, so a
    worker that dies before reading a large argument (a tokenizer is ~1 MB) blocks the parent
    forever; a path is small enough to never block."""
    descriptor, path = tempfile.mkstemp(prefix="lengthwise-tokenizer-", suffix=".json")
    with os.fdopen(descriptor, "w") as f:
        json.dump(dataclasses.asdict(spec), f)
    return path


def _init_worker_from_file(spec_path: str) -> None:
    with open(spec_path) as f:
        _init_worker(TokenizerSpec(**json.load(f)))


def _exit_with_parent() -> None:
    """A worker whose parent died (even by SIGKILL) exits instead of waiting forever."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def encode_texts(texts: Sequence | pa.Array | ArrayInMemory, tokenizer=None, spec: TokenizerSpec | None = None,
                 ids: Sequence | pa.Array | ArrayInMemory | None = None,
                 pairs: Sequence | pa.Array | ArrayInMemory | None = None) -> EncodedRows:
    """Tokenize one chunk of texts with `tokenizer` prepared by `spec` (default: this
    process's, set by _init_worker; the online batcher passes its own). A long text is
    tokenized from a prefix that keeps the same tokens (pipeline/core/textcut.py). Arrow
    arrays (or where they lie in shared memory) become Python values here, in the worker; with
    `ids`, the rows' hashes are computed here too (`EncodedRows.hashes`). With `pairs` (a pair
    job's), each row is its text and its pair, encoded as one sequence (`encode_pair_rows`)."""
    started = time.perf_counter()
    whole = _worker_whole_tokenizer if spec is None else None  # a spec of the caller's: its own, below
    tokenizer, spec = tokenizer or _worker_tokenizer, spec or _worker_spec
    texts, ids, pairs = (as_python(values) for values in (texts, ids, pairs))
    hashes = None
    if ids is not None:
        hashes = hash_columns(ids, texts, pairs)
    if pairs is not None:
        encoded = encode_pair_rows(tokenizer, whole or whole_tokenizer(spec.tokenizer_json), spec, texts, pairs)
        return dataclasses.replace(encoded, encode_s=time.perf_counter() - started, hashes=hashes)
    checked = [check_text(value) for value in texts]
    errors = [error for _, error in checked]
    good_positions = np.flatnonzero(np.array([e is None for e in errors], dtype=bool))
    good = [prepare_text(spec, checked[position][0]) for position in good_positions]
    encodings, shares = _encode_prepared(tokenizer, spec, good)
    lengths = np.zeros(len(texts), dtype=np.int64)
    truncated = np.zeros(len(texts), dtype=bool)
    lengths[good_positions] = [len(e.ids) for e in encodings]
    truncated[good_positions] = [bool(e.overflowing) or share < 1 for e, share in zip(encodings, shares)]
    content = np.array([len(e.ids) - sum(e.special_tokens_mask) for e in encodings], dtype=np.int64)
    overflow = np.array([sum(len(o.ids) - sum(o.special_tokens_mask) for o in e.overflowing) for e in encodings],
                        dtype=np.int64)  # the overflow pieces repeat the special tokens
    cut_tokens = np.zeros(len(texts), dtype=np.int64)  # of a prefix: estimated from its tokens per character
    estimated = np.rint((content + overflow) / np.array(shares, dtype=float)).astype(np.int64)
    cut_tokens[good_positions] = estimated - content
    for index in np.flatnonzero(content <= prompt_content_tokens(tokenizer, spec)):
        position = good_positions[index]  # only special (and prompt) tokens, e.g. U+FFFD alone
        errors[position] = "text has no tokens" if shares[index] == 1 else "text has no tokens in its first " \
            f"{text_cut_for(spec.tokenizer_json, spec.max_length).last_cut_chars:,} characters, the most a row is read"
        lengths[position] = truncated[position] = cut_tokens[position] = 0
    kept = [encodings[i] for i, position in enumerate(good_positions) if errors[position] is None]
    token_ids = np.fromiter((t for e in kept for t in e.ids), dtype=np.int32, count=int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    segments = None
    if spec.segment_length:
        raw = {int(position): checked[position][0] for position in good_positions if errors[position] is None}
        segments = _split_long_rows(tokenizer, spec, raw, truncated)
    truncated[_rows_with_long_words(spec, token_ids, offsets, encodings, good_positions)] = True  # a row that fit
    return EncodedRows(token_ids, offsets, truncated, errors, time.perf_counter() - started, cut_tokens, segments,
                       hashes)


def encode_pair_rows(tokenizer, whole, spec: TokenizerSpec, texts: list, pairs: list) -> EncodedRows:
    """Rows of a text and its pair (pipeline/core/pairs.py); either one null, empty or without tokens is
    the row's error (the pair's says `pair …`). The prompt goes before the text."""
    checked, checked_pairs = [check_text(value) for value in texts], [check_text(value) for value in pairs]
    errors = [error or (pair_error and f"pair {pair_error}")
              for (_, error), (_, pair_error) in zip(checked, checked_pairs)]
    good = np.flatnonzero(rows_without_error(errors))
    encoded = encode_pairs(tokenizer, whole, spec.tokenizer_json, spec.max_length,
                           [prepare_text(spec, checked[row][0]) for row in good],
                           [checked_pairs[row][0].lower() if spec.lowercase else checked_pairs[row][0] for row in good],
                           spec.pair_types)
    no_text = encoded["first_tokens"] <= prompt_content_tokens(tokenizer, spec)
    empty = no_text | (encoded["second_tokens"] == 0)
    for index in np.flatnonzero(empty):
        errors[good[index]] = "text has no tokens" if no_text[index] else "pair text has no tokens"
    lengths, truncated, cut_tokens = np.zeros(len(texts), np.int64), np.zeros(len(texts), bool), np.zeros(len(texts),
                                                                                                          np.int64)
    for values, name in ((lengths, "lengths"), (truncated, "truncated"), (cut_tokens, "cut_tokens")):
        values[good[~empty]] = encoded[name][~empty]
    tokens = np.repeat(~empty, encoded["lengths"])  # a row found to have no tokens after all keeps none
    types = encoded["type_ids"]
    return EncodedRows(encoded["token_ids"][tokens], np.concatenate([[0], np.cumsum(lengths)]), truncated, errors, 0.0,
                       cut_tokens, type_ids=None if types is None else types[tokens])


def _rows_with_long_words(spec: TokenizerSpec, token_ids: np.ndarray, offsets: np.ndarray, encodings: list,
                          good_positions: np.ndarray) -> list[int]:
    """The rows with a word WordPiece read as one [UNK] for its length (part of the text the model
    never sees); only rows with an [UNK] among their tokens are looked at."""
    limit = word_limit_for(spec.tokenizer_json)
    if limit is None:
        return []
    unknown = np.unique(np.searchsorted(offsets, np.flatnonzero(token_ids == limit.unk_id), side="right") - 1)
    return [int(row) for row in unknown if has_long_word(encodings[np.searchsorted(good_positions, row)], limit)]


def _split_long_rows(tokenizer, spec: TokenizerSpec, texts: dict, truncated: np.ndarray) -> RowSegments:
    """The segments of the truncated rows among `texts` (position → text); a row split whole is
    no longer truncated (it stays so when MAX_SEGMENTS_PER_ROW stopped it, or a segment has a word
    WordPiece read as one [UNK] for its length)."""
    segments = empty_segments(len(truncated))
    for position, text in texts.items():
        segments.row_chars[position] = len(text)
    long_rows = [position for position in np.flatnonzero(truncated) if int(position) in texts]
    if not long_rows:
        return segments
    overhead = len(tokenizer.encode(prepare_text(spec, "")).ids)  # the specials and the prompt
    chunk_chars = text_cut_for(spec.tokenizer_json, spec.max_length).first_cut_chars
    limit = word_limit_for(spec.tokenizer_json)
    token_ids, lengths, rows, spans = [], [], [], []
    for position in long_rows:
        encodings, row_spans, capped = split_text(tokenizer, lambda span: prepare_text(spec, span),
                                                  texts[int(position)], spec.segment_length, chunk_chars, overhead)
        truncated[position] = capped or (limit is not None and any(has_long_word(e, limit) for e in encodings))
        token_ids += [e.ids for e in encodings]
        lengths += [len(e.ids) for e in encodings]
        rows += [position] * len(encodings)
        spans += row_spans
    segments.token_ids = np.fromiter((t for ids in token_ids for t in ids), np.int32, count=sum(lengths))
    segments.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    segments.row = np.array(rows, np.int64)
    segments.spans = np.array(spans, np.int32).reshape(-1, 2)
    return segments


def _encode_prepared(tokenizer, spec: TokenizerSpec, texts: list) -> tuple[list, list]:
    """(encodings, the share of each text tokenized): short texts in one batch, long ones
    each from a prefix."""
    cut = text_cut_for(spec.tokenizer_json, spec.max_length)
    short = [text for text in texts if len(text) <= cut.first_cut_chars]
    encodings = iter(tokenizer.encode_batch(short) if short else [])
    results = [(next(encodings), 1.0) if len(text) <= cut.first_cut_chars else encode_long_text(tokenizer, text, cut)
               for text in texts]
    return [encoding for encoding, _ in results], [share for _, share in results]


def prompt_content_tokens(tokenizer, spec: TokenizerSpec) -> int:
    """Tokens other than special ones the prompt alone gives: a row with no more has no text tokens."""
    if not spec.prompt:
        return 0
    encoding = tokenizer.encode(prepare_text(spec, ""))
    return len(encoding.ids) - sum(encoding.special_tokens_mask)


def _encode_task(slot: str, capacity: int, texts, ids, pairs) -> InSlot:
    """A worker's task: `encode_texts`, written into the run's slot (core/shared_arrays.py); offsets as int32
    and no cut_tokens where nothing was cut, so there is less to write and read (the caller joins lengths)."""
    encoded = encode_texts(texts, ids=ids, pairs=pairs)
    if encoded.offsets[-1] < 2**31:
        encoded.offsets = encoded.offsets.astype(np.int32)
    if encoded.cut_tokens is not None and not encoded.cut_tokens.any():
        encoded.cut_tokens = None
    return into_slot(slot, capacity, encoded)


def concat_encoded(parts: Sequence[EncodedRows], slots: Sequence[TokenSlot] = ()) -> EncodedRows:
    """Join encoded chunks of consecutive rows into one (a part's token ids read from its slot, if given)."""
    lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    token_ids, start = np.empty(int(offsets[-1]), np.int32), 0
    for part, slot in itertools.zip_longest(parts, slots):
        end = start + int(part.offsets[-1])
        if slot is None:
            token_ids[start:end] = part.token_ids
        else:
            slot.copy_into(part, token_ids[start:end])
        start = end
    return EncodedRows(
        token_ids=token_ids,
        offsets=offsets,
        truncated=np.concatenate([p.truncated for p in parts]) if parts else np.zeros(0, bool),
        errors=list(itertools.chain.from_iterable(p.errors for p in parts)),
        encode_s=sum(p.encode_s for p in parts),
        cut_tokens=np.concatenate([np.zeros(len(p), np.int64) if p.cut_tokens is None else p.cut_tokens for p in parts])
        if parts else np.zeros(0, np.int64),
        segments=concat_segments([p.segments for p in parts]) if parts and parts[0].segments is not None else None,
        hashes=concat_hash_columns([p.hashes for p in parts]) if parts and all(p.hashes is not None for p in parts)
        else None,
        type_ids=np.concatenate([p.type_ids for p in parts]) if parts and parts[0].type_ids is not None else None,
    )


START_TIMEOUT_S = 120.0  # a worker imports numpy and tokenizers and rebuilds the tokenizer: seconds


class WorkerStartError(RuntimeError):
    """A tokenizer worker could not start; the message says what to change."""


class TokenizerPool:
    """A pool of tokenizer processes (spawned, never forked: `core/worker_pool.py`); workers=0
    tokenizes in-process.

    `submit` returns at once so tokenizing the next window overlaps the model running on
    the current one; `result` waits for it. A worker that dies (OOM killer, crash) fails
    the waiting `result` with BrokenProcessPool instead of hanging the run.
    """

    def __init__(self, spec: TokenizerSpec, workers: int, chunk_rows: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, wait: bool = True):
        """`wait` False starts the workers and returns at once, so they come up while the
        caller loads the model; `ready()` (or the first `submit`) then sees them up."""
        self.spec = spec
        self.chunk_rows, self.workers = chunk_rows, workers  # chunk_rows None: chunk_rows_for each submit
        self._pool: WorkerPool | None = None
        self._spec_file = None
        self._start_timeout_s: float | None = None  # until seen up
        if workers > 0:
            self._spec_file = write_spec_file(spec)
            self._pool = WorkerPool(workers, _init_worker_from_file, (self._spec_file,))
            self._start_timeout_s = start_timeout_s
            if wait:
                self.ready()
        else:
            _init_worker(spec, in_worker=False)

    def ready(self) -> float:
        """Wait until every worker is up (raises WorkerStartError if one cannot start); the
        seconds waited here. A worker that exits while starting would otherwise leave the pool
        waiting forever, and the usual cause is a script without a main guard."""
        if self._start_timeout_s is None:
            return 0.0
        waited = time.monotonic()
        timeout_s, self._start_timeout_s = self._start_timeout_s, None
        failure = self._pool.wait_until_up(timeout_s)
        self._remove_spec_file()  # every worker has read it, or none will
        if failure is not None:
            self.close()
            raise WorkerStartError(
                f"a tokenizer worker process {failure}. Workers are started with spawn, which runs the main script "
                f"again in each of them: a script that calls lengthwise must do so under "
                f"`if __name__ == \"__main__\":` (its error is above); or set tokenize_workers=0 "
                f"(--tokenize-workers 0) to tokenize in this process")
        return time.monotonic() - waited

    def submit(self, texts: Sequence | pa.Array, ids: pa.Array | None = None, pairs: pa.Array | None = None) -> list:
        """Tokenize `texts` (with their `pairs`, a pair job's; and hash the rows, given their `ids`) in
        chunks; an Arrow array's chunks go to the workers as where they lie in shared memory, else as
        compact Arrow buffers, and become Python values there."""
        self.ready()
        step = self.chunk_rows or chunk_rows_for(len(texts), self.workers)
        starts = range(0, len(texts), step)
        if self._pool is None:
            return [encode_texts(texts[i:i + step], ids=None if ids is None else ids[i:i + step],
                                 pairs=None if pairs is None else pairs[i:i + step]) for i in starts]
        slots = [TokenSlot(min(step, len(texts) - i) * self.spec.max_length) for i in starts]
        return [(self._pool.submit(_encode_task, slot.path, slot.capacity, chunk_of(texts, i, step),
                                   None if ids is None else chunk_of(ids, i, step),
                                   None if pairs is None else chunk_of(pairs, i, step)), slot)
                for i, slot in zip(starts, slots)]

    def result(self, pending: list) -> EncodedRows:
        if self._pool is None:
            return concat_encoded(pending)
        return concat_encoded([slot.read(self._pool.result(task)) for task, slot in pending],
                              [slot for _, slot in pending])

    def close(self) -> None:
        """Stop the workers now; a waiting `result` then fails rather than blocks."""
        self._remove_spec_file()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _remove_spec_file(self) -> None:
        if self._spec_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._spec_file)
            self._spec_file = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
