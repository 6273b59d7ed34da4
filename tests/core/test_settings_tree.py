"""The settings tree: a product's config built from flat names (flags, TOML keys, API keywords),
its groups defined once, changed once, and recorded flat."""

import pytest

from pipeline.core.errors import UsageError
from pipeline.core.settings import BatchSettings, InputSettings, ModelSettings
from pipeline.offline.config import RunConfig
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig


def test_flat_names_land_in_their_group_and_the_rest_keep_their_defaults():
    config = RunConfig.of(input=("a", "b"), output="out", max_length=64, max_batch_tokens=4096, keep_columns=("x",))
    assert config.source == InputSettings(input=("a", "b"))
    assert config.model == ModelSettings(max_length=64, thresholds={})  # a run checks its thresholds
    assert config.batch == BatchSettings(max_batch_tokens=4096)
    assert (config.output, config.keep_columns, config.dedupe) == ("out", ("x",), True)


def test_an_unknown_name_is_a_usage_error_that_lists_the_known_ones():
    with pytest.raises(UsageError, match=r"unknown setting\(s\) max_lenght; known: .*max_length"):
        RunConfig.of(output="out", max_lenght=64)


def test_with_settings_changes_only_what_it_names_in_one_step():
    config = RunConfig.of(output="out", dtype="auto", compile="auto", max_batch_rows=8)
    kept = config.with_settings(dtype="bfloat16", compile="off", long_text="truncate")
    assert (kept.model.dtype, kept.model.compile, kept.long_rows.long_text) == ("bfloat16", "off", "truncate")
    assert kept.batch is config.batch and kept.source is config.source
    assert config.model.dtype == "auto"  # frozen: the original is untouched


def test_the_record_is_flat_and_has_every_setting_once():
    config = RunConfig.of(input=("a",), output="out", max_length=64)
    record = config.to_dict()
    assert record["input"] == ("a",) and record["max_length"] == 64 and record["output"] == "out"
    assert set(record) == set(RunConfig.flat_names())
    assert "batch" not in record and "source" not in record and record["model"] is None  # `model`: --model's folder


def test_every_product_shares_the_groups_and_keeps_its_own_defaults():
    assert SweepConfig.of(vary="max-batch-tokens", values=(1,), out="x").batch.probe is False  # each level measured
    assert BatcherConfig.of().max_batch_size == BatcherConfig.default("max_batch_size") == 32
    assert BatcherConfig.of(max_batch_size=8).batch.max_batch_rows == 8
    assert BatcherConfig.of().model.thresholds is None  # not checked: every label flags at the default
    loadtest = OnlineLoadtestConfig.of(vary="max-batch-size", values=(1,), out="x", input=("in",))
    assert loadtest.source.input == ("in",) and loadtest.batcher == BatcherConfig()
    assert RunConfig.default("max_batch_tokens") is None and RunConfig.default("lock_lease_s") == 300.0
