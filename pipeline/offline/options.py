"""`lengthwise run`'s options, declared once: each one's kind (`pipeline.core.values`), default and
LENGTHWISE_<NAME> variable. The CLI makes its click options of them (other commands share the
model, input, batch and worker ones); `pipeline.api.run` resolves its keywords with them, with no
click: keyword → LENGTHWISE_* variable → the `config` TOML file → default. Both end in `run_config`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.core import values
from pipeline.core.errors import UsageError
from pipeline.core.settings import LONG_TEXT_MODES
from pipeline.offline.config import RunConfig
from pipeline.sample_data import SAMPLE_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class RunOption:
    """One option: what it takes, its default as a flag would give it, whether it repeats, and the
    name `run_config` takes it by when that is not the option's."""

    kind: values.Kind
    default: object = None
    multiple: bool = False
    parameter: str | None = None

    def parse(self, value):
        """The option's value from one source; ValueError says what is wrong."""
        if self.multiple:
            return tuple(self.kind.parse(item) for item in value)
        return None if value is None else self.kind.parse(value)


def _field(name: str):
    return RunConfig.default(name)


COUNT_DEFAULT = "auto"  # what a CountOrAuto option says for its default (None: the sweep or the device decides)
TEXT, FLAG = values.Text(), values.Flag()
SWITCHES = values.OneOf("auto", "on", "off")

RUN_OPTIONS: dict[str, RunOption] = {
    "input": RunOption(TEXT, multiple=True, parameter="inputs"),
    "output": RunOption(TEXT),
    "demo": RunOption(FLAG, False),
    "job": RunOption(TEXT, _field("job")),
    "model": RunOption(TEXT),
    "max_length": RunOption(values.Integer(1), _field("max_length")),
    "prompt": RunOption(TEXT),
    "prompt_name": RunOption(TEXT),
    "device": RunOption(TEXT, _field("device")),
    "dtype": RunOption(values.OneOf("auto", "float32", "bfloat16", "float16"), _field("dtype")),
    "compile": RunOption(SWITCHES, _field("compile")),
    "unpad": RunOption(SWITCHES, _field("unpad")),
    "allow_pickle": RunOption(FLAG, False),
    "trust_remote_code": RunOption(FLAG, False),
    "id_column": RunOption(TEXT, _field("id_column")),
    "text_column": RunOption(TEXT, _field("text_column")),
    "pair_column": RunOption(TEXT),
    "storage_option": RunOption(TEXT, multiple=True),  # KEY=VALUE pairs; a TOML [storage] table
    "keep_columns": RunOption(values.Names(), _field("keep_columns")),
    "split": RunOption(TEXT),
    "long_text": RunOption(values.OneOf(*LONG_TEXT_MODES), _field("long_text")),
    "segment_length": RunOption(values.Integer(4)),
    "max_batch_tokens": RunOption(values.CountOrAuto("tokens"), COUNT_DEFAULT),
    "max_batch_rows": RunOption(values.CountOrAuto("rows"), COUNT_DEFAULT),
    "memory_budget": RunOption(values.Size()),
    "memory_reserve": RunOption(values.Number(0, 0.9), _field("memory_reserve")),
    "plan_cache": RunOption(TEXT),
    "safety": RunOption(values.Number(1.0, 4.0), _field("safety")),
    "no_plan_cache": RunOption(FLAG, False),
    "probe": RunOption(FLAG, _field("probe")),
    "window_rows": RunOption(values.CountOrAuto("rows"), COUNT_DEFAULT),
    "threshold": RunOption(TEXT, multiple=True),  # LABEL=SCORE pairs; a TOML [thresholds] table
    "default_threshold": RunOption(values.Number(0, 1), _field("default_threshold")),
    "flag_labels": RunOption(values.Names()),
    "tokenize_workers": RunOption(values.CountOrAuto("workers", minimum=0), COUNT_DEFAULT),
    "prefetch_batches": RunOption(values.Integer(1), _field("prefetch_batches")),
    "torch_threads": RunOption(values.Integer(1)),
    "overwrite": RunOption(FLAG, False),
    "reuse": RunOption(TEXT),
    "dedupe": RunOption(FLAG, _field("dedupe")),
    "engine": RunOption(values.OneOf("local", "ray"), _field("engine")),
    "ray_address": RunOption(TEXT),
    "workers": RunOption(values.Integer(1)),
    "threads_per_worker": RunOption(values.Integer(1)),
    "num_shards": RunOption(values.Integer(1), _field("num_shards")),
    "shard_index": RunOption(values.Integer()),
    "fail_fast": RunOption(FLAG, False),
    "lock_lease": RunOption(values.Duration(), _field("lock_lease_s"), parameter="lock_lease_s"),
    "progress": RunOption(FLAG),  # None: a bar only on a terminal (`show_progress`)
    "summary_json": RunOption(TEXT),
    "metrics_textfile": RunOption(TEXT),
    "metrics_interval": RunOption(values.Duration(), _field("metrics_interval_s"), parameter="metrics_interval_s"),
    "pushgateway": RunOption(TEXT),
}
LOG_LEVEL_OPTIONS: dict[str, RunOption] = {"quiet": RunOption(FLAG, False), "verbose": RunOption(FLAG, False)}  # every
# command's -q / -v: the log level, not the run's settings
TABLES = {"storage": "storage_option", "thresholds": "threshold"}  # a TOML table → the repeatable pair option
# The TOML keys only other commands take (sweep, loadtest, plan, status, verify): a run's --config file may hold
# them and a run skips them. tests/cli/test_options.py holds this against the commands.
OTHER_COMMANDS_KEYS = frozenset({
    "available", "batch_timeout_ms", "compare", "concurrency", "duration", "estimate", "fail_on_regression", "json",
    "max_batch_size", "max_p99_ms", "max_p99_rise", "max_queue", "max_queue_tokens", "max_throughput_drop", "metrics",
    "memory_headroom", "no_save", "out", "per_sample", "plot", "qps", "request_timeout_ms", "sample_rows", "seed",
    "values", "vary", "warmup", "warmup_rows", "window"})


def env_name(option: str) -> str:
    return f"LENGTHWISE_{option.upper()}"


def config_file_values(path: str, kinds: Mapping[str, tuple[values.Kind, bool]], other_keys) -> dict:
    """A TOML job file's values by option name, type-checked, never coerced: `kinds` maps the command's
    options to (kind, repeats); keys in `other_keys` (another command's) are skipped, any other unknown key
    is an error. Its [storage] and [thresholds] tables become KEY=VALUE pairs. ValueError says what is
    wrong, naming the file and the key."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    found = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in TABLES:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: [{name}] must be a table" + (" of label = score" * (name == "thresholds")))
            if TABLES[name] in kinds or name == "storage":
                found[TABLES[name]] = [f"{k}={v if name == 'thresholds' else json.dumps(v)}" for k, v in value.items()]
            continue
        if name not in kinds:
            if name in other_keys:  # e.g. `output` of a run's file, read by `sweep --config`
                continue
            raise ValueError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(kinds))}")
        kind, multiple = kinds[name]
        if multiple and isinstance(value, str):
            value = [value]
        problem = kind.toml_problem(value, multiple)
        if problem:
            raise ValueError(f"{path}: {key} {problem}; fix it in the file")
        found[name] = value
    return found


def keyword_value(name: str, option: RunOption, value):
    """An API keyword as the option takes it: True/False for a flag, a dict for KEY=VALUE pairs
    (threshold={"toxic": 0.8}), a list for a repeatable option; a list for any other option is its items
    comma-separated, as the flag takes names (keep_columns=["label", "lang"])."""
    if isinstance(option.kind, values.Flag) and not isinstance(value, bool):
        raise UsageError(f"{name}={value!r}: give True or False")
    if option.multiple:
        if isinstance(value, Mapping):
            return [f"{key}={item if isinstance(item, str) else json.dumps(item)}" for key, item in value.items()]
        return [value] if isinstance(value, str) else list(value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return value


def resolve_run_options(given: Mapping, environ: Mapping[str, str]) -> dict:
    """`run`'s options (and quiet, verbose) by parameter name from API keywords (`given`, a `config`
    file among them), then LENGTHWISE_* variables, then the file, then defaults, as the CLI resolves
    its flags. A repeated KEY=VALUE option given by keyword or variable overrides the file's table key
    by key."""
    options = {**RUN_OPTIONS, **LOG_LEVEL_OPTIONS}
    unknown = sorted(set(given) - set(options) - {"config"})
    if unknown:
        raise UsageError(f"run() has no option {unknown[0]!r}; options: {', '.join(sorted([*options, 'config']))}")
    from_file = {}
    if given.get("config") is not None:
        kinds = {name: (option.kind, option.multiple) for name, option in options.items()}
        try:
            from_file = config_file_values(str(given["config"]), kinds, OTHER_COMMANDS_KEYS)
        except ValueError as error:
            raise UsageError(f"config={given['config']!r}: {error}") from None
    resolved = {}
    for name, option in options.items():
        variable = env_name(name)
        if given.get(name) is not None:
            where, value = f"{name}={given[name]!r}", keyword_value(name, option, given[name])
        elif environ.get(variable) is not None:
            text = environ[variable]
            where, value = f"{variable}={text!r}", (text.split() if option.multiple else text)
        else:
            where, value = None, from_file.get(name, [] if option.multiple else option.default)
        if where is not None and name in TABLES.values():
            value = [*from_file.get(name, []), *value]  # over the file's table key by key: the last pair of a key wins
        try:
            resolved[option.parameter or name] = option.parse(value)
        except ValueError as error:
            raise UsageError(f"{where or name}: {error}") from None
    return resolved


def run_config(inputs, output, model, storage_option, no_plan_cache, threshold, keep_columns, demo, progress,
               **settings) -> RunConfig:
    """The RunConfig of `run`'s resolved options (the CLI's and `pipeline.api.run`'s)."""
    if demo:
        if inputs:
            raise UsageError("--demo reads the packaged sample; drop --input (or `input` in the --config file)")
        inputs = (SAMPLE_DIR,)
    if not inputs:
        raise UsageError("no input; set --input (or `input` in the --config file), or --demo for the packaged sample")
    if not output:
        raise UsageError("no output directory; set --output (or `output` in the --config file)")
    if settings.get("lock_lease_s", 1) <= 0:
        raise UsageError("--lock-lease must be more than 0s (e.g. 5m)")
    return RunConfig.of(input=tuple(inputs), output=output, model=model_or_default(model),
                        storage_options=parse_storage_options(storage_option), thresholds=parse_thresholds(threshold),
                        keep_columns=keep_columns, use_plan_cache=not no_plan_cache,
                        progress=show_progress(progress, sys.stderr), **settings)


def run_config_from(given: Mapping, environ: Mapping[str, str] | None = None) -> tuple[RunConfig, bool, bool]:
    """The RunConfig of API keywords (`resolve_run_options`, then `run_config`), and whether quiet and
    verbose were asked for."""
    options = resolve_run_options(given, os.environ if environ is None else environ)
    quiet, verbose = options.pop("quiet"), options.pop("verbose")
    return run_config(**options), quiet, verbose


def model_or_default(model: str | None) -> str | None:
    return None if model in (None, "", "default") else model


def show_progress(asked: bool | None, stream) -> bool:
    """--progress / --no-progress as asked; otherwise a bar only where someone watches: on a
    terminal, never into a log file or a scheduler's captured output."""
    if asked is not None:
        return asked
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def parse_storage_options(pairs: tuple[str, ...]) -> dict:
    """KEY=VALUE pairs; a VALUE that reads as JSON (false, 3, {"a": 1}) keeps its type."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def parse_thresholds(pairs: tuple[str, ...]) -> dict[str, float]:
    """LABEL=SCORE pairs (the label may itself contain `=`: the score follows the last one)."""
    thresholds = {}
    for pair in pairs:
        label, sep, score = pair.rpartition("=")
        try:
            thresholds[label] = float(score)
        except ValueError:
            sep = ""
        if not sep or not label:
            raise UsageError(f"--threshold {pair!r} is not LABEL=SCORE, e.g. --threshold toxic=0.8")
    return thresholds
