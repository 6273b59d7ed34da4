"""lengthwise from Python (an Airflow PythonOperator, a notebook): `run(input, output, job, **options)`.

The options are `lengthwise run`'s flags with underscores (`max_length=128`, `keep_columns=["label"]`,
`threshold={"toxic": 0.8}`, `config="configs/nightly_moderation.toml"`), parsed by the same command,
so defaults, LENGTHWISE_* variables, TOML files and checks are the CLI's. Errors are exceptions,
never an exit: UsageError (exit 2 on the CLI), ShardsFailed (exit 1) and StorageError (exit 4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import click

from pipeline.cli.job_commands import run as run_command
from pipeline.cli.job_commands import run_config
from pipeline.core.errors import UsageError
from pipeline.engines.execute import execute_run


class ShardsFailed(RuntimeError):
    """Some shards failed (the others are committed); `summary` says which. Rerun to retry them."""

    def __init__(self, summary: dict):
        super().__init__(f"{len(summary['failed_shards'])} shard(s) failed: "
                         + "; ".join(f"{f['shard']}: {f['error']}" for f in summary["failed_shards"][:3]))
        self.summary = summary


def run(input: str | list[str], output: str | None = None, job: str = "embed", **options) -> dict:
    """Run `job` over `input` into `output` and return the summary (the keys of --summary-json).

    Raises UsageError on bad settings (nothing written), ShardsFailed when shards failed and
    StorageError when the output's storage refused a write (committed shards stay; rerun).
    A script that calls this must do so under `if __name__ == "__main__":` unless
    tokenize_workers=0 (the tokenizer workers are spawned and re-run the main script)."""
    arguments = ["--job", job, *_flag_arguments("input", [input] if isinstance(input, str) else list(input))]
    if output is not None:
        arguments += ["--output", output]
    for name, value in options.items():
        arguments += _flag_arguments(name, value)
    try:
        with run_command.make_context("lengthwise run", arguments) as context:
            config = run_config(**{name: context.params[name] for name in context.params})
    except click.ClickException as error:  # a bad value, an unknown flag, an unreadable --config file
        raise UsageError(error.format_message()) from None
    summary = json.loads(execute_run(config).to_json())
    if summary["failed_shards"]:
        raise ShardsFailed(summary)
    return summary


def _options_by_name() -> dict[str, click.Option]:
    """`run`'s options by flag name with underscores (max_length, no_plan_cache, probe …)."""
    return {option.opts[0].lstrip("-").replace("-", "_"): option for option in run_command.params
            if isinstance(option, click.Option)}


def _flag_arguments(name: str, value) -> list[str]:
    """The command-line arguments of one keyword option."""
    option = _options_by_name().get(name)
    if option is None:
        raise UsageError(f"run() has no option {name!r}; options: {', '.join(sorted(_options_by_name()))}")
    flag = option.opts[0]
    if value is None:
        return []
    if option.is_flag:
        if not isinstance(value, bool):
            raise UsageError(f"{name}={value!r}: give True or False")
        if value:
            return [flag]
        return [option.secondary_opts[0]] if option.secondary_opts else []
    if isinstance(value, Mapping):  # threshold={"toxic": 0.8}, storage_option={"anon": True}
        pairs = [f"{key}={item if isinstance(item, str) else json.dumps(item)}" for key, item in value.items()]
        return [argument for pair in pairs for argument in (flag, pair)]
    if isinstance(value, (list, tuple)):
        if option.multiple:
            return [argument for item in value for argument in (flag, str(item))]
        return [flag, ",".join(map(str, value))]  # keep_columns=["label", "lang"]
    return [flag, str(value)]
