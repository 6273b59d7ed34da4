"""Several models in one pass (docs/jobs.md "Several models, one pass"): the output equals the models'
separate runs cell for cell, per input shard, keyed by row id; resume, --reuse and verify hold; bad
configurations are refused before anything is written."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.model_set import flagged_by
from pipeline.core import values
from pipeline.core.errors import UsageError
from pipeline.offline.model_set import model_tables
from pipeline.offline.options import RUN_OPTIONS
from tests.conftest import MODEL_SET_SETTINGS as SHARED
from tests.conftest import (kill_when_written, resume_after_a_kill_between_shards, run_in_this_process, three_models,
                            write_shards)



def read_output(folder) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in sorted(folder.glob("*.parquet")))


# --- pure parts ---------------------------------------------------------------------------------------------

def test_flagged_by_lists_model_then_label_order_and_is_null_without_a_result():
    toxicity = pa.array([["toxic", "insult"], [], ["threat"], None], pa.list_(pa.string()))
    spam = pa.array([["spam"], ["spam"], [], None], pa.list_(pa.string()))
    valid = np.array([True, True, True, False])
    assert flagged_by({"toxicity": toxicity, "spam": spam}, valid).to_pylist() == [
        ["toxicity:toxic", "toxicity:insult", "spam:spam"], ["spam:spam"], ["toxicity:threat"], None]
    assert flagged_by({}, np.array([True, False])).to_pylist() == [[], None]


def test_model_tables_come_as_toml_a_dict_or_the_inline_flag_form():
    kind = values.ModelTables()
    text = 'toxicity = {job = "moderate", thresholds = {toxic = 0.8}}, embed = {job = "embed"}'
    assert kind.parse(text) == {"toxicity": {"job": "moderate", "thresholds": {"toxic": 0.8}},
                                "embed": {"job": "embed"}}
    assert kind.parse({"embed": {"job": "embed"}}) == {"embed": {"job": "embed"}}
    for bad, says in (({"tox.v2": {}}, "may not be empty or hold '.'"), ({"a": 3}, "takes a table"),
                      ("toxicity = ", "inline-table form"), ({"a:b": {}}, "':'")):
        with pytest.raises(ValueError, match=says):
            kind.parse(bad)


def test_a_model_table_is_checked_as_the_flags_are_and_names_its_model():
    tables = model_tables({"tox": {"job": "moderate", "max_length": 64, "flag_labels": "toxic,insult",
                                   "thresholds": {"toxic": 1}, "model": "default"}}, RUN_OPTIONS)
    assert tables == {"tox": {"job": "moderate", "max_length": 64, "flag_labels": ("toxic", "insult"),
                              "thresholds": {"toxic": 1.0}, "model": None}}
    for table, says in (({"job": "sentiment"}, "models.m: unknown job 'sentiment'"),
                        ({"batch": 3}, r"models.m: unknown key\(s\) batch"),
                        ({"max_length": 0}, "models.m.max_length"),
                        ({"thresholds": {"toxic": "high"}}, "models.m.thresholds"),
                        ({"job": "pair"}, "models.m: job pair is not yet supported")):
        with pytest.raises(UsageError, match=says):
            model_tables({"m": table}, RUN_OPTIONS)


# --- bad configurations: one line, exit 2, nothing written --------------------------------------------------

@pytest.mark.parametrize("toml, flags, says", [
    ('[models.a]\njob = "summarize"\n', [], "models.a: unknown job 'summarize'"),
    ('[models.a]\njob = "embed"\n[models.a]\njob = "classify"\n', [], "Cannot declare"),
    ('[models.a]\njob = "embed"\n', ["--model", "default"], "--model and a [models] table both set it"),
    ('[models."a.b"]\njob = "embed"\n', [], "may not be empty or hold '.'"),
    ('[models.a]\njob = "moderate"\n[models.b]\njob = "embed"\n', [], "treats long rows differently for a (split), b "
                                                                     "(truncate)"),
    ('[models.a]\njob = "embed"\n[models.b]\njob = "embed"\nmax_length = 16\n', ["--max-length", "32"],
     "models a (32) and b (16) take different --max-length"),
    ('[models.a]\njob = "embed"\n[models.b]\njob = "embed"\nprompt = "query: "\n', ["--dtype", "float32"],
     "models a and b tokenize differently (prompt)"),
])
def test_a_bad_models_config_is_one_line_exit_2_and_writes_nothing(tmp_path, sample_table, toml, flags, says):
    from pipeline.cli import cli

    write_shards(tmp_path / "in", sample_table.slice(0, 20), [20])
    (tmp_path / "job.toml").write_text(toml)
    result = CliRunner().invoke(cli, ["run", "--config", str(tmp_path / "job.toml"), "--input", str(tmp_path / "in"),
                                       "--output", str(tmp_path / "out"), "--tokenize-workers", "0", *flags])
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output
    assert len([line for line in result.output.splitlines() if line.lower().startswith('error')]) == 1, result.output
    assert not (tmp_path / "out").exists()


# --- one pass equals the separate runs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def separate_and_together(tmp_path_factory, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    from pipeline.api import run

    folder = tmp_path_factory.mktemp("models")
    write_shards(folder / "in", model_set_rows, [100, 140])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    separate = {}
    for name, table in models.items():
        settings = {key: value for key, value in table.items() if key != "thresholds"}
        threshold = {"threshold": table["thresholds"]} if "thresholds" in table else {}
        separate[name] = run(str(folder / "in"), str(folder / name), keep_columns=["lang"], **settings, **threshold,
                             **SHARED)
    together = run(str(folder / "in"), str(folder / "together"), keep_columns=["lang"], models=models,
                   summary_json=str(folder / "together" / ".summary.json"), **SHARED)
    return folder, separate, together


@pytest.mark.slow
def test_one_pass_of_three_models_equals_their_separate_runs_cell_for_cell(separate_and_together):
    folder, separate, together = separate_and_together
    for index in range(2):  # one file per input shard, rows in input order
        shard = f"part-{index:05d}.parquet"
        ours = pq.read_table(folder / "together" / shard)
        head = ["id", "lang"]
        tail = ["segments", "truncated", "error"]
        expected_columns = [*head]
        for name in ("toxicity", "topic", "embed"):
            theirs = pq.read_table(folder / name / shard)
            own = [c for c in theirs.column_names if c not in (*head, *tail, "flag_spans")]
            expected_columns += [f"{name}.{c}" for c in own]
            for column in own + (["flag_spans"] if "flag_spans" in theirs.column_names else []):
                assert ours[f"{name}.{column}"].to_pylist() == theirs[column].to_pylist(), (name, column)
                assert ours.schema.field(f"{name}.{column}").type == theirs.schema.field(column).type
            for column in (*head, *tail):
                assert ours[column].to_pylist() == theirs[column].to_pylist(), (name, column)
        assert ours.column_names == [*expected_columns, "flagged_by", "toxicity.flag_spans", *tail]
        labels = ours["toxicity.flagged_labels"].to_pylist()
        assert ours["flagged_by"].to_pylist() == [None if row is None else [f"toxicity:{label}" for label in row]
                                                  for row in labels]
    flagged = separate["toxicity"]["flagged_by_label"]
    assert sum(flagged.values()) > 0, "the thresholds should flag some rows, so that flagged_by is tested"
    assert together["models"]["toxicity"]["flagged_rows"] == separate["toxicity"]["flagged_rows"]
    assert together["models"]["toxicity"]["flagged_by_label"] == flagged
    for name in ("toxicity", "topic", "embed"):
        assert together["models"][name]["computed_rows"] == separate[name]["computed_rows"] == 240
        assert together["models"][name]["reused_rows"] == 0
    assert together["split_rows"] == separate["embed"]["split_rows"] > 0
    assert together["deduplicated_rows"] == separate["embed"]["deduplicated_rows"] > 0
    run_json = json.loads((folder / "together" / ".lengthwise" / "run.json").read_text())
    assert list(run_json["fingerprint"]["models"]) == ["toxicity", "topic", "embed"]
    assert run_json["fingerprint"]["models"]["toxicity"]["thresholds"] == {"toxic": 0.5, "insult": 0.45,
                                                                          "threat": 0.5}


@pytest.mark.slow
def test_verify_and_a_rerun_accept_an_output_of_several_models(separate_and_together, tiny_multilabel_path,
                                                               tiny_classifier_path, tiny_encoder_path):
    from pipeline.api import run
    from pipeline.offline.verify import verify_output

    folder, _, _ = separate_and_together
    from pipeline.offline.manifest import run_status

    report = verify_output(None, str(folder / "together"))
    assert report.complete, report.to_text()
    assert report.models == {"toxicity": {"columns": ["toxicity.flag_spans", "toxicity.flagged",
                                                      "toxicity.flagged_labels", "toxicity.scores"], "shards": 2},
                             "topic": {"columns": ["topic.label", "topic.score", "topic.scores"], "shards": 2},
                             "embed": {"columns": ["embed.embedding"], "shards": 2}}
    status = run_status(str(folder / "together"), {})
    assert status["models"]["topic"] == {"job": "classify", "model": tiny_classifier_path, "shards_done": 2,
                                         "rows_done": 240}
    assert list(status["models"]) == ["toxicity", "topic", "embed"]
    # a shard without a model's columns (rewritten by hand) is a problem verify names
    shard = folder / "together" / "part-00001.parquet"
    original = shard.read_bytes()
    try:
        pq.write_table(pq.read_table(shard).drop_columns(["embed.embedding"]), shard)
        broken = verify_output(None, str(folder / "together"))
        assert not broken.complete
        assert any("has no column embed.embedding of model embed" in problem
                   for check in broken.shards for problem in check.problems), broken.to_text()
    finally:
        shard.write_bytes(original)
    again = run(str(folder / "in"), str(folder / "together"), keep_columns=["lang"],
                models=three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path), **SHARED)
    assert again["nothing_to_do"]
    with pytest.raises(UsageError, match="other settings"):  # a run-wide setting (a model's: test_adding_changing…)
        run(str(folder / "in"), str(folder / "together"), models=three_models(tiny_multilabel_path,
                                                                              tiny_classifier_path, tiny_encoder_path),
            **SHARED)


@pytest.mark.slow
def test_reuse_with_several_models_copies_unchanged_rows_and_equals_a_fresh_run(
        separate_and_together, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    from pipeline.api import run

    folder, _, _ = separate_and_together
    texts = model_set_rows["text"].to_pylist()
    texts[3] = "an edited post, new today"
    today = model_set_rows.set_column(1, "text", pa.array(texts, pa.string()))
    write_shards(folder / "today", today, [100, 140])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    reused = run(str(folder / "today"), str(folder / "reused"), keep_columns=["lang"], models=models,
                 reuse=str(folder / "together"), **SHARED)
    fresh = run(str(folder / "today"), str(folder / "fresh"), keep_columns=["lang"], models=models, **SHARED)
    assert read_output(folder / "reused").equals(read_output(folder / "fresh"))
    assert reused["reused_rows"] + reused["computed_rows"] == 240 and 1 <= reused["computed_rows"] <= 3  # the edited
    # row, and the rows with errors (retried)
    for name in models:
        assert reused["models"][name]["reused_rows"] == reused["reused_rows"]
        assert reused["models"][name]["computed_rows"] == reused["computed_rows"]
    assert fresh["models"]["embed"]["computed_rows"] == 240


@pytest.mark.slow
def test_a_run_of_several_models_killed_after_a_shard_resumes_to_an_uninterrupted_ones_output(
        tmp_path, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    write_shards(tmp_path / "in", model_set_rows, [80, 80, 80])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    def inline_table(table: dict) -> str:
        keys = [f"{key} = {json.dumps(value)}" for key, value in table.items() if key != "thresholds"]
        if "thresholds" in table:
            keys.append("thresholds = {toxic = 0.5, insult = 0.45}")
        return "{" + ", ".join(keys) + "}"

    inline = ", ".join(f"{name} = {inline_table(table)}" for name, table in models.items())
    command = [sys.executable, "-m", "pipeline.cli", "run", "--input", str(tmp_path / "in"), "--models", inline,
               "--max-length", "32", "--long-text", "split", "--dtype", "float32", "--compile", "off",
               "--tokenize-workers", "0", "--no-probe", "--no-progress", "--max-batch-rows", "2",
               "--window-rows", "40"]
    resume_after_a_kill_between_shards(command, tmp_path / "out", tmp_path / "whole", 3)
    ours = read_output(tmp_path / "out")
    assert ours.num_rows == 240 and len(set(ours["id"].to_pylist())) == 240
    assert ours.equals(read_output(tmp_path / "whole"))


@pytest.mark.slow
def test_a_model_with_an_unpadded_forward_beside_a_padded_one_equals_its_separate_run(tmp_path, model_set_rows,
                                                                                    tiny_classifier_path, tiny_encoder_path):
    """One model's unpadded forward makes the host pack every batch's layout (`ModelSet.unpadded`); the padded
    model beside it ignores it."""
    from pipeline.api import run

    write_shards(tmp_path / "in", model_set_rows, [240])
    settings = {**SHARED, "long_text": "truncate"}
    models = {"embed": {"job": "embed", "model": tiny_encoder_path, "unpad": "on"},
              "topic": {"job": "classify", "model": tiny_classifier_path, "unpad": "off"}}
    together = run(str(tmp_path / "in"), str(tmp_path / "together"), models=models, **settings)
    assert together["models"]["embed"]["computed_rows"] == 240
    ours = read_output(tmp_path / "together")
    for name, table in models.items():
        run(str(tmp_path / "in"), str(tmp_path / name), **table, **settings)
        theirs = read_output(tmp_path / name)
        for column in [c for c in theirs.column_names if c not in ("id", "truncated", "error")]:
            assert ours[f"{name}.{column}"].to_pylist() == theirs[column].to_pylist(), (name, column)
    assert "unpadded" in together["unpad"] and "padded" in together["unpad"]


def test_models_come_from_the_environment_as_from_the_flag():
    from pipeline.api import run_config_from

    config, _, _ = run_config_from({"input": "in", "output": "out", "dtype": "float32"},
                                   {"LENGTHWISE_MODELS": 'tox = {job = "moderate", thresholds = {toxic = 0.7}}, '
                                                         'e = {job = "embed", dtype = "bfloat16"}'})
    assert config.models == {"tox": {"job": "moderate", "thresholds": {"toxic": 0.7}},
                             "e": {"job": "embed", "dtype": "bfloat16"}}
    from pipeline.offline.model_set import model_configs

    configs = model_configs(config.with_settings(long_text="split"))
    assert [configs[name].model.job for name in ("tox", "e")] == ["moderate", "embed"]
    assert configs["tox"].model.dtype == "float32" and configs["e"].model.dtype == "bfloat16"  # the run's, or its own
    assert configs["tox"].model.thresholds == {"toxic": 0.7} and configs["e"].models == {}


def test_a_resume_keeps_each_models_recorded_dtype_and_compile_where_they_are_auto():
    from pipeline.offline.config import RunConfig
    from pipeline.offline.model_set import keep_recorded_model_choices

    config = RunConfig.of(output="out", long_text="auto",
                          models={"a": {"job": "moderate"}, "b": {"job": "moderate", "dtype": "float32"}})
    fingerprint = {"models": {"a": {"dtype": "bfloat16", "long_text": "split"}, "b": {"dtype": "bfloat16"}}}
    kept = keep_recorded_model_choices(config, fingerprint, {"models": {"a": {"compile": "on"}}})
    assert kept.models == {"a": {"job": "moderate", "dtype": "bfloat16", "compile": "on"},
                           "b": {"job": "moderate", "dtype": "float32"}}  # b's dtype was given: a change is refused
    assert kept.long_rows.long_text == "split"


# --- a change of models: only the added and changed models run ----------------------------------------------

def test_a_change_of_models_keeps_the_models_as_recorded_and_the_run_wide_settings():
    from pipeline.offline.model_set import model_change

    def model(job, **more):
        return {"job": job, "model": job, "max_length": 32, "id_column": "id", "text_column": "text", **more}

    before = {"models": {"a": model("moderate"), "b": model("embed")}, "model_order": ["a", "b"]}
    recorded = {"fingerprint": before}
    added = {"models": {**before["models"], "c": model("classify")}, "model_order": ["a", "b", "c"]}
    change = model_change(recorded, added)
    assert (change.kept, change.computed, change.dropped) == (("a", "b"), ("c",), ())
    assert change.source == before
    changed = {"models": {"a": model("moderate", thresholds={"toxic": 0.9}), "b": model("embed")}}
    assert (model_change(recorded, changed).kept, model_change(recorded, changed).computed) == (("b",), ("a",))
    removed = {"models": {"b": model("embed")}}
    assert (model_change(recorded, removed).computed, model_change(recorded, removed).dropped) == ((), ("a",))
    # resumed after a kill: run.json holds the new fingerprint and where its kept columns come from
    assert model_change({"fingerprint": added, "carried_from": before}, added) == change
    assert model_change(recorded, before) is None  # no change
    assert model_change(recorded, {"models": {"c": model("classify")}}) is None  # no model kept
    longer = {"models": {name: {**each, "max_length": 64} for name, each in added["models"].items()}}
    assert model_change(recorded, longer) is None  # a run-wide setting: refused as any change of settings
    assert model_change({"fingerprint": {"job": "embed"}}, added) is None  # a one-model output


class ForwardRows:
    """The rows each model of a run of several is run on (segments count as rows), read off the real
    forward as it runs."""

    def __init__(self, monkeypatch):
        from jobs.model_set import ModelSetJob

        self.rows: dict[str, int] = {}
        forward = ModelSetJob.forward

        def counted(job, model, input_ids, *args, models=None, **kwargs):
            for name in (models if models is not None else job.jobs):
                self.rows[name] = self.rows.get(name, 0) + int(input_ids.shape[0])
            return forward(job, model, input_ids, *args, models=models, **kwargs)

        monkeypatch.setattr(ModelSetJob, "forward", counted)

    def take(self) -> dict[str, int]:
        rows, self.rows = self.rows, {}
        return rows


@pytest.fixture
def forward_rows(monkeypatch) -> ForwardRows:
    return ForwardRows(monkeypatch)


def assert_same_output(ours, theirs) -> None:
    a, b = read_output(ours), read_output(theirs)
    assert a.column_names == b.column_names
    for column in a.column_names:
        assert a[column].to_pylist() == b[column].to_pylist(), column
    assert a.schema == b.schema


@pytest.mark.slow
def test_adding_changing_and_removing_a_model_computes_only_what_changed(
        tmp_path, model_set_rows, forward_rows, separate_and_together, tiny_multilabel_path, tiny_classifier_path,
        tiny_encoder_path):
    from pipeline.api import run
    from pipeline.offline.verify import verify_output

    write_shards(tmp_path / "in", model_set_rows, [100, 140])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    two = {name: models[name] for name in ("toxicity", "topic")}

    def into(output: str, chosen: dict) -> dict:
        return run(str(tmp_path / "in"), str(tmp_path / output), keep_columns=["lang"], models=chosen, **SHARED)

    into("out", two)
    full = forward_rows.take()  # what each model runs on over these rows
    assert set(full) == {"toxicity", "topic"} and full["toxicity"] > 240  # the rows that run, and their segments
    folder, _, fresh = separate_and_together  # a fresh run of the three models over the same shards

    added = into("out", models)  # the rerun into the same output: only embed runs, on the rows toxicity ran on
    assert forward_rows.take() == {"embed": full["toxicity"]}
    assert_same_output(tmp_path / "out", folder / "together")
    assert added["models"]["embed"]["computed_rows"] == 240 and added["models"]["embed"]["reused_rows"] == 0
    for name in ("toxicity", "topic"):
        entry = added["models"][name]
        assert entry["reused_rows"] == added["reuse"]["carried"] >= 238 and entry["computed_rows"] + \
            entry["reused_rows"] == 240  # the rows without a text are not carried: they have an error all the same
    assert added["models"]["toxicity"]["flagged_rows"] == fresh["models"]["toxicity"]["flagged_rows"]
    assert added["reuse"]["new"] == 0 and verify_output(None, str(tmp_path / "out")).complete
    assert into("out", models)["nothing_to_do"]

    changed = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    changed["toxicity"]["thresholds"] = {"toxic": 0.3}
    recomputed = into("out", changed)  # toxicity alone runs again
    assert forward_rows.take() == {"toxicity": full["toxicity"]}
    into("fresh-changed", changed)
    forward_rows.take()
    assert_same_output(tmp_path / "out", tmp_path / "fresh-changed")
    assert recomputed["models"]["toxicity"]["computed_rows"] == 240
    assert recomputed["models"]["embed"]["computed_rows"] < 3

    fewer = {name: changed[name] for name in ("toxicity", "embed")}
    removed = into("out", fewer)  # topic's columns dropped, no model runs
    assert forward_rows.take() == {}
    into("fresh-fewer", fewer)
    assert_same_output(tmp_path / "out", tmp_path / "fresh-fewer")
    assert not any(name.startswith("topic.") for name in read_output(tmp_path / "out").column_names)
    assert removed["models"]["embed"]["reused_rows"] >= 238 and set(removed["models"]) == {"toxicity", "embed"}


@pytest.mark.slow
def test_a_change_of_models_is_refused_with_other_run_wide_settings_or_with_reuse(
        tmp_path, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    from pipeline.api import run

    write_shards(tmp_path / "in", model_set_rows.slice(0, 40), [40])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    two = {name: models[name] for name in ("toxicity", "topic")}
    run(str(tmp_path / "in"), str(tmp_path / "out"), models=two, **SHARED)
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(UsageError, match="other settings"):  # a run-wide setting changed too
        run(str(tmp_path / "in"), str(tmp_path / "out"), models=models, keep_columns=["lang"], **SHARED)
    run(str(tmp_path / "in"), str(tmp_path / "prev"), models=models, **SHARED)
    with pytest.raises(UsageError, match="--reuse with a change of models"):
        run(str(tmp_path / "in"), str(tmp_path / "out"), models=models, reuse=str(tmp_path / "prev"), **SHARED)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


@pytest.mark.slow
def test_a_change_of_models_killed_mid_way_resumes_to_a_fresh_runs_output(
        tmp_path, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    write_shards(tmp_path / "in", model_set_rows, [80, 80, 80])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    base = [sys.executable, "-m", "pipeline.cli", "run", "--input", str(tmp_path / "in"), "--max-length", "32",
            "--long-text", "split", "--dtype", "float32", "--compile", "off", "--tokenize-workers", "0",
            "--no-probe", "--no-progress", "--max-batch-rows", "2", "--window-rows", "40"]

    def command(names, output):
        inline = ", ".join(f"{name} = {{job = {json.dumps(models[name]['job'])}, model = "
                           f"{json.dumps(models[name]['model'])}}}" for name in names)
        return [*base, "--models", inline, "--output", str(tmp_path / output)]

    run_in_this_process(command(["toxicity", "topic"], "out"))
    before = {path.name: path.read_bytes() for path in (tmp_path / "out").glob("*.parquet")}
    # killed as the second shard's new file is written: the first is committed with every model, the others not
    kill_when_written(command(list(models), "out"), tmp_path / "out", ".part-00001.parquet.*.tmp", 300)
    after = {path.name: path.read_bytes() for path in (tmp_path / "out").glob("*.parquet")}
    assert sorted(after) == sorted(before) and after["part-00002.parquet"] == before["part-00002.parquet"]
    assert after["part-00000.parquet"] != before["part-00000.parquet"]  # rewritten whole, committed by rename
    from pipeline.offline.manifest import run_status

    status = run_status(str(tmp_path / "out"), {})
    assert (status["done"], status["pending"]) == (1, 2) and status["models"]["embed"]["shards_done"] == 1
    printed = run_in_this_process([*command(list(models), "out"), "--summary-json", str(tmp_path / "summary.json")])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "carried         160 rows' columns of the kept models from the output's earlier shards" in printed
    assert "model embed     embed: 160 rows computed, 0 reused" in printed
    assert summary["shards_done_before"] == 1 and summary["models"]["embed"]["computed_rows"] == 160
    assert summary["models"]["topic"]["reused_rows"] >= 158
    run_in_this_process(command(list(models), "whole"))
    ours = read_output(tmp_path / "out")
    assert ours.num_rows == 240 and len(set(ours["id"].to_pylist())) == 240
    assert_same_output(tmp_path / "out", tmp_path / "whole")


# --- the one opener of a run's models ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_runs_models_open_with_their_one_tokenizer_each_as_its_own_run_opens_it(tmp_path, model_set_rows,
                                                                                    tiny_classifier_path,
                                                                                    tiny_encoder_path, monkeypatch):
    """`plan`, its estimate and the shard runner open a run's models in one place (`open_models`): the tokenizer
    is loaded once per model to check they tokenize alike, and not again while they open; each model settles
    what a one-model `open_runtime` of its config settles; the one runtime holds them all."""
    import pipeline.runtime.model
    from pipeline.offline.config import RunConfig
    from pipeline.offline.model_set_setup import open_models
    from pipeline.runtime import open_runtime

    write_shards(tmp_path / "in", model_set_rows.slice(0, 40), [25, 15])
    models = {"topic": {"job": "classify", "model": tiny_classifier_path},
              "embed": {"job": "embed", "model": tiny_encoder_path}}
    config = RunConfig.of(input=(str(tmp_path / "in"),), output="", models=models, max_length=32, dtype="float32",
                          compile="off", probe=False, plan_cache=str(tmp_path / "cache"))
    loads, real_load = [], pipeline.runtime.model.load_tokenizer_spec
    monkeypatch.setattr(pipeline.runtime.model, "load_tokenizer_spec",
                        lambda path, *args, **kwargs: loads.append(path) or real_load(path, *args, **kwargs))
    opened = open_models(config)
    assert loads == [tiny_classifier_path, tiny_encoder_path]
    assert all(each.loaded.tokenizer is opened.choice.tokenizer for each in opened.runtimes.values())
    assert opened.runtime.members == opened.runtimes and list(opened.runtimes) == ["topic", "embed"]
    assert [shard.num_rows for shard in opened.runtime.input.shards] == [25, 15]  # the config's whole input
    assert opened.config.models["topic"]["compile"] == "off"  # as run.json records it
    for name, runtime in opened.runtimes.items():
        alone = open_runtime(opened.configs[name])
        assert (runtime.batch, runtime.max_length, runtime.loaded.choice.dtype) == \
            (alone.batch, alone.max_length, alone.loaded.choice.dtype)
        assert opened.settled()[name]["model"] == alone.loaded.choice.path
    assert set(opened.clocks["embed"].steps) == {"model load", "compile decision", "batch plan"}
