"""--job moderate: thresholds per label, checked against transformers' own pipeline."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.moderate import flag_hits, resolve_thresholds
from pipeline.cli import cli
from pipeline.offline.config import RunConfig
from pipeline.core.errors import UsageError
from pipeline.engines.local import run_job
from tests.conftest import write_shards

LABELS = ("toxic", "insult", "threat")


# ── the decision, pure ───────────────────────────────────────────────────────────────────

def test_thresholds_resolve_in_label_order_with_the_default_for_the_rest():
    assert resolve_thresholds(LABELS, True, {"threat": 0.9, "toxic": 0.8}, 0.4, None) == \
        {"toxic": 0.8, "insult": 0.4, "threat": 0.9}
    assert list(resolve_thresholds(LABELS, True, {}, 0.5, ("threat", "toxic"))) == ["toxic", "threat"]


@pytest.mark.parametrize("thresholds, flag_labels, message", [
    ({"toxc": 0.8}, None, "--threshold names 'toxc', not a label of this model; the model's labels: toxic, insult, "
                          "threat"),
    ({}, ("toxic", "rude"), "--flag-labels names 'rude'"),
    ({"toxic": 1.5}, None, "toxic=1.5 is outside 0…1"),
    ({"insult": 0.3}, ("toxic",), "--threshold insult: not among --flag-labels"),
])
def test_bad_thresholds_are_usage_errors_that_name_the_labels(thresholds, flag_labels, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_thresholds(LABELS, True, thresholds, 0.5, flag_labels)


def test_a_softmax_model_must_say_which_labels_flag():
    with pytest.raises(UsageError, match="single-label .* needs --flag-labels.*labels: ok, spam, abuse"):
        resolve_thresholds(("ok", "spam", "abuse"), False, {}, 0.5, None)
    assert resolve_thresholds(("ok", "spam", "abuse"), False, {}, 0.3, ("spam", "abuse")) == {"spam": 0.3,
                                                                                          "abuse": 0.3}


def test_a_label_hits_at_or_above_its_threshold_and_only_if_it_can_flag():
    scores = np.array([[0.8, 0.2, 0.9], [0.79, 0.95, 0.1]], np.float32)
    hits = flag_hits(scores, LABELS, {"toxic": 0.8, "threat": 0.5})
    assert hits.tolist() == [[True, False, True], [False, False, False]]


# ── end to end, against transformers.pipeline("text-classification", top_k=None) ───────

def reference_scores(model_path, texts) -> np.ndarray:
    from transformers import pipeline

    classifier = pipeline("text-classification", model=model_path, top_k=None, device="cpu")
    results = classifier(texts, truncation=True, max_length=128)
    labels = list(classifier.model.config.id2label.values())
    return np.array([[{r["label"]: r["score"] for r in row}[name] for name in labels] for row in results])


def between_two_scores(values: np.ndarray, quantile: float) -> float:
    """A threshold halfway between two neighbouring scores, so float noise cannot flip a row."""
    ordered = np.sort(values)
    k = int(len(ordered) * quantile)
    return float((ordered[k] + ordered[k + 1]) / 2)


def moderate(tmp_path, table, name="out", **settings):
    settings.setdefault("long_text", "truncate")  # as the transformers pipeline compared with (tests/offline/test_long_text.py)
    if not (tmp_path / "in").exists():
        write_shards(tmp_path / "in", table, [table.num_rows // 2, table.num_rows - table.num_rows // 2])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / name), progress=False, dtype="float32",
                          tokenize_workers=0, job="moderate", max_length=128, **settings)
    summary = run_job(config)
    output = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / name).glob("*.parquet")))
    return output, json.loads(summary.to_json())


@pytest.fixture(scope="module")
def rows(sample_table):
    texts = sample_table["text"].to_pylist()[:80]
    texts[5] = None
    texts[41] = "  "
    return pa.table({"id": sample_table["id"].to_pylist()[:80], "text": pa.array(texts, pa.string())})


@pytest.mark.slow
def test_moderate_matches_the_transformers_pipeline_with_thresholds_applied_by_hand(tmp_path, rows,
                                                                                    tiny_multilabel_path):
    good = [i for i, text in enumerate(rows["text"].to_pylist()) if text and text.strip()]
    expected = reference_scores(tiny_multilabel_path, [rows["text"][i].as_py() for i in good])
    thresholds = {"toxic": between_two_scores(expected[:, 0], 0.5), "threat": between_two_scores(expected[:, 2], 0.8)}
    insult_default = between_two_scores(expected[:, 1], 0.3)
    output, summary = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds=thresholds,
                               default_threshold=insult_default)

    assert output.schema.field("scores").type == pa.struct([(name, pa.float32()) for name in LABELS])
    assert output.schema.field("flagged_labels").type == pa.list_(pa.string())
    assert output.column_names == ["id", "flagged", "flagged_labels", "scores", "truncated", "error"]
    assert output["id"].to_pylist() == rows["id"].to_pylist()
    cut = {"toxic": thresholds["toxic"], "insult": insult_default, "threat": thresholds["threat"]}
    flagged_by_hand = []
    for position, row_index in enumerate(good):
        row = output.slice(row_index, 1).to_pylist()[0]
        assert [row["scores"][name] for name in LABELS] == pytest.approx(expected[position], abs=1e-5)
        by_hand = [name for name, score in zip(LABELS, expected[position]) if score >= cut[name]]
        assert row["flagged_labels"] == by_hand
        assert row["flagged"] is bool(by_hand)
        flagged_by_hand.append(by_hand)
    for row_index in (5, 41):  # errors are neither flagged nor clean
        row = output.slice(row_index, 1).to_pylist()[0]
        assert row["error"] and row["flagged"] is None and row["flagged_labels"] is None and row["scores"] is None
    assert 0 < sum(map(bool, flagged_by_hand)) < len(good)
    assert summary["flagged_rows"] == sum(map(bool, flagged_by_hand))
    assert summary["flagged_by_label"] == {name: sum(name in f for f in flagged_by_hand) for name in LABELS}
    assert list(summary["flagged_by_label"]) == list(LABELS)


@pytest.mark.slow
def test_a_softmax_model_flags_only_its_flag_labels(tmp_path, rows, tiny_classifier_path):
    good = [i for i, text in enumerate(rows["text"].to_pylist()) if text and text.strip()]
    expected = reference_scores(tiny_classifier_path, [rows["text"][i].as_py() for i in good])
    spam = between_two_scores(expected[:, 1], 0.5)
    output, summary = moderate(tmp_path, rows, model=tiny_classifier_path, flag_labels=("spam", "abuse"),
                               thresholds={"spam": spam}, default_threshold=0.0)
    labels = output["flagged_labels"].to_pylist()
    for position, row_index in enumerate(good):
        assert labels[row_index] == ["spam"] * bool(expected[position, 1] >= spam) + ["abuse"]
    assert summary["flagged_rows"] == len(good)
    assert summary["flagged_by_label"] == {"spam": int((expected[:, 1] >= spam).sum()), "abuse": len(good)}


@pytest.mark.slow
def test_other_thresholds_are_refused_on_the_same_output_unless_overwrite(tmp_path, rows, tiny_multilabel_path):
    first, _ = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 0.2})
    recorded = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())
    assert recorded["fingerprint"]["thresholds"] == {"toxic": 0.2, "insult": 0.5, "threat": 0.5}
    _, resumed = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 0.2})
    assert resumed["shards_done_before"] == 2 and resumed["rows"] == 0
    assert resumed["flagged_rows"] is None  # nothing written by this run, nothing counted
    with pytest.raises(UsageError, match=r"thresholds: \{'toxic': 0.2, .*\} → \{'toxic': 1.0, .*--overwrite"):
        moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 1.0})
    redone, summary = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 1.0},
                               overwrite=True)
    assert summary["flagged_by_label"]["toxic"] == 0
    assert first["scores"].to_pylist() == redone["scores"].to_pylist()


@pytest.mark.slow
def test_the_cli_takes_thresholds_from_flags_and_a_toml_table(tmp_path, rows, tiny_multilabel_path):
    write_shards(tmp_path / "in", rows, [rows.num_rows])
    (tmp_path / "job.toml").write_text(f'input = "{tmp_path / "in"}"\njob = "moderate"\nmodel = '
                                       f'"{tiny_multilabel_path}"\nmax_length = 128\ntokenize_workers = 0\n'
                                       f'dtype = "float32"\nprogress = false\nflag_labels = ["toxic", "threat"]\n'
                                       f'[thresholds]\ntoxic = 0.0\nthreat = 1.0\n')
    runner = CliRunner()
    result = runner.invoke(cli, ["run", "--config", str(tmp_path / "job.toml"), "--output", str(tmp_path / "a"),
                                 "--summary-json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert "flagged         78 of 80 rows this run (toxic 78, threat 0)" in result.output
    assert json.loads((tmp_path / "a.json").read_text())["flagged_by_label"] == {"toxic": 78, "threat": 0}
    flag_overrides = runner.invoke(cli, ["run", "--config", str(tmp_path / "job.toml"), "--output",
                                         str(tmp_path / "b"), "--threshold", "toxic=1", "--threshold", "threat=0"])
    assert "flagged         78 of 80 rows this run (toxic 0, threat 78)" in flag_overrides.output

    unknown = runner.invoke(cli, ["run", "--config", str(tmp_path / "job.toml"), "--output", str(tmp_path / "c"),
                                  "--threshold", "hate=0.5"])
    assert unknown.exit_code == 2
    assert "'hate', not a label of this model; the model's labels: toxic, insult, threat" in unknown.output
    malformed = runner.invoke(cli, ["run", "--config", str(tmp_path / "job.toml"), "--output", str(tmp_path / "c"),
                                    "--threshold", "toxic"])
    assert malformed.exit_code == 2 and "'toxic' is not LABEL=SCORE" in malformed.output
    embed = runner.invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "d"),
                                "--threshold", "toxic=0.5"])
    assert embed.exit_code == 2 and "--threshold and --flag-labels are for --job moderate" in embed.output
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*.parquet"))


@pytest.mark.slow
def test_the_summary_of_a_resume_and_of_a_retry_describe_the_whole_output(tmp_path, rows, tiny_multilabel_path):
    """A resume counts the night's rows, not only its own share; a retry of a finished output
    says there was nothing to do and keeps the totals (an Airflow retry must not blank them)."""
    from pipeline.offline.manifest import run_status

    _, first = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 0.5})
    markers = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out" / ".lengthwise" / "shards").iterdir()}
    assert sorted(markers) == ["part-00000.json", "part-00001.json"]
    assert [m["rows"] for m in markers.values()] == [40, 40] and sum(m["error_rows"] for m in markers.values()) == 2
    assert sum(m["flagged_rows"] for m in markers.values()) == first["flagged_rows"]
    whole = {"shards_done": 2, "rows": 80, "error_rows": 2, "truncated_rows": first["truncated_rows"],
             "split_rows": 0, "segments": 0, "truncated_unflagged_rows": first["truncated_unflagged_rows"],
             "error_reasons": first["error_reasons"], "flagged_rows": first["flagged_rows"],
             "flagged_by_label": first["flagged_by_label"]}
    assert first["output_totals"] == whole

    (tmp_path / "out" / ".lengthwise" / "shards" / "part-00001.json").unlink()  # as an interrupt leaves it
    (tmp_path / "out" / "part-00001.parquet").unlink()
    _, resumed = moderate(tmp_path, rows, model=tiny_multilabel_path, thresholds={"toxic": 0.5})
    assert resumed["rows"] == 40 and resumed["shards_done_before"] == 1
    assert resumed["flagged_rows"] == markers["part-00001.json"]["flagged_rows"]
    assert resumed["output_totals"] == whole

    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), progress=False, dtype="float32",
                          tokenize_workers=0, job="moderate", max_length=128, thresholds={"toxic": 0.5},
                          model=tiny_multilabel_path)
    retry = run_job(config)
    assert retry.nothing_to_do and retry.rows == 0 and retry.output_totals == whole
    text = retry.to_text()
    assert text.splitlines()[0] == "nothing to do: 2 of 2 shards done"
    assert f"output total    80 rows in 2 done shard(s) (2 with errors, {whole['truncated_rows']} truncated)" in text
    labels = ", ".join(f"{label} {rows}" for label, rows in whole["flagged_by_label"].items())
    assert f"flagged total   {whole['flagged_rows']} of 80 rows ({labels})" in text
    assert "stages" not in text and "device busy" not in text and "resumed" not in text
    assert run_status(str(tmp_path / "out"), {})["totals"] == whole


@pytest.mark.slow
def test_the_head_script_trains_on_a_slice_and_writes_its_report_beside_the_model(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "train_tweet_moderation_head.py"
    rows = [{"id": f"tweets/{split}/{i}", "text": f"tweet number {i} of {split}", "task": ("offensive", "hate")[i % 2],
             "label": ("offensive", "hate", "none")[i % 3]} for split in ("train", "test") for i in range(30)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "shard-00000.parquet")
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                            timeout=120)
    for help_text in ("TweetEval Parquet shards", "model folder to write", "accuracy report", "first ROWS rows",
                      "Tokens per tweet", "Adam steps"):  # --data, --out, --report, --rows, --max-length, --steps
        assert help_text in " ".join(helped.stdout.split()), help_text
    done = subprocess.run([sys.executable, str(script), "--data", str(tmp_path / "data"), "--out",
                           str(tmp_path / "head"), "--rows", "10", "--steps", "3", "--max-length", "16"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "head" / "training_report.json").read_text())
    assert report["train_rows"] == 10 and report["test_rows"] == 10 and report["steps"] == 3
    assert (tmp_path / "head" / "model.safetensors").exists()
    assert not (root / "benchmarks" / "results" / "tweet_moderation_head.json").exists()
