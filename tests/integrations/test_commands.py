"""The command lines the Airflow operators run are made of `pipeline.api.run`'s keywords: the
real `lengthwise run` parses them into the RunConfig the API resolves from the same keywords,
flag by flag kind. No Airflow and no model needed."""

import pytest

from pipeline.core.errors import UsageError
from pipeline.integrations.commands import (option_arguments, run_arguments, run_exit_is_final, status_is_complete,
                                            verify_exit_is_final)
from pipeline.api import run_config_from
from tests.cli.test_options import cli_config

KEYWORDS = [
    {"input": ["in/a", "in/b"], "output": "out", "job": "moderate", "max_length": 64, "keep_columns": ["label", "lang"],
     "threshold": {"toxic": 0.8, "hate": 0.6}, "storage_option": {"anon": True, "endpoint_url": "http://127.0.0.1:1"},
     "probe": False, "dedupe": False, "progress": False, "overwrite": True, "lock_lease": "2m", "safety": 2.5,
     "num_shards": 3, "shard_index": 2, "tokenize_workers": 0, "max_batch_tokens": 4096},
    {"input": "in", "output": "out", "probe": True, "overwrite": False, "allow_pickle": False, "max_batch_rows": "auto",
     "long_text": "split", "segment_length": 32, "dtype": "float32"},
]


@pytest.mark.parametrize("keywords", KEYWORDS)
def test_the_operators_arguments_parse_to_the_apis_run_config(keywords):
    arguments = run_arguments(keywords)
    assert arguments[0] == "run"
    from_api, _, _ = run_config_from(keywords, {})
    assert cli_config(arguments[1:], {}) == from_api


def test_flags_and_repeated_options_become_the_clis_flags():
    assert option_arguments("probe", False) == ["--no-probe"]  # a flag whose default is on is negated
    assert option_arguments("overwrite", False) == []  # one that is off by default is left out
    assert option_arguments("overwrite", True) == ["--overwrite"]
    assert option_arguments("threshold", {"toxic": 0.8}) == ["--threshold", "toxic=0.8"]
    assert option_arguments("input", ["a", "b"]) == ["--input", "a", "--input", "b"]
    assert option_arguments("config", "job.toml") == ["--config", "job.toml"]
    assert option_arguments("model", None) == []


def test_an_unknown_keyword_or_a_non_bool_flag_is_a_usage_error():
    with pytest.raises(UsageError, match="no option 'max_lenght'"):
        run_arguments({"max_lenght": 3})
    with pytest.raises(UsageError, match="give True or False"):
        option_arguments("overwrite", "yes")


def test_only_a_usage_error_is_final_for_run_and_not_complete_is_final_for_verify():
    assert [code for code in (0, 1, 2, 4, 130, 143, -9) if run_exit_is_final(code)] == [2]
    assert [code for code in (0, 1, 2, 4, 143) if verify_exit_is_final(code)] == [1, 2]


def test_complete_needs_exit_0_and_every_shard_done():
    done = {"shards": 3, "done": 3, "failed": 0, "pending": 0}
    assert status_is_complete(0, done)
    assert not status_is_complete(1, {**done, "done": 2, "pending": 1})
    assert not status_is_complete(0, {**done, "shards": 0, "done": 0})  # an empty listing is not a finished night
    assert not status_is_complete(2, None)  # no run at that output yet
