"""`lengthwise sweep` and `lengthwise loadtest`."""

from __future__ import annotations

import sys

import click

from pipeline.cli.options import CONFIG_OPTION, LOG_OPTIONS, declared_options, exit_on_known_errors, fail, with_options
from pipeline.core import exit_codes
from pipeline.offline.options import model_or_default, parse_storage_options
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig
from pipeline.tuning.options import LOADTEST_OPTIONS, SWEEP_OPTIONS


@click.command()
@CONFIG_OPTION
@declared_options(SWEEP_OPTIONS)
@with_options(LOG_OPTIONS)
def sweep(inputs, vary, values, model, storage_option, no_save, compare_with, max_throughput_drop, max_p99_rise,
          fail_on_regression, out, plot, max_batch_tokens, max_batch_rows, **settings) -> None:
    """Load-test one batch setting over several values on real rows; write a CSV, recommend one.

    Only --vary changes between levels. Each level: warm-up rows, measured rows, drain. The
    recommendation (highest throughput within the limits; levels within 3% of it tie and the
    smallest wins; a best level at the largest value tried says to try larger) is saved so that
    `lengthwise run --max-batch-tokens auto` (or `--max-batch-rows auto`)
    on the same model, device and dtype uses it.
    """
    from pipeline.tuning.report import Comparison, run_sweep_report

    if (vary == "max-batch-tokens" and max_batch_tokens is not None) or \
            (vary == "max-batch-rows" and max_batch_rows is not None):
        fail(f"--{vary} is the varied setting; give its levels with --values, not as a fixed value")
    with exit_on_known_errors():
        config = SweepConfig.of(input=tuple(inputs), vary=vary, values=values, out=out,
                                model=model_or_default(model), max_batch_tokens=max_batch_tokens,
                                max_batch_rows=max_batch_rows,
                                storage_options=parse_storage_options(storage_option), save_recommendation=not no_save,
                                **settings)
        outcome = run_sweep_report(config, Comparison(compare_with, max_throughput_drop, max_p99_rise), plot)
    print_outcome(outcome, fail_on_regression)


@click.command()
@CONFIG_OPTION
@declared_options(LOADTEST_OPTIONS)
@with_options(LOG_OPTIONS)
def loadtest(inputs, vary, values, qps, concurrency, duration_s, warmup_s, model, storage_option, no_plan_cache,
             sample_rows, seed, max_p99_ms, memory_headroom, compare_with, max_throughput_drop, max_p99_rise,
             fail_on_regression, out, plot, id_column, text_column, **batcher_settings) -> None:
    """Load-test the online batcher: real texts at a Poisson rate, one setting over several values.

    Only --vary changes between levels. Each level: warm-up arrivals, --duration of measured
    arrivals, then the drain. Latency runs from a request's scheduled arrival to its answer.
    The recommendation is the highest requests/s within the limits, where levels within the
    measurement's noise of it (3%, or 2/sqrt(requests) when wider) tie and the smallest wins;
    a line of diagnosis follows a level that shows a known pattern.
    """
    from pipeline.tuning.report import Comparison, run_loadtest_report

    if vary == "max-batch-tokens" and batcher_settings["max_batch_tokens"] is not None:
        fail("--max-batch-tokens is the varied setting; give its levels with --values, not as a fixed value")
    if duration_s <= 0:
        fail("--duration must be more than 0")
    with exit_on_known_errors():
        batcher = BatcherConfig.of(model=model_or_default(model), use_plan_cache=not no_plan_cache, **batcher_settings)
        config = OnlineLoadtestConfig.of(input=tuple(inputs), vary=vary, values=values, out=out, batcher=batcher,
                                         qps=qps, concurrency=concurrency, duration_s=duration_s, warmup_s=warmup_s,
                                         sample_rows=sample_rows, seed=seed, max_p99_ms=max_p99_ms,
                                         memory_headroom=memory_headroom, id_column=id_column, text_column=text_column,
                                         storage_options=parse_storage_options(storage_option))
        outcome = run_loadtest_report(config, Comparison(compare_with, max_throughput_drop, max_p99_rise), plot)
    print_outcome(outcome, fail_on_regression)


def print_outcome(outcome, fail_on_regression: bool) -> None:
    """A sweep's or load test's text; the levels --compare flagged on stderr, and exit 3 for them
    with --fail-on-regression."""
    click.echo(outcome.text)
    if outcome.regressed_levels:
        click.echo(f"regression at level(s) {', '.join(map(str, outcome.regressed_levels))}", err=True)
        if fail_on_regression:
            sys.exit(exit_codes.REGRESSION)
