"""Levels of a load test, minus the device: the sample, the CSV, the recommendation, the
regression check and the plot. Pure Python and numpy (no torch); `tuning/sweep.py` runs the
offline sweep's levels on the device and hands back `LevelResult`s. The online load test
(`tuning/loadtest.py`) reuses the CSV, recommendation, comparison and plot with
its own level results, named by `Measures`.

Throughput rises with batch size and then flattens, latency keeps rising, memory grows until
it runs out. The one rule of the recommendation, for the sweep and the load test alike: the
highest throughput among the levels that meet the latency and memory limits, where levels
within the measurement's noise of it count as ties and the smallest of those wins (the knee):
the same work for less memory and latency. The noise band is KNEE_TOLERANCE, or for counted
arrivals (the load test's requests) 2/√n when that is wider: 83 requests cannot tell 3% apart.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import numpy as np

from pipeline.core.batch_setting import recommendation_path
from pipeline.core.errors import UsageError
from pipeline.core.units import format_bytes

KNEE_TOLERANCE = 0.03  # levels within 3% of the best throughput count as equally fast


@dataclass
class LevelResult:
    """One CSV row: what one level of the varied setting measured (warm-up rows excluded)."""

    CSV_KIND: ClassVar[str] = "sweep"

    level: int
    status: str  # ok | oom (ran out of memory: batches split or rows failed; the sweep stops upward)
    rows: int
    total_s: float
    rows_per_s: float
    tokens_per_s: float
    padding_efficiency: float
    batch_latency_ms_avg: float  # one forward pass, host to outputs back on the host
    batch_latency_ms_p50: float
    batch_latency_ms_p95: float
    batch_latency_ms_p99: float
    batch_latency_ms_max: float
    row_latency_ms_p50: float  # from the packer putting the row in a batch to its result
    row_latency_ms_p95: float
    row_latency_ms_p99: float
    row_latency_ms_max: float
    peak_device_bytes: int  # memory the batches added above the loaded model
    peak_rss_bytes: int  # the process's peak resident set during the level
    batches: int
    oom_splits: int

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def problem(self) -> str:
        """Why a level whose status is not ok cannot be recommended."""
        return f"ran out of memory ({self.oom_splits} batch splits)"


@dataclass(frozen=True)
class Measures:
    """The fields of a level result that the recommendation, the comparison and the plot
    read, and the words for them: rows for the offline sweep, requests for the online test."""

    throughput: str
    p99_ms: str
    peak_bytes: str
    throughput_unit: str
    latency: str
    count: str | None = None  # the field of Poisson-counted arrivals behind the throughput (their noise: 1/√n)
    target: str | None = None  # the field of the offered rate, drawn on the plot (the load test's)


ROW_MEASURES = Measures("rows_per_s", "row_latency_ms_p99", "peak_device_bytes", "rows/s", "p99 row latency")


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """avg, p50, p95, p99 and max of durations in seconds, as milliseconds."""
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    if values.size == 0:
        return {"avg": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    return {"avg": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p95": float(np.percentile(values, 95)), "p99": float(np.percentile(values, 99)),
            "max": float(values.max())}


def length_distribution(lengths: Sequence[int]) -> dict[str, float]:
    """Token lengths of the sample: what the sweep's result depends on most."""
    values = np.asarray(lengths)
    return {"rows": int(values.size), "median": float(np.median(values)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "max": int(values.max())}


def sample_positions(total_rows: int, sample_rows: int, seed: int) -> np.ndarray:
    """`sample_rows` distinct row positions out of `total_rows`, uniformly at random and in
    random order (the first ones become the warm-up rows); all rows, shuffled, if there are
    fewer. Reproducible for a seed."""
    rng = np.random.default_rng(seed)
    return rng.choice(total_rows, size=min(sample_rows, total_rows), replace=False)


@dataclass
class Recommendation:
    vary: str
    level: int | None  # None: no level met the limits
    reason: str
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    excluded: dict = field(default_factory=dict)  # level → why it was not eligible

    def to_dict(self) -> dict:
        return asdict(self)


def recommend(levels: Sequence, vary: str, budget_bytes: int, memory_headroom: float,
              max_p99_ms: float | None = None, knee_tolerance: float = KNEE_TOLERANCE,
              measures: Measures = ROW_MEASURES) -> Recommendation:
    """The level to use, and why in words. Eligible: status ok, p99 within `max_p99_ms` (if
    given), peak memory leaving `memory_headroom` of `budget_bytes` free. Among the eligible,
    the smallest level within `knee_tolerance` of the best throughput."""
    memory_limit = (1.0 - memory_headroom) * budget_bytes
    unit = measures.throughput_unit

    def throughput(result) -> float:
        return getattr(result, measures.throughput)

    def p99_ms(result) -> float:
        return getattr(result, measures.p99_ms)

    def peak(result) -> int:
        return getattr(result, measures.peak_bytes)

    excluded: dict[int, str] = {}
    eligible = []
    for result in levels:
        if result.status != "ok":
            excluded[result.level] = result.problem()
        elif max_p99_ms is not None and p99_ms(result) > max_p99_ms:
            excluded[result.level] = f"{measures.latency} {p99_ms(result):,.0f} ms > {max_p99_ms:,.0f} ms"
        elif peak(result) > memory_limit:
            excluded[result.level] = (f"peak memory {format_bytes(peak(result))} leaves less than "
                                      f"{memory_headroom:.0%} of the {format_bytes(budget_bytes)} budget free")
        else:
            eligible.append(result)
    if not eligible:
        why = "; ".join(f"{level}: {reason}" for level, reason in excluded.items()) or "no level ran"
        return Recommendation(vary, None, f"no level met the limits ({why})", excluded=excluded)
    best = max(eligible, key=throughput)
    tolerance = noise_tolerance(getattr(best, measures.count) if measures.count else None, knee_tolerance)
    near_best = [r for r in eligible if throughput(r) >= (1.0 - tolerance) * throughput(best)]
    chosen = min(near_best, key=lambda r: r.level)
    if chosen is best:
        how = f"the highest throughput ({throughput(best):,.1f} {unit})"
    else:
        how = (f"{throughput(chosen):,.1f} {unit}, within {tolerance:.0%} (the measurement's noise) of the best "
               f"({throughput(best):,.1f} {unit} at {best.level}); the smallest such level (the knee): the same work "
               "for less memory and latency")
    limits = f"{measures.latency} {p99_ms(chosen):,.0f} ms"
    if max_p99_ms is not None:
        limits += f" ≤ {max_p99_ms:,.0f} ms"
    limits += (f"; peak memory {format_bytes(peak(chosen))} leaves "
               f"{1 - peak(chosen) / budget_bytes:.0%} of the {format_bytes(budget_bytes)} budget free")
    reason = f"{vary} {chosen.level}: {how}; {limits}"
    tried = [result.level for result in levels if result.status == "ok"]
    if best.level == max(tried) and len(tried) > 1:
        reason += (f". The best throughput was at the largest level tried ({best.level}): try larger --values, "
                   "throughput may still rise")
    if excluded:
        reason += ". Not eligible: " + "; ".join(f"{level} ({why})" for level, why in excluded.items())
    return Recommendation(vary, chosen.level, reason, throughput(chosen), getattr(chosen, "tokens_per_s", 0.0),
                          excluded)


def noise_tolerance(arrivals: int | None, floor: float = KNEE_TOLERANCE) -> float:
    """The share of throughput within which two levels count as equal: `floor`, or 2/√n for n
    Poisson-counted arrivals when that is wider."""
    return max(floor, 2.0 / math.sqrt(arrivals)) if arrivals else floor


def write_sweep_csv(path: str, levels: Sequence, result_type: type = LevelResult) -> None:
    from pipeline.core.cache import write_text_atomically

    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=result_type.columns())
    writer.writeheader()
    for result in levels:
        writer.writerow(asdict(result))
    write_text_atomically(Path(path), text.getvalue())


def read_sweep_csv(path: str, result_type: type = LevelResult) -> list:
    """A CSV of `result_type` rows written by this or an earlier run; a usage error (the user gave
    the wrong file to --compare) if it is not one."""
    kind = result_type.CSV_KIND
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as error:
        raise UsageError(f"cannot read {kind} CSV {path}: {error.strerror}") from error
    columns = result_type.columns()
    missing = set(columns) - set(rows[0] if rows else {})
    if not rows or missing:
        raise UsageError(f"{path} is not a lengthwise {kind} CSV (missing columns: {', '.join(sorted(missing))})")
    types = {f.name: f.type for f in fields(result_type)}
    try:
        return [result_type(**{name: (row[name] if types[name] == "str" else
                                      int(float(row[name])) if types[name] == "int" else float(row[name]))
                               for name in columns}) for row in rows]
    except ValueError as error:
        raise UsageError(f"{path} has a value that is not a number: {error}") from error


SWEEP_COLUMNS = (("rows/s", "{0.rows_per_s:,.1f}"), ("tokens/s", "{0.tokens_per_s:,.0f}"),
                 ("padding eff.", "{0.padding_efficiency:.3f}"), ("batch p50 ms", "{0.batch_latency_ms_p50:,.0f}"),
                 ("batch p99 ms", "{0.batch_latency_ms_p99:,.0f}"), ("row p50 ms", "{0.row_latency_ms_p50:,.0f}"),
                 ("row p99 ms", "{0.row_latency_ms_p99:,.0f}"), ("peak memory", "peak_device_bytes"),
                 ("batches", "{0.batches:,}"), ("OOM splits", "{0.oom_splits}"))


def markdown_table(levels: Sequence, recommended: int | None = None, columns: Sequence[tuple[str, str]] = SWEEP_COLUMNS,
                   first: str = "level") -> str:
    """The levels of a sweep or a load test as a Markdown table, the recommended one marked: the level
    (headed `first`) and its status, then `columns`, each (header, a format of the level result, or the
    name of a field of bytes, printed as `format_bytes` prints a size)."""
    def cell(result, spec: str) -> str:
        return spec.format(result) if "{" in spec else format_bytes(getattr(result, spec))

    lines = ["| " + " | ".join([first, "status", *(header for header, _ in columns)]) + " |",
             "|---:|:---|" + "---:|" * len(columns)]
    for result in levels:
        mark = " ←" if result.level == recommended else ""
        lines.append(f"| {result.level}{mark} | {result.status} | "
                     + " | ".join(cell(result, spec) for _, spec in columns) + " |")
    return "\n".join(lines)


@dataclass
class LevelChange:
    level: int
    throughput_before: float
    throughput_now: float
    p99_ms_before: float
    p99_ms_now: float
    flags: list[str]

    @property
    def throughput_change(self) -> float:
        return self.throughput_now / self.throughput_before - 1.0 if self.throughput_before else math.nan

    @property
    def p99_change(self) -> float:
        return self.p99_ms_now / self.p99_ms_before - 1.0 if self.p99_ms_before else math.nan


def compare_sweeps(before: Sequence, now: Sequence, max_throughput_drop: float, max_p99_rise: float,
                   measures: Measures = ROW_MEASURES) -> list[LevelChange]:
    """Per level present in both: throughput and p99 latency change. A level is flagged
    when throughput fell by more than `max_throughput_drop`, p99 rose by more than
    `max_p99_rise`, or its status is not ok now but was before (out of memory, overloaded)."""
    earlier = {r.level: r for r in before}
    changes = []
    for result in now:
        old = earlier.get(result.level)
        if old is None:
            continue
        change = LevelChange(result.level, getattr(old, measures.throughput), getattr(result, measures.throughput),
                             getattr(old, measures.p99_ms), getattr(result, measures.p99_ms), [])
        if result.status != "ok" and old.status == "ok":
            change.flags.append("runs out of memory now" if result.status == "oom" else
                                f"{result.status} now: {result.problem()}")
        elif result.status == "ok" and old.status == "ok":
            if change.throughput_change < -max_throughput_drop:
                change.flags.append(f"throughput {change.throughput_change:+.1%}")
            if change.p99_change > max_p99_rise:
                change.flags.append(f"p99 {change.p99_change:+.1%}")
        changes.append(change)
    return changes


def comparison_table(changes: Sequence[LevelChange], measures: Measures = ROW_MEASURES) -> str:
    unit, latency = measures.throughput_unit, measures.latency.removeprefix("p99 ")
    lines = [f"| level | {unit} before | {unit} now | change | {latency} p99 ms before | {latency} p99 ms now | "
             "change | flag |",
             "|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for c in changes:
        lines.append(f"| {c.level} | {c.throughput_before:,.1f} | {c.throughput_now:,.1f} | "
                     f"{c.throughput_change:+.1%} | {c.p99_ms_before:,.0f} | {c.p99_ms_now:,.0f} | "
                     f"{c.p99_change:+.1%} | {'REGRESSION: ' + ', '.join(c.flags) if c.flags else ''} |")
    return "\n".join(lines)


def save_recommendation(plan_cache: str | None, name: str, key: dict, recommendation: Recommendation,
                        csv_path: str, created: str) -> str:
    """Write atomically beside the memory plans; a later run with the same key reads it (its
    level for `auto`, its throughput for the diagnosis)."""
    from pipeline.core.cache import write_keyed

    return write_keyed(recommendation_path(plan_cache, name), key,
                       {"level": recommendation.level, "reason": recommendation.reason,
                        "rows_per_s": recommendation.rows_per_s, "tokens_per_s": recommendation.tokens_per_s,
                        "csv": os.path.abspath(csv_path), "created": created})


def check_plot_available() -> None:
    """Fail before the sweep runs, not after, when --plot cannot be drawn: a usage error, since
    installing the optional package (or dropping --plot) is the user's fix."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'lengthwise[plot]' "
                          "(or .venv/bin/pip install matplotlib)")


def plot_sweep(path: str, levels: Sequence, vary: str, recommended: int | None, title: str,
               measures: Measures = ROW_MEASURES) -> None:
    """Throughput (left axis) and p99 latency (right axis) against the varied value, peak
    memory in a second panel, every axis from zero; the recommended level, levels whose status
    is not ok (out of memory, overloaded) and the load test's target rate as lines named in one
    legend (no free-floating labels to collide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in levels if r.status != "oom"]  # out of memory measured nothing; overloaded did
    x = [r.level for r in ran]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    throughputs = [getattr(r, measures.throughput) for r in ran]
    top.plot(x, throughputs, "o-", color="tab:blue", label=f"throughput ({measures.throughput_unit})")
    targets = sorted({getattr(r, measures.target) for r in levels}) if measures.target else []
    for target in targets:
        top.axhline(target, color="tab:blue", linestyle="--", linewidth=1, alpha=0.6,
                    label=f"target rate ({target:g} {measures.throughput_unit})")
    top.set_ylabel(measures.throughput_unit, color="tab:blue")
    top.set_ylim(0, max([*throughputs, *targets], default=1) * 1.15 or 1)
    latency = top.twinx()
    latency.plot(x, [getattr(r, measures.p99_ms) for r in ran], "s--", color="tab:red",
                 label=f"{measures.latency} (ms)")
    latency.set_ylabel(f"{measures.latency} (ms)", color="tab:red")
    latency.set_ylim(0, max([getattr(r, measures.p99_ms) for r in ran], default=1) * 1.15 or 1)
    bottom.plot(x, [getattr(r, measures.peak_bytes) / 2**20 for r in ran], "^-", color="tab:green",
                label="peak memory (MiB)")
    bottom.set_ylabel("peak memory (MiB)")
    bottom.set_ylim(0, max([getattr(r, measures.peak_bytes) / 2**20 for r in ran], default=1) * 1.15 or 1)
    bottom.set_xlabel(vary)
    for status in sorted({r.status for r in levels} - {"ok"}):
        for number, failed in enumerate(r for r in levels if r.status == status):
            for axis in (top, bottom):
                axis.axvline(failed.level, color="black", linestyle=":", linewidth=1,
                             label=("out of memory" if status == "oom" else status) if not number and axis is top
                             else None)
    if recommended is not None:
        for axis in (top, bottom):
            axis.axvline(recommended, color="tab:orange", linewidth=2, alpha=0.6,
                         label=f"recommended: {recommended}" if axis is top else None)
    every = sorted(r.level for r in levels)  # levels that did not run ok are marked too
    if len(every) > 1 and min(every) > 0 and max(every) / min(every) >= 8:
        bottom.set_xscale("log", base=2)
    bottom.set_xticks(every, [str(v) for v in every])
    handles = [h for axis in (top, latency, bottom) for h in axis.get_legend_handles_labels()[0]]
    figure.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    figure.tight_layout(rect=(0, 0.1, 1, 1))  # the legend's rows below the panels
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
