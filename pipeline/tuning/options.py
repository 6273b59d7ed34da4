"""The options of `plan`, `sweep` and `loadtest`, declared as `run`'s are (`pipeline.core.options.Option`
rows, in the order `--help` lists them): the groups of run options they take (`pipeline.offline.options`),
the run options they say otherwise, and their own. With `run`'s, `status`'s and `verify`'s they make
`COMMAND_OPTIONS`, every command's table, and `OTHER_COMMANDS_KEYS`, the keys a run's --config file may
hold for another command. The CLI makes its click options of these tables alone."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core import values
from pipeline.core.options import Option, options_of
from pipeline.core.settings import LOADTEST_VARIES, SWEEP_VARIES, cuda_batch_tokens, device_batch_limit
from pipeline.offline.options import (
    BATCH_GROUP,
    CACHE_GROUP,
    FLAG,
    INPUT_GROUP,
    JSON_OPTION,
    LOG_LEVEL_OPTIONS,
    LONG_TEXT_GROUP,
    MEMORY_GROUP,
    MODEL_GROUP,
    RUN_OPTIONS,
    STATUS_OPTIONS,
    VERIFY_OPTIONS,
    WORKER_GROUP,
)
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig

PLAN_OPTIONS: dict[str, Option] = {
    **MODEL_GROUP, **BATCH_GROUP, **CACHE_GROUP,
    "json": JSON_OPTION.but(help="Print the plan as JSON."),
    "available": Option(values.Size(),
        help="Calculator mode, no model: bytes available (e.g. 24GiB); needs --per-sample."),
    "per_sample": Option(values.Size(),
        help="Calculator mode: peak activation bytes of one sample (e.g. 384MiB)."),
    "input": RUN_OPTIONS["input"].but(
        help="The input shards of the run: --dtype auto's trial runs on their rows, as the run's; --estimate reads "
             "them."),
    **INPUT_GROUP,
    "estimate": Option(FLAG, False,
        help="Predict the run's device and wall seconds on --input: rows from the footers, token lengths from a "
             "sample, throughput from the saved sweep (else measured here on the sample)."),
    "window": Option(values.Duration(), parameter="window_s",
        help="--estimate: the time the run must fit in (e.g. 4h); prints the --num-shards it needs."),
    "sample_rows": Option(values.Integer(1), 2000,
        help="--estimate: rows tokenized to learn the token lengths."),
    "reuse": RUN_OPTIONS["reuse"].but(
        help="--estimate: the output the run will --reuse; the sampled rows it has cost no device time."),
    **LONG_TEXT_GROUP,  # plans and estimates the rows the run computes
    "models": RUN_OPTIONS["models"].but(
        help="The run's several models (a TOML [models.NAME] table each): each model's plan, the rows a batch of one "
             "pass takes, and with --estimate each model's and the pass's figures."),
    **WORKER_GROUP,
}


@dataclass(frozen=True)
class LevelTest:
    """What `sweep` and `loadtest`, the two tests of one setting over levels, each say in the options they
    share (`level_test_group`)."""

    name: str  # "sweep": an earlier sweep CSV
    sampled: str  # what the sample takes from the input: "rows"
    varies: tuple[str, ...]  # the settings --vary takes
    setting: str  # what --vary picks: "setting", "batcher setting"
    example: str  # levels for --values, e.g. "1,2,4"
    throughput: str  # its throughput's unit: "rows/s"
    p99: str  # its latency: "p99 row latency"
    config: type  # the config class its defaults come from


SWEEP = LevelTest("sweep", "rows", SWEEP_VARIES, "setting", "512,1024,2048,4096,8192,16384", "rows/s",
                  "p99 row latency", SweepConfig)
LOADTEST = LevelTest("load test", "request texts", LOADTEST_VARIES, "batcher setting", "1,2,4,8,16,32,64",
                     "requests/s", "p99 latency", OnlineLoadtestConfig)
LEVEL_TEST_HEADER = ("input", "vary", "values")  # the group's options that open the command; the rest close it


def level_test_group(test: LevelTest) -> dict[str, Option]:
    """The options `sweep` and `loadtest` share, in one group: the input the sample comes from, the one
    setting varied and its levels; the recommendation's limits, the comparison with an earlier CSV and
    the outputs."""
    return {
        "input": RUN_OPTIONS["input"].but(required=True,
            help=f"Shards to sample {test.sampled} from: a directory, a glob or a file, local or fsspec URL. "
                 "Repeatable."),
        "vary": Option(values.OneOf(*test.varies), required=True,
            help=f"The one {test.setting} that changes between levels."),
        "values": Option(values.IntegerList(), required=True,
            help=f"Its levels, e.g. {test.example}."),
        "max_p99_ms": Option(values.Number(0, low_open=True),
            help=f"Recommend only levels whose {test.p99} is within this."),
        "memory_headroom": Option(values.Number(0, 0.9), test.config.default("memory_headroom"),
            help="Recommend only levels that leave this share of the memory budget free."),
        "compare": Option(values.FilePath(), parameter="compare_with",
            help=f"An earlier {test.name} CSV: print the change per level and flag regressions."),
        "max_throughput_drop": Option(values.Number(0, 1), 0.05,
            help=f"--compare flags a level whose {test.throughput} fell by more than this share."),
        "max_p99_rise": Option(values.Number(0), 0.10,
            help=f"--compare flags a level whose {test.p99} rose by more than this share."),
        "fail_on_regression": Option(FLAG, False,
            help="Exit 3 when --compare flags any level."),
        "out": Option(values.FilePath(), required=True,
            help="The CSV, one row per level; the fixed settings, the diagnosis and the recommendation go to "
                 "OUT.json."),
        "plot": Option(values.FilePath(),
            help=f"Also draw {test.throughput}, {test.p99} and memory against the level (needs matplotlib)."),
    }


def level_test_options(test: LevelTest, own: dict[str, Option]) -> dict[str, Option]:
    """A level test's table: the shared group's header, the test's `own` options, the group's rest."""
    group = level_test_group(test)
    rest = [key for key in group if key not in LEVEL_TEST_HEADER]
    return {**options_of(group, *LEVEL_TEST_HEADER), **own, **options_of(group, *rest)}


SWEEP_OPTIONS = level_test_options(SWEEP, {
    **MODEL_GROUP, **INPUT_GROUP,
    **LONG_TEXT_GROUP,  # the sweep measures the rows the run computes
    "max_batch_tokens": RUN_OPTIONS["max_batch_tokens"].but(
        help="Held fixed while --vary max-batch-rows; auto: no token budget (rows alone limit a batch)."),
    "max_batch_rows": RUN_OPTIONS["max_batch_rows"].but(
        help="Held fixed while --vary max-batch-tokens; auto: the device's, as in run without a sweep "
             f"recommendation: {device_batch_limit('cpu', 'max_batch_rows')} on CPU, "
             f"{device_batch_limit('cuda', 'max_batch_rows')} on CUDA."),
    "sample_rows": Option(values.Integer(1), SweepConfig.default("rows"), parameter="rows",
        help="Rows sampled from the input and measured at each level."),
    "warmup_rows": Option(values.Integer(0), SweepConfig.default("warmup_rows"),
        help="Rows run before each level's clock starts (not counted)."),
    "seed": Option(values.Integer(), SweepConfig.default("seed"),
        help="Which rows the sample takes."),
    **MEMORY_GROUP,
    **options_of(CACHE_GROUP, "plan_cache"),
    **WORKER_GROUP,
    "no_save": Option(FLAG, False,
        help="Do not save the recommendation for `run … auto`."),
})

LOADTEST_OPTIONS = level_test_options(LOADTEST, {
    "qps": Option(values.Number(0, low_open=True), OnlineLoadtestConfig.default("qps"),
        help="Mean arrival rate, requests per second (Poisson arrivals, open loop)."),
    "concurrency": Option(values.Integer(1), OnlineLoadtestConfig.default("concurrency"),
        help="Requests in flight at most; a later arrival waits for a slot and its wait counts in its latency."),
    "duration": Option(values.Duration(), f"{OnlineLoadtestConfig.default('duration_s'):g}s", parameter="duration_s",
        help="Measured arrivals per level (30s, 2m)."),
    "warmup": Option(values.Duration(), f"{OnlineLoadtestConfig.default('warmup_s'):g}s", parameter="warmup_s",
        help="Arrivals before each level's measured ones, not counted (a duration: arrivals come by time)."),
    "max_batch_size": Option(values.Integer(1), BatcherConfig.default("max_batch_size"),
        help="Requests per batch; a batch runs as soon as this many wait."),
    "max_batch_tokens": RUN_OPTIONS["max_batch_tokens"].but(
        help="Padded tokens per batch (also a trigger); auto: the device's default, as run's without a "
             f"sweep: {device_batch_limit('cpu', 'max_batch_tokens')} on CPU, on CUDA a budget that follows "
             f"the model's size ({cuda_batch_tokens(768, 12)} at BERT-base's). The memory plan caps it."),
    "batch_timeout_ms": Option(values.Number(0), BatcherConfig.default("batch_timeout_ms"),
        help="The oldest waiting request waits at most this long for others."),
    "request_timeout_ms": Option(values.Number(0, low_open=True), BatcherConfig.default("request_timeout_ms"),
        help="A request not answered within this fails with a timeout (never computed if still queued)."),
    "max_queue": Option(values.Integer(1), BatcherConfig.default("max_queue"),
        help="Requests waiting; one more is rejected at once."),
    "max_queue_tokens": Option(values.Integer(1), BatcherConfig.default("max_queue_tokens"),
        help="Padded tokens waiting; one more request is rejected at once."),
    **MODEL_GROUP, **INPUT_GROUP, **MEMORY_GROUP,
    **options_of(WORKER_GROUP, "torch_threads"),
    **options_of(BATCH_GROUP, "safety"),
    "probe": RUN_OPTIONS["probe"].but(help="Cap batches by the memory plan (cached, or probed on the device first)."),
    **CACHE_GROUP,
    "sample_rows": Option(values.Integer(2), OnlineLoadtestConfig.default("sample_rows"),
        help="Texts sampled from the input; requests cycle through them in random order."),
    "seed": Option(values.Integer(), OnlineLoadtestConfig.default("seed"),
        help="Which texts the sample takes and the arrival times."),
})

COMMAND_OPTIONS: dict[str, dict[str, Option]] = {  # every command's table (each takes --config, but verify)
    "run": {**RUN_OPTIONS, **LOG_LEVEL_OPTIONS}, "plan": {**PLAN_OPTIONS, **LOG_LEVEL_OPTIONS},
    "sweep": {**SWEEP_OPTIONS, **LOG_LEVEL_OPTIONS}, "loadtest": {**LOADTEST_OPTIONS, **LOG_LEVEL_OPTIONS},
    "status": STATUS_OPTIONS, "verify": VERIFY_OPTIONS,
}
# The TOML keys only other commands take: a run's --config file may hold them and a run skips them
OTHER_COMMANDS_KEYS = frozenset(key for table in COMMAND_OPTIONS.values() for key in table
                                if key not in COMMAND_OPTIONS["run"])
