"""`lengthwise sweep` and `lengthwise loadtest`."""

from __future__ import annotations

import sys

import click

from pipeline.cli.options import (
    CACHE_OPTIONS,
    CONFIG_OPTION,
    INPUT_OPTIONS,
    LOG_OPTIONS,
    MEMORY_OPTIONS,
    MODEL_OPTIONS,
    TORCH_THREADS_OPTION,
    WORKER_OPTIONS,
    Checked,
    batcher_default,
    env_option,
    exit_on_known_errors,
    fail,
    level_test_header,
    level_test_options,
    loadtest_default,
    run_option,
    run_options,
    sweep_default,
    with_options,
)
from pipeline.core import exit_codes, values
from pipeline.core.settings import LOADTEST_VARIES, SWEEP_VARIES, cuda_batch_tokens, device_batch_limit
from pipeline.offline.options import model_or_default, parse_storage_options
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig


@click.command()
@CONFIG_OPTION
@with_options(level_test_header("rows", SWEEP_VARIES, "setting", "512,1024,2048,4096,8192,16384"))
@with_options(MODEL_OPTIONS)
@with_options(INPUT_OPTIONS)
@with_options(run_options("long_text", "segment_length"))  # the sweep measures the rows the run computes
@run_option("max_batch_tokens",
            help="Held fixed while --vary max-batch-rows; auto: no token budget (rows alone limit a batch).")
@run_option("max_batch_rows",
            help="Held fixed while --vary max-batch-tokens; auto: the device's, as in run without a sweep "
                 f"recommendation: {device_batch_limit('cpu', 'max_batch_rows')} on CPU, "
                 f"{device_batch_limit('cuda', 'max_batch_rows')} on CUDA.")
@env_option("--sample-rows", "rows", env="SAMPLE_ROWS", type=Checked(values.Integer(1)), default=sweep_default("rows"),
            show_default=True, help="Rows sampled from the input and measured at each level.")
@env_option("--warmup-rows", env="WARMUP_ROWS", type=Checked(values.Integer(0)), default=sweep_default("warmup_rows"),
            show_default=True, help="Rows run before each level's clock starts (not counted).")
@env_option("--seed", env="SEED", type=Checked(values.Integer()), default=sweep_default("seed"), show_default=True,
            help="Which rows the sample takes.")
@with_options(MEMORY_OPTIONS)
@run_option("plan_cache")
@with_options(WORKER_OPTIONS)
@env_option("--no-save", env="NO_SAVE", is_flag=True, help="Do not save the recommendation for `run … auto`.")
@with_options(level_test_options("sweep", "rows/s", "p99 row latency", SweepConfig))
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
@with_options(level_test_header("request texts", LOADTEST_VARIES, "batcher setting", "1,2,4,8,16,32,64"))
@env_option("--qps", env="QPS", type=Checked(values.Number(0, low_open=True)), default=loadtest_default("qps"),
            show_default=True, help="Mean arrival rate, requests per second (Poisson arrivals, open loop).")
@env_option("--concurrency", env="CONCURRENCY", type=Checked(values.Integer(1)),
            default=loadtest_default("concurrency"), show_default=True,
            help="Requests in flight at most; a later arrival waits for a slot and its wait counts in its latency.")
@env_option("--duration", "duration_s", env="DURATION", type=Checked(values.Duration()),
            default=f"{loadtest_default('duration_s'):g}s", show_default=True,
            help="Measured arrivals per level (30s, 2m).")
@env_option("--warmup", "warmup_s", env="WARMUP", type=Checked(values.Duration()), default=f"{loadtest_default('warmup_s'):g}s",
            show_default=True,
            help="Arrivals before each level's measured ones, not counted (a duration: arrivals come by time).")
@env_option("--max-batch-size", env="MAX_BATCH_SIZE", type=Checked(values.Integer(1)),
            default=batcher_default("max_batch_size"), show_default=True,
            help="Requests per batch; a batch runs as soon as this many wait.")
@run_option("max_batch_tokens",
            help="Padded tokens per batch (also a trigger); auto: the device's default, as run's without a "
                 f"sweep: {device_batch_limit('cpu', 'max_batch_tokens')} on CPU, on CUDA a budget that follows "
                 f"the model's size ({cuda_batch_tokens(768, 12)} at BERT-base's). The memory plan caps it.")
@env_option("--batch-timeout-ms", env="BATCH_TIMEOUT_MS", type=Checked(values.Number(0)),
            default=batcher_default("batch_timeout_ms"), show_default=True,
            help="The oldest waiting request waits at most this long for others.")
@env_option("--request-timeout-ms", env="REQUEST_TIMEOUT_MS", type=Checked(values.Number(0, low_open=True)),
            default=batcher_default("request_timeout_ms"), show_default=True,
            help="A request not answered within this fails with a timeout (never computed if still queued).")
@env_option("--max-queue", env="MAX_QUEUE", type=Checked(values.Integer(1)), default=batcher_default("max_queue"),
            show_default=True, help="Requests waiting; one more is rejected at once.")
@env_option("--max-queue-tokens", env="MAX_QUEUE_TOKENS", type=Checked(values.Integer(1)),
            default=batcher_default("max_queue_tokens"), show_default=True,
            help="Padded tokens waiting; one more request is rejected at once.")
@with_options(MODEL_OPTIONS)
@with_options(INPUT_OPTIONS)
@with_options(MEMORY_OPTIONS)
@with_options([TORCH_THREADS_OPTION])
@run_option("safety")
@run_option("probe", help="Cap batches by the memory plan (cached, or probed on the device first).")
@with_options(CACHE_OPTIONS)
@env_option("--sample-rows", env="SAMPLE_ROWS", type=Checked(values.Integer(2)),
            default=loadtest_default("sample_rows"),
            show_default=True, help="Texts sampled from the input; requests cycle through them in random order.")
@env_option("--seed", env="SEED", type=Checked(values.Integer()), default=loadtest_default("seed"), show_default=True,
            help="Which texts the sample takes and the arrival times.")
@with_options(level_test_options("load test", "requests/s", "p99 latency", OnlineLoadtestConfig))
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
