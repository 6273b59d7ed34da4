"""What a run measured and how it is reported: stage times, the summary, duplicate ids.

Pure bookkeeping (no torch), so engines can merge the summaries of several shard runners.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.core.findings import diagnosis_lines
from pipeline.core.row_hashes import id_hash
from pipeline.core.segments import MAX_SEGMENTS_PER_ROW
from pipeline.offline.lock import process_alive


@dataclass
class RunSummary:
    rows: int = 0  # rows written by this run (output_totals: by every run that wrote the output)
    reused_rows: int = 0  # --reuse: rows whose result was copied from the previous output (id and text unchanged)
    computed_rows: int = 0  # rows written by this run that were not reused (new, edited, or without --reuse)
    reuse: dict = field(default_factory=dict)  # --reuse: reused_by_text, moved (of the reused); new, edited, retried,
    # fixed, skipped (of the computed: ids yesterday had not; ids with another text; rows whose error may change, and
    # those it did; rows found in a previous shard whose results could not be proven theirs)
    reuse_warning: str = ""  # --reuse matched under 10% of the rows: why it may be
    deduplicated_rows: int = 0  # --dedupe: rows that copied the result of the same text earlier in their window
    error_rows: int = 0
    truncated_rows: int = 0
    split_rows: int = 0  # --long-text split: rows longer than --max-length, scored as segments and folded
    segments: int = 0  # the segments of those rows
    truncated_unflagged_rows: int = 0  # job moderate: truncated rows not flagged, whose cut-off rest nobody judged
    long_text: str = ""  # truncate or split
    shards: int = 0  # shards named by the input
    shards_done_before: int = 0  # skipped: committed by an earlier run
    failed_shards: list = field(default_factory=list)  # [{"shard", "error"}]: nothing of them committed
    duplicate_ids: int = 0  # rows whose id an earlier row of this run already had (both kept)
    duplicate_id_examples: list = field(default_factory=list)
    flagged_rows: int | None = None  # job moderate: rows flagged (None for other jobs)
    flagged_by_label: dict = field(default_factory=dict)  # job moderate: flag label → rows it flagged
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    padding_efficiency: float = 1.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    stage_s: dict = field(default_factory=dict)
    setup_steps: dict = field(default_factory=dict)  # what setup spent its seconds on, in order (core/clock.py)
    device_busy_fraction: float = 0.0
    peak_rss_bytes: int = 0  # the peak resident set of the process that ran the model (of the largest actor)
    peak_device_bytes: int = 0  # CUDA: the peak of memory the forwards allocated (0 on the CPU)
    oom_splits: int = 0  # batches halved after running out of memory
    lowered_batch_rows: dict = field(default_factory=dict)  # padded length → rows after a split
    batch_setting: str = ""  # the token and row limits, and where they came from
    batch_plan: str = ""  # where the memory plan came from
    device: str = ""
    dtype: str = ""
    dtype_reason: str = ""  # why this dtype (e.g. bfloat16: avx512_bf16, 1.7x faster, min cosine 0.9999 …)
    compile: str = ""  # eager or compiled, and why (--compile; e.g. compiled: 1.4x faster, min cosine 1.00000)
    compile_s: float = 0.0  # seconds this process spent compiling, or loading the compiled package (in setup)
    compiled_graphs: int = 0  # graphs the compiled forward runs on: 1, one exported graph for every shape
    unpad: str = ""  # which forward ran padded batches, and why (--unpad; e.g. unpadded: BertModel on packed tokens …)
    model: str = ""
    output: str = ""
    workers: list = field(default_factory=list)  # engine ray: per actor pid, host, shards, rows, rows/s
    token_lengths: dict = field(default_factory=dict)  # p50, p99, max of rows' token lengths before truncation
    error_reasons: dict = field(default_factory=dict)  # the most frequent row errors → rows
    settings: dict = field(default_factory=dict)  # the settings the diagnosis names (max_length, window_rows, …)
    sweep_reference: dict = field(default_factory=dict)  # the saved sweep figure for this model, device, dtype
    diagnosis: list = field(default_factory=list)  # [{code, evidence, action}] (pipeline/diagnosis.py)
    nothing_to_do: bool = False  # every shard was done before this run: it ran nothing
    output_totals: dict = field(default_factory=dict)  # the whole output, summed over its done markers
    models: dict = field(default_factory=dict)  # several models: per model its job, computed_rows, reused_rows,
    # flagged_rows and flagged_by_label (moderate), dtype, compile ({} for a one-model run)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        if self.nothing_to_do:
            return "\n".join([f"nothing to do: {self.shards} of {self.shards} shards done",
                              *totals_lines(self.output_totals), f"output          {self.output}"])
        stages = "  ".join(f"{name} {seconds:.2f}s" for name, seconds in self.stage_s.items())
        ran = self.shards - self.shards_done_before - len(self.failed_shards)
        lines = [
            f"rows            {self.rows:,} this run in {ran} shard(s) ({self.error_rows:,} with errors, "
            f"{self.truncated_rows:,} truncated, {self.duplicate_ids:,} duplicate ids)",
            f"tokens          {self.real_tokens:,} real / {self.padded_tokens:,} padded in {self.batches:,} batches"
            f" = padding efficiency {self.padding_efficiency:.3f}",
            f"throughput      {self.rows_per_s:,.1f} rows/s, {self.tokens_per_s:,.0f} tokens/s "
            f"in {self.wall_s:.2f}s wall",
        ]
        if stages:
            lines.append(f"stages          {stages}")
        if self.setup_steps:
            steps = " · ".join(f"{name} {seconds:.2f}s" for name, seconds in self.setup_steps.items()
                               if seconds >= 0.05)  # the steps worth a look
            lines.append(f"setup           {self.stage_s.get('setup', 0.0):.2f}s: {steps}")
        if self.device:
            lines += [f"device busy     {self.device_busy_fraction:.1%} of the time after setup "
                      f"({self.device}, {self.dtype})",
                      f"dtype           {self.dtype_reason or self.dtype}",
                      f"compile         {self.compile}" + (
                          f"; {self.compile_s:.1f}s to compile, {self.compiled_graphs} graph(s)"
                          if self.compile.startswith("compiled") else ""),
                      f"unpad           {self.unpad}",
                      f"batch setting   {self.batch_setting}",
                      f"batch plan      {self.batch_plan}" + (
                          f"; {self.oom_splits} out-of-memory splits, rows lowered to {self.lowered_batch_rows}"
                          if self.oom_splits else "")]
        if self.split_rows or self.long_text == "split":
            lines.insert(1, f"long texts      {self.split_rows:,} rows longer than --max-length split into "
                            f"{self.segments:,} segments, each scored (--long-text split)" + (
                                f"; {self.truncated_rows:,} truncated after {MAX_SEGMENTS_PER_ROW} segments"
                                if self.truncated_rows else ""))
        if self.flagged_rows is not None:
            lines.insert(1, f"flagged         {self.flagged_rows:,} of {self.rows:,} rows this run "
                            f"({label_counts(self.flagged_by_label)})" + (
                                f"; {self.truncated_unflagged_rows:,} truncated rows not flagged: only their first "
                                "--max-length tokens were judged" if self.truncated_unflagged_rows else ""))
        if self.reuse:
            lines.insert(1, carry_line(self.rows, self.reuse) if "carried" in self.reuse
                         else reuse_line(self.reused_rows, self.computed_rows, self.reuse))
        if self.deduplicated_rows:
            lines.insert(1, f"deduplicated    {self.deduplicated_rows:,} rows copied the result of the same text "
                            "earlier in their window (--no-dedupe computes each)")
        if self.reuse_warning:
            lines.insert(2, f"WARNING         {self.reuse_warning}")
        if self.shards_done_before:
            lines.append(f"resumed         {self.shards_done_before} of {self.shards} shards were already done")
        lines += [*model_lines(self.models), *totals_lines(self.output_totals), f"output          {self.output}"]
        if self.duplicate_ids:
            lines.append(f"duplicate ids   e.g. {', '.join(map(repr, self.duplicate_id_examples))}")
        for worker in self.workers:
            lines.append(f"actor {worker['actor']:<9} {worker['rows']:,} rows in {worker['shards']} shard(s), "
                         f"{worker['rows_per_s']:,.1f} rows/s, model loaded in {worker.get('setup_s', 0.0):.1f}s, "
                         f"device busy {worker.get('device_busy_fraction', 0.0):.0%} (pid {worker['pid']} on "
                         f"{worker['host']})")
        for failed in self.failed_shards:
            lines.append(f"FAILED          {failed['shard']}: {failed['error']}")
        lines.extend(diagnosis_lines(self.diagnosis))
        return "\n".join(lines)


def model_lines(models: dict) -> list[str]:
    """Per model of a run of several: its job, rows computed and reused, and flags."""
    return [f"model {name:<10}{entry['job']}: {entry['computed_rows']:,} rows computed, {entry['reused_rows']:,} "
            f"reused" + (f", {entry['flagged_rows']:,} flagged ({label_counts(entry['flagged_by_label'])})"
                         if "flagged_rows" in entry else "") + (f"; {entry['dtype']}" if "dtype" in entry else "")
            for name, entry in models.items()]


def reuse_line(reused: int, computed: int, counts: dict) -> str:
    """`reused 25,900 rows (2,700 moved, 12 by text under another id); computed 1,370: 540 new, 1,350 edited, …`"""
    skipped = counts.get("skipped", 0)
    without_text = computed - counts["new"] - counts["edited"] - counts["retried"] - skipped
    return (f"reused          {reused:,} rows from the previous output ({counts['moved']:,} moved from another "
            f"shard, {counts['reused_by_text']:,} by text under another id); {computed:,} computed: "
            f"{counts['new']:,} new, {counts['edited']:,} edited, {counts['retried']:,} retried after an error "
            f"({counts['fixed']:,} fixed), "
            + (f"{skipped:,} from a skipped previous shard (see its warning), " if skipped else "")
            + f"{without_text:,} without a text")


def carry_line(rows: int, counts: dict) -> str:
    """A change of models (offline/carry.py): `carried 240 rows' columns of the kept models; 3 rows ran every
    model: 1 new, 1 edited, 1 retried after an error`."""
    return (f"carried         {counts['carried']:,} rows' columns of the kept models from the output's earlier "
            f"shards; {rows - counts['carried']:,} rows ran every model: {counts['new']:,} new, "
            f"{counts['edited']:,} edited, {counts['retried']:,} retried after an error, {counts['skipped']:,} from "
            "a skipped shard, the others without a text")


LOW_REUSE_SHARE = 0.10


def low_reuse_warning(rows: int, reused: int, counts: dict, indexed_rows: int, previous: str) -> str:
    """Why --reuse matched under 10% of the rows, read off its counts ("" when it matched more)."""
    if not rows or reused >= LOW_REUSE_SHARE * rows:
        return ""
    share = f"--reuse matched {reused:,} of {rows:,} rows ({reused / rows:.0%})"
    if not indexed_rows:
        return (f"{share}: {previous} has no done shard with text hashes (made by an older lengthwise, or not "
                "finished); its next night reuses this output")
    if counts.get("edited", 0) >= counts.get("new", 0):
        return (f"{share}: {counts.get('edited', 0):,} rows have yesterday's id but another text; is --text-column "
                "the same, or did the export change the texts (cleaning, a prompt)?")
    return (f"{share}: {counts.get('new', 0):,} rows have an id {previous} does not have; is --id-column the "
            "same, and are ids stable from one export to the next?")


def label_counts(counts: dict) -> str:
    return ", ".join(f"{label} {rows:,}" for label, rows in counts.items())


def add_counts(parts: Iterable[dict]) -> dict:
    """Name → count, summed over `parts`, names in first-seen order."""
    total: dict = {}
    for part in parts:
        for name, count in part.items():
            total[name] = total.get(name, 0) + count
    return total


def top_counts(counts: dict, keep: int) -> dict:
    return dict(sorted(counts.items(), key=lambda item: -item[1])[:keep])


def output_totals(markers: Iterable[dict]) -> dict:
    """What the whole output holds, summed over the done markers of its shards (whichever run
    wrote them): shards, rows, error rows and their most frequent reasons, truncated rows, and for
    job moderate the flagged rows by label. A marker of an older version without counts adds
    its shard and rows only."""
    done = [marker for marker in markers if marker.get("status") == "done"]
    flagged = [marker for marker in done if marker.get("flagged_rows") is not None]
    return {"shards_done": len(done), "rows": sum(marker.get("rows", 0) for marker in done),
            "error_rows": sum(marker.get("error_rows", 0) for marker in done),
            "truncated_rows": sum(marker.get("truncated_rows", 0) for marker in done),
            "split_rows": sum(marker.get("split_rows", 0) for marker in done),
            "segments": sum(marker.get("segments", 0) for marker in done),
            "truncated_unflagged_rows": sum(marker.get("truncated_unflagged_rows", 0) for marker in done),
            "error_reasons": top_counts(add_counts(m.get("error_reasons", {}) for m in done), TOP_ERROR_REASONS),
            "flagged_rows": sum(marker["flagged_rows"] for marker in flagged) if flagged else None,
            "flagged_by_label": add_counts(marker.get("flagged_by_label", {}) for marker in flagged)}


def totals_lines(totals: dict) -> list[str]:
    """The whole output's totals as summary lines (`lengthwise run` and `status` print the same)."""
    if not totals:
        return []
    lines = [f"output total    {totals['rows']:,} rows in {totals['shards_done']:,} done shard(s) "
             f"({totals['error_rows']:,} with errors, {totals['truncated_rows']:,} truncated" + (
                 f", {totals['split_rows']:,} split into {totals['segments']:,} segments"
                 if totals.get("split_rows") else "") + ")"]
    if totals.get("flagged_rows") is not None:
        lines.append(f"flagged total   {totals['flagged_rows']:,} of {totals['rows']:,} rows "
                     f"({label_counts(totals['flagged_by_label'])})" + (
                         f"; {totals['truncated_unflagged_rows']:,} truncated rows not flagged"
                         if totals.get("truncated_unflagged_rows") else ""))
    if totals.get("error_reasons"):
        reasons = "; ".join(f"{rows:,} {reason}" for reason, rows in totals["error_reasons"].items())
        lines.append(f"errors total    {reasons}")
    return lines


TOP_ERROR_REASONS = 5  # reasons kept in the summary; the output's `error` column has every row's


class RowStats:
    """Token lengths before truncation and row error reasons of the rows written, for the
    diagnosis: a count per length (bounded by MAX_COUNTED_LENGTH) and per reason."""

    MAX_COUNTED_LENGTH = 1 << 20  # longer rows count as this long

    def __init__(self) -> None:
        self.length_counts = np.zeros(0, np.int64)
        self.reasons: dict[str, int] = {}

    def add(self, full_lengths: np.ndarray, errors: list) -> None:
        """`full_lengths` of the rows that ran; `errors` of all rows (None for no error)."""
        counts = np.bincount(np.minimum(full_lengths, self.MAX_COUNTED_LENGTH).astype(np.int64))
        if len(counts) > len(self.length_counts):
            self.length_counts = np.pad(self.length_counts, (0, len(counts) - len(self.length_counts)))
        self.length_counts[:len(counts)] += counts
        if errors.count(None) == len(errors):  # most blocks: one pass in C, not a test a row in Python
            return
        for error in errors:
            if error is not None:
                self.reasons[error] = self.reasons.get(error, 0) + 1

    def token_lengths(self) -> dict:
        """p50, p99 and max token length (before truncation) of the rows counted; {} for none."""
        total = int(self.length_counts.sum())
        if not total:
            return {}
        cumulative = np.cumsum(self.length_counts)
        return {"p50": int(np.searchsorted(cumulative, 0.50 * total)),
                "p99": int(np.searchsorted(cumulative, 0.99 * total)), "max": int(np.flatnonzero(self.length_counts)[-1])}

    def top_reasons(self) -> dict:
        return top_counts(self.reasons, TOP_ERROR_REASONS)


SPILL_PREFIX = "lengthwise-ids-"  # then the pid of the run that spilled


def remove_orphaned_spills(folder: str) -> list[str]:
    """Remove the id spill folders of runs that are gone: a SIGKILL skips their cleanup. Those of live
    processes stay (another run on this host); what was removed."""
    removed = []
    for path in Path(folder).glob(f"{SPILL_PREFIX}*"):
        pid = path.name[len(SPILL_PREFIX):].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class IdTracker:
    """Finds ids written more than once, in memory bounded whatever the rows: 8 bytes of hash a row,
    held up to BUFFERED_HASHES, beyond that spilled to a temporary folder split by the hash's top
    byte, and counted at the end one part at a time (a run of 10M rows would otherwise hold 80 MB of
    hashes, and sort a copy of them)."""

    BUFFERED_HASHES = 1 << 20  # 8 MiB of hashes in memory, then a spill (counting them takes ~5x that): a spill
    # opens 256 files, which at 1 MiB cost the writer thread 0.16-0.23 µs a row (512,000 rows on a 2-core VM)
    PARTS = 256  # spilled hashes are split by their top byte: a part holds 1/256 of them

    def __init__(self) -> None:
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._spill: tempfile.TemporaryDirectory | None = None

    def add(self, ids: list) -> None:
        values = [v for v in ids if v is not None]
        self.add_hashes(np.fromiter((id_hash(v) for v in values), dtype=np.int64, count=len(values)))

    def add_hashes(self, hashes: np.ndarray) -> None:
        """Hashes of rows written (also another tracker's: a Ray actor's shard, so duplicates count across shards)."""
        self._buffer.append(np.asarray(hashes, np.int64))
        self._buffered += len(hashes)
        if self._buffered >= self.BUFFERED_HASHES:
            self._spill_buffer()

    def _spill_buffer(self) -> None:
        """Append the buffered hashes to the part files of their top byte (ordered by that byte alone, a
        radix sort: `duplicates` sorts each part); empty the buffer."""
        if self._spill is None:
            remove_orphaned_spills(tempfile.gettempdir())
            self._spill = tempfile.TemporaryDirectory(prefix=f"{SPILL_PREFIX}{os.getpid()}-")
        if not self._buffer:
            return
        hashes = np.concatenate(self._buffer)
        self._buffer, self._buffered = [], 0
        top = ((hashes >> 56) + self.PARTS // 2).astype(np.uint8)
        hashes = hashes[np.argsort(top, kind="stable")]
        bounds = np.concatenate([[0], np.cumsum(np.bincount(top, minlength=self.PARTS))])
        for part, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end > start:
                with open(os.path.join(self._spill.name, f"{part}.i64"), "ab") as f:
                    hashes[start:end].tofile(f)

    def _parts(self):
        """Every hash added, one top-byte part at a time (all of them at once when nothing was spilled)."""
        if self._spill is None:
            yield np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int64)
            return
        self._spill_buffer()
        for part in range(self.PARTS):
            path = os.path.join(self._spill.name, f"{part}.i64")
            if os.path.exists(path):
                yield np.fromfile(path, np.int64)

    def hashes(self) -> np.ndarray:
        """Every hash added (a Ray actor's shard's, sent to the driver); the spilled ones are removed."""
        try:
            return np.concatenate(list(self._parts()))
        finally:
            self.close()

    def close(self) -> None:
        """Remove the spilled hashes."""
        if self._spill is not None:
            self._spill.cleanup()
            self._spill = None

    def duplicates(self, fs, paths: Iterable[str], examples: int = 5) -> tuple[int, list]:
        """How many rows repeat an earlier id, and a few such ids (read back from `paths`)."""
        count, repeated = 0, set()
        try:
            for hashes in self._parts():  # a hash's copies are all in one part
                unique, counts = np.unique(hashes, return_counts=True)
                count += int((counts[counts > 1] - 1).sum())
                repeated.update(unique[counts > 1].tolist())
        finally:
            self.close()
        found: list = []
        for path in paths if repeated else ():
            for value in pq.read_table(path, columns=["id"], filesystem=fs)["id"].to_pylist():
                if len(found) < examples and value is not None and id_hash(value) in repeated and value not in found:
                    found.append(value)
        return count, found
