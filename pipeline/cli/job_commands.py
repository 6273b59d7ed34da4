"""`lengthwise run`, `plan` and `status`."""

from __future__ import annotations

import json
import sys
import time

import click

from pipeline.cli.options import CONFIG_OPTION, LOG_OPTIONS, declared_options, exit_on_known_errors, fail, with_options
from pipeline.core import exit_codes
from pipeline.offline.config import RunConfig
from pipeline.offline.options import (
    RUN_OPTIONS,
    STATUS_OPTIONS,
    VERIFY_OPTIONS,
    model_or_default,
    parse_storage_options,
    run_config,
)
from pipeline.engines.execute import check_run_paths, execute_run
from pipeline.tuning.options import PLAN_OPTIONS


@click.command(epilog=f"\b\nExit codes:\n{exit_codes.exit_codes_help()}")
@CONFIG_OPTION
@declared_options(RUN_OPTIONS)
@with_options(LOG_OPTIONS)
def run(**options) -> None:
    """Run a job over every input shard and write one output shard per input shard."""
    with exit_on_known_errors():
        config = run_config(**options)
        summary = execute_run(config)
    click.echo(summary.to_text())
    if config.summary_json:
        click.echo(f"summary json    {config.summary_json}")
    if summary.failed_shards:
        click.echo(f"error: {len(summary.failed_shards)} shard(s) failed (listed above); the others are committed. "
                   "Rerun the same command to retry them.", err=True)
        sys.exit(exit_codes.SHARDS_FAILED)


@click.command()
@CONFIG_OPTION
@declared_options(PLAN_OPTIONS)
@with_options(LOG_OPTIONS)
def plan(model, no_plan_cache, as_json, available, per_sample, inputs, storage_option, estimate, window_s,
         sample_rows, models, **settings) -> None:
    """Show how many rows each length bucket gets, probed on the device (or cached).

    With --available and --per-sample it is a calculator for the bare formula:
    rows = floor(available / (per_sample x safety)). With --input and --estimate it predicts
    whether a run fits its --window; for several models, also what one pass saves over separate runs.
    """
    from pipeline.core.memory import batch_rows
    from pipeline.offline.model_set import check_model_flags, model_tables

    with exit_on_known_errors():
        check_model_flags(models, model, {}, None)
        settings["models"] = model_tables(models, RUN_OPTIONS)
    if estimate:
        print_estimate(inputs, model, no_plan_cache, storage_option, window_s, sample_rows, as_json, settings)
        return
    if window_s is not None or settings.get("reuse"):
        fail(f"{'--window' if window_s is not None else '--reuse'} goes with --estimate")

    if available is not None or per_sample is not None:
        if settings["models"]:
            fail("calculator mode takes no model: drop the [models] tables (or --models)")
        if available is None or per_sample is None:
            fail("calculator mode needs both --available and --per-sample")
        rows = batch_rows(available, per_sample, settings["safety"])
        click.echo(json.dumps({"available_bytes": available, "per_sample_bytes": per_sample,
                               "safety": settings["safety"], "batch_rows": rows}) if as_json else rows)
        return
    from pipeline.runtime import open_runtime

    with exit_on_known_errors():
        config = RunConfig.of(input=tuple(inputs), output="", model=model_or_default(model),
                              use_plan_cache=not no_plan_cache, storage_options=parse_storage_options(storage_option),
                              **{**settings, "probe": True})  # the plan is what `plan` shows
        check_run_paths(config)
        # --dtype auto's trial on the input's rows, as the run's: the plan is made for the run's dtype
        if config.models:
            print_model_set_plans(config, as_json)
            return
        memory_plan = open_runtime(config).plan
    if memory_plan is None:
        fail("no plan: the memory probe failed (see above)")
    click.echo(memory_plan.to_json() if as_json else memory_plan.to_table())


def print_model_set_plans(config: RunConfig, as_json: bool) -> None:
    """Each model's memory plan, opened as the run of several opens it, and the rows per padded length a
    batch of the pass takes: the fewest any model's plan allows."""
    from dataclasses import asdict

    from pipeline.offline.model_set_setup import open_models

    opened = open_models(config)
    configs, runtimes = opened.configs, opened.runtimes
    plans = {name: runtime.plan for name, runtime in runtimes.items()}
    if any(each is None for each in plans.values()):
        fail("no plan: the memory probe failed (see above)")
    limits = opened.runtime.limits
    lengths = sorted({bucket.length for each in plans.values() for bucket in each.buckets})
    one_pass = {length: limits.rows_for(length) for length in lengths}
    if as_json:
        click.echo(json.dumps({"models": {name: asdict(each) for name, each in plans.items()},
                               "one_pass_rows": {str(length): rows for length, rows in one_pass.items()}}, indent=2))
        return
    for name, each in plans.items():
        click.echo(f"model {name} ({configs[name].model.job}, {runtimes[name].loaded.choice.path})")
        click.echo(each.to_table())
        click.echo("")
    click.echo("one pass: rows per padded length, the fewest any model allows: "
               + ", ".join(f"≤{length}: {rows}" for length, rows in one_pass.items()))


def print_estimate(inputs, model, no_plan_cache, storage_option, window_s, sample_rows, as_json, settings) -> None:
    from pipeline.tuning.estimate import estimate_run

    if not inputs:
        fail("--estimate needs --input: the shards the run will read")
    with exit_on_known_errors():  # a StorageError: the input's store could not be listed
        config = RunConfig.of(input=tuple(inputs), output="", model=model_or_default(model), progress=False,
                              storage_options=parse_storage_options(storage_option),
                              use_plan_cache=not no_plan_cache, **settings)
        check_run_paths(config)
        found = estimate_run(config, sample_rows, window_s)
    click.echo(json.dumps({"estimate": found.to_dict()}, indent=2) if as_json else found.to_text())


@click.command()
@CONFIG_OPTION
@declared_options(STATUS_OPTIONS)
def status(output, storage_option, as_json, as_metrics) -> None:
    """How much of a run is done: shards done, failed and pending, rows done, and what the
    output holds (rows, errors, truncated, flagged by label), as the run's summary prints it.

    Reads the run manifest, the footers of the input it records (as absolute URLs, so it
    answers from any directory with only --output) and one listing of the output; loads no
    model. With --config, the job file's `output` and [storage] are used and its other keys are
    skipped.

    A shard marked done counts done only while its output file backs the marker: a file missing,
    not readable Parquet, or whose footer has other rows (read only when its size is not the one
    recorded at the commit) counts pending, as the next run redoes it. Only `verify` audits the
    rows (ids, order, errors).

    Exit 0 when every shard is done, 1 when not (pending or failed), 2 usage error, 4 storage error.
    """
    from pipeline.offline.manifest import run_status

    if not output:
        fail("no output directory; set --output (or `output` in the --config file)")
    with exit_on_known_errors(output):
        report = run_status(output, parse_storage_options(storage_option))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    elif as_metrics:
        from pipeline.offline.metrics import exposition, metric_labels, progress_figures

        labels = metric_labels(report["job"], report["model"], report["output"], tuple(report.get("models") or ()))
        click.echo(exposition(progress_figures(report, time.time()), labels).decode(), nl=False)
    else:
        print_status(report)
    if report["done"] < report["shards"]:  # not complete: a sensor on `status` waits
        sys.exit(exit_codes.SHARDS_FAILED)


def print_status(report: dict) -> None:
    """`status`'s text: the counts, the output's totals, then a line per shard that needs a look."""
    from pipeline.offline.summary import totals_lines

    click.echo(f"{report['output']}: {report['done']} of {report['shards']} shards done, {report['failed']} failed, "
               f"{report['pending']} pending; {report['rows_done']:,} of {report['rows']:,} rows done")
    for line in totals_lines(report["totals"]):
        click.echo(line)
    for name, model in report.get("models", {}).items():
        click.echo(f"model {name:<10}{model['job']} ({model['model']}): {model['shards_done']} of {report['shards']} "
                   f"shards, {model['rows_done']:,} rows done")
    for failed in report["failed_shards"]:
        click.echo(f"failed  {failed['shard']}: {failed['error']}")
    for untrusted in report["untrusted_shards"]:
        click.echo(f"not done  {untrusted['shard']}: marked done but {untrusted['reason']}; a run redoes it")
    for changed in report["changed_shards"]:
        click.echo(f"changed   {changed['output']}: rewritten since its commit ({changed['bytes']:,} bytes, its marker "
                   f"records {changed['recorded_bytes']:,}) with the same {changed['rows']:,} rows; counted done, "
                   "`lengthwise verify` audits its ids")
    workers = report["workers"]
    for setting in dict.fromkeys(w["last_batch_setting"] for w in workers if w["last_batch_setting"]):
        click.echo(f"batch setting   {setting} (the last run's)")
    if len(workers) > 1:
        for worker in workers:
            speed = f", last {worker['last_rows_per_s']:,.1f} rows/s" if worker["last_rows_per_s"] else ""
            click.echo(f"worker {worker['index']}: {worker['done']} of {worker['shards']} shards done, "
                       f"{worker['failed']} failed, {worker['pending']} pending"
                       f"{' (running)' if worker['running'] else ''}{speed}")
    for lock in report["locks"]:
        click.echo(lock_line(lock))


def lock_line(lock: dict) -> str:
    """`status`'s line for one lock: who holds it, and its lease's age and expiry."""
    age, left = lock.get("lease_age_s"), lock.get("lease_expires_in_s")
    if lock.get("unreadable"):
        written = f"written {age:.0f}s ago" if age is not None else "written at an unknown time"
        after = f"once older than {lock['lease_s']:.0f}s" if lock["alive"] else "by the next run"
        return f"unreadable lock {lock['path']} (empty or truncated), {written}; taken over {after}"
    who = f"worker {lock['index']} of {lock['count']} " if lock.get("count", 1) > 1 else ""
    if lock["alive"]:
        state = "running"
    elif left is not None and left < 0:
        state = f"stale lock (its lease expired {-left:.0f}s ago: that run is gone)"
    else:
        state = "stale lock (that process is gone)"
    lease = f"; lease renewed {age:.0f}s ago, expires in {left:.0f}s" if lock["alive"] and left is not None else ""
    return f"{who}{state}: pid {lock.get('pid')} on {lock.get('host')} since {lock.get('since')}{lease}"


@click.command()
@declared_options(VERIFY_OPTIONS)
def verify(inputs, output, storage_option, as_json) -> None:
    """Check an output against its input: every shard committed under the recorded settings, every
    input id exactly once and in input order, no partial file; row errors counted by reason.

    Exit 0 when complete, 1 when not (each shard's missing, extra and duplicated ids are listed).
    Reads the id and error columns only; loads no model.
    """
    from pipeline.offline.verify import verify_output

    with exit_on_known_errors(output):
        report = verify_output(list(inputs), output, parse_storage_options(storage_option))
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.to_text())
    if not report.complete:
        sys.exit(exit_codes.SHARDS_FAILED)
