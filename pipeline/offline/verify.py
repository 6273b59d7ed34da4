"""`lengthwise verify`: the audit a scheduler runs after the job. Every input shard has its
committed output; every input id is there exactly once and in input order; every shard was
committed under the settings recorded in run.json; no partial (temporary) file is left; row
errors counted by reason.

Reads the input's id column and the output's id and error columns (never the embeddings or
scores), in record batches: memory follows the batch size while a shard agrees, and one
shard's ids when it does not (to name what is missing, extra or duplicated).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError
from pipeline.core.redact import usable_recorded_options
from pipeline.offline.manifest import (MANIFEST_DIR, RunManifest, fingerprint_digest, list_recorded_shards,
                                       manifest_root)
from pipeline.offline.sink import TEMPORARY_NAME, output_paths
from pipeline.offline.readers import Columns
from pipeline.offline.source import output_stem, record_batches, relative_name

LISTED_IDS = 10  # ids named per shard and kind; the counts are always complete
BATCH_ROWS = 65536


@dataclass
class IdComparison:
    """How one shard's output ids differ from its input ids (as multisets)."""

    missing: int = 0  # input rows with no output row
    missing_ids: list = field(default_factory=list)
    extra: int = 0  # output rows whose id the input shard does not have
    extra_ids: list = field(default_factory=list)
    duplicated: int = 0  # output rows beyond an id's count in the input
    duplicated_ids: list = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not (self.missing or self.extra or self.duplicated)


def compare_id_counts(input_counts: Counter, output_counts: Counter, listed: int = LISTED_IDS) -> IdComparison:
    """Missing, extra and duplicated rows between two id multisets, with the first `listed` ids
    of each kind (in input order for missing and duplicated, output order for extra)."""
    found = IdComparison()
    for value, wanted in input_counts.items():
        got = output_counts.get(value, 0)
        if got < wanted:
            found.missing += wanted - got
            if len(found.missing_ids) < listed:
                found.missing_ids.append(value)
        elif got > wanted:
            found.duplicated += got - wanted
            if len(found.duplicated_ids) < listed:
                found.duplicated_ids.append(value)
    for value, got in output_counts.items():
        if value not in input_counts:
            found.extra += got
            if len(found.extra_ids) < listed:
                found.extra_ids.append(value)
    return found


def first_difference(left: Iterable[pa.Array], right: Iterable[pa.Array]) -> int | None:
    """The first row position where two streams of id chunks differ (a null equals a null, a
    NaN a NaN), or where one ends before the other; None when they are the same sequence."""
    left = (chunk for chunk in left if len(chunk))
    right = (chunk for chunk in right if len(chunk))
    a = b = None
    position = 0
    while True:
        if a is None or len(a) == 0:
            a = next(left, None)
        if b is None or len(b) == 0:
            b = next(right, None)
        if a is None or b is None:
            return None if a is None and b is None else position
        take = min(len(a), len(b))
        head_a, head_b = a.slice(0, take), b.slice(0, take)
        if head_b.type != head_a.type:
            head_b = head_b.cast(head_a.type)
        if not head_a.equals(head_b):
            same = pc.or_(pc.fill_null(pc.equal(head_a, head_b), False), pc.and_(head_a.is_null(), head_b.is_null()))
            if pa.types.is_floating(head_a.type):
                same = pc.or_(same, pc.fill_null(pc.and_(pc.is_nan(head_a), pc.is_nan(head_b)), False))
            differs = pc.index(same, False).as_py()
            if differs >= 0:
                return position + differs
        a, b, position = a.slice(take), b.slice(take), position + take


@dataclass
class ShardCheck:
    """One input shard's output, and what is wrong with it (nothing when `problems` is empty)."""

    shard: str
    input: str
    output: str
    input_rows: int
    output_rows: int | None = None  # None: no output file
    output_columns: list | None = None  # the output file's column names; None: not read
    ids: IdComparison = field(default_factory=IdComparison)
    out_of_order_at: int | None = None  # same ids, but the order differs from this row on
    problems: list = field(default_factory=list)


@dataclass
class VerifyReport:
    input: list
    output: str
    shards: list = field(default_factory=list)  # [ShardCheck]
    partial_files: list = field(default_factory=list)  # temporary outputs left behind
    unexpected_outputs: list = field(default_factory=list)  # output files no input shard makes
    rows: int = 0  # output rows read
    error_rows: int = 0
    error_reasons: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # several models: name → its columns and the shards that hold them all
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not (self.partial_files or self.unexpected_outputs or any(s.problems for s in self.shards))

    def to_dict(self) -> dict:
        return {"complete": self.complete, **asdict(self)}

    def to_text(self) -> str:
        bad = [s for s in self.shards if s.problems]
        lines = [f"{self.output}: {'complete' if self.complete else 'NOT complete'}: "
                 f"{len(self.shards) - len(bad)} of {len(self.shards)} shards agree with the input; "
                 f"{self.rows:,} rows, {self.error_rows:,} with errors (checked in {self.seconds:.2f}s)"]
        lines += [f"errors    {rows:,} × {reason}" for reason, rows in self.error_reasons.items()]
        lines += [f"model     {name}: {len(entry['columns'])} column(s) ({', '.join(entry['columns'])}) in "
                  f"{entry['shards']} of {len(self.shards)} shards" for name, entry in self.models.items()]
        for check in bad:
            lines += [f"shard     {check.shard}: {problem}" for problem in check.problems]
        lines += [f"partial   {path}: a temporary file of an unfinished attempt; rerun the job (it removes it)"
                  for path in self.partial_files]
        lines += [f"extra     {path}: no input shard makes this output file" for path in self.unexpected_outputs]
        return "\n".join(lines)


def verify_output(inputs: list[str] | None, output: str, storage_options: dict | None = None) -> VerifyReport:
    """Check `output` against `inputs` (default: the input recorded in its run.json)."""
    started = time.perf_counter()
    storage_options = storage_options or {}
    try:
        fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    except (ImportError, ValueError, OSError) as error:
        raise UsageError(f"cannot open output {output!r}: {error}; check --output") from error
    output_dir = output_dir.rstrip("/")
    fs.invalidate_cache()  # an audit reads the store as it is now, not a listing cached earlier in this process
    manifest = RunManifest(fs, output_dir)
    recorded = manifest.read_run()
    if recorded is None:
        raise UsageError(f"{output} has no lengthwise run (no {MANIFEST_DIR}/run.json); check --output")
    config = recorded["config"]
    recorded_options = usable_recorded_options(config.get("storage_options", {}))
    shards = list_recorded_shards(list(inputs or config["input"]), config, {**recorded_options, **storage_options})
    markers = manifest.shard_markers()
    digest = fingerprint_digest(recorded["fingerprint"])
    report = VerifyReport(input=list(inputs or config["input"]), output=output)
    errors: Counter = Counter()
    for shard in shards:
        final_path = output_paths(output_dir, shard.stem)[0]
        check = ShardCheck(shard.stem, shard.url, fs.unstrip_protocol(final_path), shard.num_rows)
        report.shards.append(check)
        if shard.problem:
            check.problems.append(f"the input shard cannot be read: {shard.problem}")
            continue
        if not fs.exists(final_path):
            check.problems.append(f"no output file ({check.output}); rerun the job to make it")
            continue
        check_marker(check, markers.get(shard.stem), digest)
        check_ids(check, fs, final_path, config["id_column"], {**recorded_options, **storage_options}, errors)
        report.rows += check.output_rows or 0
    if "models" in recorded["fingerprint"]:
        columns = {check.shard: check.output_columns for check in report.shards if check.output_columns is not None}
        report.models = check_model_columns(report.shards, columns, list(recorded["fingerprint"]["models"]))
    report.partial_files, report.unexpected_outputs = stray_files(fs, output_dir, {s.stem for s in shards})
    report.error_rows = sum(errors.values())
    report.error_reasons = dict(errors.most_common())
    report.seconds = time.perf_counter() - started
    return report


def check_model_columns(checks: list[ShardCheck], columns: dict[str, list[str]], models: list[str]) -> dict:
    """Per model of an output of several: its columns (`NAME.…`, as any shard has them) and how many shards
    hold them all; a shard without one of them, or a model with no column at all, is a problem."""
    found = {name: sorted({column for names in columns.values() for column in names
                           if column.startswith(f"{name}.")}) for name in models}
    by_stem = {check.shard: check for check in checks}
    report = {}
    for name, wanted in found.items():
        holding = [stem for stem, names in columns.items() if wanted and set(wanted) <= set(names)]
        for stem in sorted(set(columns) - set(holding)):
            missing = [column for column in wanted if column not in columns[stem]] or [f"{name}.*"]
            by_stem[stem].problems.append(f"has no column {', '.join(missing)} of model {name}; rerun the job "
                                          "with --overwrite to redo it")
        report[name] = {"columns": wanted, "shards": len(holding)}
    return report


def check_marker(check: ShardCheck, marker: dict | None, run_digest: str) -> None:
    """The shard's marker says done, under the settings of run.json (markers older than the
    fingerprint field are not checked for it)."""
    if marker is None or marker.get("status") != "done":
        state = "no marker" if marker is None else f"marked {marker.get('status')}: {marker.get('error')}"
        check.problems.append(f"not recorded as done ({state}); rerun the job")
    elif marker.get("fingerprint") not in (None, run_digest):
        check.problems.append(f"committed under other settings (fingerprint {marker['fingerprint']}, run.json has "
                              f"{run_digest}); rerun the job with --overwrite to redo it")


def check_ids(check: ShardCheck, fs, final_path: str, id_column: str, storage_options: dict,
              errors: Counter) -> None:
    """Compare the output's ids with the input's, streamed; count the output's row errors."""
    output_url = fs.unstrip_protocol(final_path)

    def input_ids() -> Iterator[pa.Array]:
        for batch in record_batches(check.input, Columns(id_column, ()), BATCH_ROWS, storage_options):
            yield batch.column(0)

    def output_ids(count_errors: bool) -> Iterator[pa.Array]:
        rows = 0
        with fs.open(final_path, "rb") as f:
            parquet = pq.ParquetFile(f)
            check.output_columns = parquet.schema_arrow.names
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=["id", "error"]):
                rows += batch.num_rows
                if count_errors:
                    for item in pc.value_counts(batch.column("error").drop_null()).to_pylist():
                        errors[item["values"]] += item["counts"]
                yield batch.column("id")
        check.output_rows = rows

    try:
        differs_at = first_difference(input_ids(), output_ids(count_errors=True))
    except (pa.ArrowException, OSError, KeyError) as error:
        redone = isinstance(error, (pa.ArrowException, IsADirectoryError))  # not Parquet, or a folder in its place
        check.problems.append(f"cannot read {output_url} ({type(error).__name__}: {error}); rerun the job"
                              + (": it redoes the shard" if redone else " with --overwrite"))
        return
    if differs_at is None:
        return
    check.ids = compare_id_counts(_counts(input_ids()), _counts(output_ids(count_errors=False)))
    ids = check.ids
    if ids.agrees:
        check.out_of_order_at = differs_at
        check.problems.append(f"the ids are all there once but out of input order from row {differs_at}")
    for count, listed, what in ((ids.missing, ids.missing_ids, "missing"), (ids.extra, ids.extra_ids, "extra"),
                                (ids.duplicated, ids.duplicated_ids, "duplicated")):
        if count:
            more = f" and {count - len(listed)} more" if count > len(listed) else ""
            check.problems.append(f"{count} row(s) {what}: ids {', '.join(map(repr, listed))}{more}")


NAN_ID = float("nan")  # every NaN id counts as this one object: NaN != NaN, but a dict finds a key by identity first


def _counts(chunks: Iterable[pa.Array]) -> Counter:
    """How often each id occurs; all NaN ids are one id, as all nulls are (and as the run's
    duplicate-id count, which hashes repr(id), has it)."""
    counts: Counter = Counter()
    for chunk in chunks:
        values = chunk.to_pylist()
        if pa.types.is_floating(chunk.type):
            values = [NAN_ID if value != value else value for value in values]
        counts.update(values)
    return counts


def stray_files(fs, output_dir: str, stems: set[str]) -> tuple[list[str], list[str]]:
    """Temporary files left in the output, and Parquet files no input shard makes (outside the
    manifest folder)."""
    partial, unexpected = [], []
    hidden = (MANIFEST_DIR, manifest_root(fs, output_dir).rsplit("/", 1)[-1])
    for path in sorted(fs.find(output_dir)):
        relative = relative_name(path, output_dir)
        if relative.split("/", 1)[0] in hidden:
            continue
        if TEMPORARY_NAME.fullmatch(relative.rsplit("/", 1)[-1]):
            partial.append(fs.unstrip_protocol(path))
        elif relative.endswith(".parquet") and output_stem(relative) not in stems:
            unexpected.append(fs.unstrip_protocol(path))
    return partial, unexpected
