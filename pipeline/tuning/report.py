"""`lengthwise sweep` and `lengthwise loadtest` as one call each: run the levels, write the CSV
and its settings JSON, draw the plot and compare with an earlier CSV, and hand back the text
the command prints. The CLI parses, calls and prints; it never touches the files itself.

Files the user named are checked before the levels run (an earlier CSV that is not one, a
plot without matplotlib, a path to write that lies in what the test reads): a usage error then
costs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.findings import diagnosis_lines
from pipeline.core.settings import ModelSettings
from pipeline.offline.locations import check_written_paths
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig
from pipeline.tuning import levels as analysis


@dataclass(frozen=True)
class Comparison:
    """`--compare` and its limits: the earlier CSV, and how far a level may move before it is flagged."""

    path: str | None  # None: no comparison
    max_throughput_drop: float
    max_p99_rise: float


@dataclass
class LevelTestOutcome:
    """What a sweep or load test leaves for the command to print."""

    text: str  # stdout, as the command prints it
    regressed_levels: list[int]  # the levels --compare flagged (the --fail-on-regression gate's question)


def run_sweep_report(config: SweepConfig, comparison: Comparison, plot: str | None) -> LevelTestOutcome:
    """The offline sweep: levels on the device, the CSV, the saved recommendation, the comparison."""
    from pipeline.tuning.sweep import run_sweep

    check_level_test_paths(config.out, plot, config.cache.plan_cache, config.source.input, config.model, comparison,
                           config.source.storage_options)
    previous = analysis.read_sweep_csv(comparison.path) if comparison.path else None
    if plot:
        analysis.check_plot_available()
    report = run_sweep(config)
    write_level_files(config.out, report.levels, report.settings)
    lines = [analysis.markdown_table(report.levels, report.recommendation.level), "",
             f"recommendation: {report.recommendation.reason}", *diagnosis_lines(report.settings["diagnosis"])]
    if report.saved_to:
        lines.append(f"saved for `lengthwise run --{config.vary} auto` on this model, device and dtype: "
                     f"{report.saved_to}")
    if report.not_saved:
        lines.append(report.not_saved)
    fixed = report.settings
    title = (f"{config.model.job} · {fixed['device']} · {fixed['dtype']} · {fixed['rows']} rows, "
             f"max length {fixed['max_length']}")
    return finish_level_test(lines, report.levels, config.vary, report.recommendation.level, config.out, plot,
                             title, analysis.ROW_MEASURES, previous, comparison)


def run_loadtest_report(config: OnlineLoadtestConfig, comparison: Comparison, plot: str | None) -> LevelTestOutcome:
    """The online batcher's load test: levels of Poisson arrivals, the CSV, the comparison."""
    from pipeline.tuning import loadtest as online

    check_level_test_paths(config.out, plot, config.batcher.cache.plan_cache, config.source.input,
                           config.batcher.model, comparison, config.source.storage_options)
    previous = analysis.read_sweep_csv(comparison.path, online.OnlineLevelResult) if comparison.path else None
    if plot:
        analysis.check_plot_available()
    report = online.run_online_loadtest(config)
    write_level_files(config.out, report.levels, report.settings, online.OnlineLevelResult)
    fixed = report.settings
    shown = ("max_batch_size", "batch_timeout_ms", "max_batch_tokens", "request_timeout_ms", "max_queue")
    lines = [f"{fixed['job']} · {fixed['device']} · {fixed['dtype']} · max length {fixed['max_length']} · "
             f"{fixed['qps']:g} requests/s Poisson for {fixed['duration_s']:g} s (+{fixed['warmup_s']:g} s warm-up) · "
             f"concurrency {fixed['concurrency']} · " +
             " · ".join(f"{name} {fixed[name]}" for name in shown if fixed[name] is not None),
             analysis.markdown_table(report.levels, report.recommendation.level, online.LOADTEST_COLUMNS, config.vary),
             *diagnosis_lines(report.diagnosis), "", f"recommendation: {report.recommendation.reason}"]
    title = (f"online · {fixed['job']} · {fixed['device']} · {fixed['qps']:g} req/s Poisson · "
             f"{fixed['duration_s']:g} s per level")
    return finish_level_test(lines, report.levels, config.vary, report.recommendation.level, config.out, plot,
                             title, online.ONLINE_MEASURES, previous, comparison)


def check_level_test_paths(out: str, plot: str | None, plan_cache: str | None, inputs: Sequence[str],
                           model: ModelSettings, comparison: Comparison, storage_options: dict) -> None:
    """Refuse (a usage error, before any level runs) a path the test writes (the CSV, OUT.json beside it,
    the plot, the plan cache) that lies in what it reads: the input, the model, the --compare CSV."""
    written = [("--out", out), ("--out", f"{out}.json"), ("--plot", plot), ("--plan-cache", plan_cache)]
    read = {"--input": list(inputs), "--model": [model.model], "--compare": [comparison.path]}
    check_written_paths(written, read, None, storage_options)


def write_level_files(out: str, levels: Sequence, settings: dict, result_type: type = analysis.LevelResult) -> None:
    """The CSV, one row per level, and beside it OUT.json: the fixed settings, the diagnosis, the recommendation."""
    analysis.write_sweep_csv(out, levels, result_type)
    Path(f"{out}.json").write_text(json.dumps(settings, indent=2) + "\n")


def finish_level_test(lines: list[str], levels: Sequence, vary: str, recommended: int | None, out: str,
                      plot: str | None, title: str, measures: analysis.Measures, previous: Sequence | None,
                      comparison: Comparison) -> LevelTestOutcome:
    """What `sweep` and `loadtest` print last: where the CSV went, the plot, and the comparison
    with an earlier CSV, level by level."""
    lines = [*lines, f"csv: {out}  settings: {out}.json"]
    if plot:
        analysis.plot_sweep(plot, levels, vary, recommended, title, measures)
        lines.append(f"plot: {plot}")
    if previous is None:
        return LevelTestOutcome("\n".join(lines), [])
    changes = analysis.compare_sweeps(previous, levels, comparison.max_throughput_drop, comparison.max_p99_rise,
                                      measures)
    lines += ["", f"compared with {comparison.path}:", analysis.comparison_table(changes, measures)]
    flagged = [change.level for change in changes if change.flags]
    if not flagged:
        lines.append("no regression")
    return LevelTestOutcome("\n".join(lines), flagged)
