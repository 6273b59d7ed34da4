"""--long-text split: a row longer than --max-length is cut into segments, each scored as a row
of its own, and folded back into one output row (maximum per label, token-weighted mean)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from pipeline.core.errors import UsageError
from pipeline.core.segments import (
    MAX_SEGMENTS_PER_ROW,
    max_per_group,
    segment_cut,
    segment_groups,
    weighted_mean_per_group,
)
from pipeline.core.settings import long_text_mode, segment_length_of
from pipeline.offline.config import RunConfig
from tests.conftest import run_one_huge_row
from pipeline.core.tokenize import encode_texts, load_tokenizer_spec
from pipeline.offline.diagnosis import diagnose_run
from pipeline.offline.summary import RunSummary
from tests.conftest import write_shards

BENIGN = "The committee met on Tuesday to review the budget for the coming year. "
HIDDEN = "You are a worthless idiot and everyone here hates you."
RUN_ON = ("and then the river kept on running past the old mill while the children counted the boats "
          "that drifted by under the bridge ") * 4  # one sentence far longer than a segment


# ── the cut, pure ─────────────────────────────────────────────────────────────────────────

def word_tokens(text: str) -> tuple[list, list]:
    """One token per whitespace word: (character spans, word ids)."""
    spans, position = [], 0
    for word in text.split():
        start = text.index(word, position)
        spans.append((start, start + len(word)))
        position = start + len(word)
    return spans, list(range(len(spans)))


def test_a_segment_ends_at_the_last_sentence_boundary_its_tokens_reach():
    text = "One two. Three four five. Six seven eight nine ten."
    spans, words = word_tokens(text)
    assert segment_cut(spans, words, 6, len(text), len(text), text, 0, 1) == (26, 26)  # after "five. "
    assert segment_cut(spans, words, 10, len(text), len(text), text, 0, 1) == (len(text), len(text))  # all fits


def test_a_sentence_longer_than_a_segment_is_cut_into_overlapping_word_windows():
    text = "alpha beta gamma delta epsilon zeta eta theta"
    spans, words = word_tokens(text)
    end, following = segment_cut(spans, words, 4, len(text), len(text), text, 0, 1)
    assert text[:end] == "alpha beta gamma delta" and text[following:].startswith("delta epsilon")


def test_a_word_is_never_cut_unless_it_alone_is_longer_than_a_segment():
    text = "ab cdefgh ij"  # tokens: ab | cd ef gh (one word) | ij
    spans, words = [(0, 2), (3, 5), (5, 7), (7, 9), (10, 12)], [0, 1, 1, 1, 2]
    end, _ = segment_cut(spans, words, 3, len(text), len(text), text, 0, 0)
    assert text[:end] == "ab"  # the word that does not fit whole waits for the next segment
    end, following = segment_cut(spans[1:], words[1:], 2, len(text), len(text), text, 3, 0)
    assert text[3:end] == "cdef" and following == 7  # one word longer than the segment: cut where its tokens stop


def test_a_prefix_that_is_one_token_of_one_word_ends_its_segment():
    """A chunk of a text without spaces that WordPiece reads as one [UNK]: the segment is the chunk,
    the next starts after it (it raised IndexError looking for the next word's first token)."""
    text = "a" * 1000
    assert segment_cut([(0, 100)], [0], 30, 100, len(text), text, 0, 4) == (100, 100)
    assert segment_cut([(100, 200)], [0], 30, 200, len(text), text, 100, 0) == (200, 200)


def test_groups_fold_to_their_maximum_and_token_weighted_mean():
    rows = np.array([4, 4, 4, 9, 9])
    owners, starts = segment_groups(rows)
    assert owners.tolist() == [4, 9] and starts.tolist() == [0, 3]
    scores = np.array([[0.1, 0.9], [0.7, 0.2], [0.3, 0.95], [0.5, 0.5], [0.6, 0.4]], np.float32)
    maxima, best = max_per_group(scores, starts)
    assert maxima.ravel().tolist() == pytest.approx([0.7, 0.95, 0.6, 0.5]) and best.tolist() == [[1, 2], [4, 3]]
    vectors = np.array([[1, 0], [0, 1], [1, 1], [2, 2], [4, 0]], np.float32)
    mean = weighted_mean_per_group(vectors, np.array([2, 1, 1, 3, 1]), starts)
    assert mean.ravel().tolist() == pytest.approx([0.75, 0.5, 2.5, 1.5])


# ── segments of real texts (MiniLM's tokenizer, no model) ────────────────────────────────

@pytest.fixture(scope="module")
def split_spec(minilm_path):
    return dataclasses.replace(load_tokenizer_spec(minilm_path, 32), segment_length=32)


def encode(spec, texts):
    return encode_texts(texts, Tokenizer.from_str(spec.tokenizer_json), spec)


def test_each_segment_is_its_span_tokenized_alone_and_every_word_is_in_one(split_spec):
    text = BENIGN * 3 + RUN_ON + HIDDEN
    encoded = encode(split_spec, ["a short row", text])
    segments = encoded.segments
    assert encoded.truncated.tolist() == [False, False] and set(segments.row.tolist()) == {1}
    alone = encode(dataclasses.replace(split_spec, segment_length=0), [text[a:b] for a, b in segments.spans])
    assert segments.lengths.tolist() == alone.lengths.tolist() and max(segments.lengths) <= 32
    assert segments.token_ids.tolist() == alone.token_ids.tolist()
    covered = np.zeros(len(text), bool)
    for a, b in segments.spans:
        covered[a:b] = True
    assert all(covered[i] for i, char in enumerate(text) if not char.isspace()), "a character no segment judged"
    spans = segments.spans.tolist()
    assert text[slice(*spans[0])].strip() == (BENIGN * 2).strip()  # whole sentences, as many as fit (2 × 15 tokens)
    overlaps = [a < previous_end for (_, previous_end), (a, _) in zip(spans, spans[1:])]
    assert any(overlaps), "windows inside the run-on sentence overlap"
    assert text[slice(*spans[-1])].endswith(HIDDEN[-20:])
    assert segments.row_chars.tolist() == [len("a short row"), len(text)]


def test_rows_that_fit_get_no_segments_and_keep_their_tokens(split_spec):
    texts = ["short", BENIGN, None]
    split, truncate = encode(split_spec, texts), encode(dataclasses.replace(split_spec, segment_length=0), texts)
    assert len(split.segments) == 0 and truncate.segments is None
    assert split.token_ids.tolist() == truncate.token_ids.tolist() and split.errors == truncate.errors


def test_a_row_stops_at_the_segment_cap_and_stays_truncated(split_spec):
    text = "word " * (40 * MAX_SEGMENTS_PER_ROW)
    encoded = encode(split_spec, [text])
    assert len(encoded.segments) == MAX_SEGMENTS_PER_ROW and encoded.truncated.tolist() == [True]


def test_a_long_word_in_any_segment_keeps_its_row_truncated(split_spec):
    """A word of more than 100 characters past the first window is one [UNK] in its segment (WordPiece's
    max_input_chars_per_word): the row, split whole, stays `truncated`; one without such a word does not;
    a row that fits with such a word is marked and not split."""
    texts = [BENIGN * 6 + "x" * 150 + " " + BENIGN, BENIGN * 8, "fits, but " + "x" * 150]
    encoded = encode(split_spec, texts)
    assert set(encoded.segments.row.tolist()) == {0, 1} and encoded.truncated.tolist() == [True, False, True]


@pytest.mark.parametrize("character", ["a", "\U0001f642", pytest.param("\u6771", marks=pytest.mark.slow)])
def test_a_run_without_spaces_splits_within_the_segment_cap_and_its_characters(split_spec, character):
    """3 M characters and no space (one [UNK] word for ASCII and emoji, a word a character for CJK): read a
    first cut at a time, at most MAX_SEGMENTS_PER_ROW of them, truncated. CJK takes 4 s: each of its 256
    segments tokenizes a first cut of 9,252 tokens again."""
    from pipeline.core.textcut import text_cut_for

    chunk_chars = text_cut_for(split_spec.tokenizer_json, split_spec.max_length).first_cut_chars
    encoded = encode(split_spec, ["first", character * 3_000_000])
    segments = encoded.segments
    assert encoded.truncated.tolist() == [False, True] and encoded.errors == [None, None]
    assert 0 < (segments.row == 1).sum() <= MAX_SEGMENTS_PER_ROW
    assert segments.spans[:, 1].max() <= MAX_SEGMENTS_PER_ROW * chunk_chars


# ── settings and fingerprint ──────────────────────────────────────────────────────────────

def test_auto_splits_for_moderate_only_and_the_segment_length_fits_the_window():
    assert [long_text_mode("auto", job) for job in ("moderate", "classify", "embed")] == \
        ["split", "truncate", "truncate"]
    assert long_text_mode("truncate", "moderate") == "truncate" and long_text_mode("split", "embed") == "split"
    config = RunConfig.of(input=("x",), output="y", segment_length=600)
    with pytest.raises(UsageError, match="--segment-length 600 is more than --max-length 512, .*--segment-length "
                                         "512 or less"):
        segment_length_of(config.long_rows.segment_length, 512)
    assert segment_length_of(None, 256) == 256


def test_truncate_leaves_the_fingerprint_as_it_was():
    from pipeline.offline.claim import long_text_fingerprint

    config = RunConfig.of(input=("x",), output="y", job="classify")
    assert long_text_fingerprint(config, 128) == {}
    assert long_text_fingerprint(config.with_settings(long_text="truncate", job="moderate"), 128) == {}
    assert long_text_fingerprint(config.with_settings(job="moderate"), 128) == \
        {"long_text": "split", "segment_length": 128}
    assert long_text_fingerprint(config.with_settings(long_text="split", segment_length=64), 128) == \
        {"long_text": "split", "segment_length": 64}


def test_unflagged_truncated_rows_are_a_finding_that_names_split():
    summary = RunSummary(rows=1000, truncated_rows=40, truncated_unflagged_rows=31, flagged_rows=12,
                         settings={"max_length": 128})
    finding = next(f for f in diagnose_run(summary) if f.code == "truncated-unflagged")
    assert finding.evidence.startswith("31 truncated rows were not flagged: only their first 128 tokens were judged")
    assert "--long-text split" in finding.action
    assert "31 truncated rows not flagged" in summary.to_text()
    assert not [f for f in diagnose_run(dataclasses.replace(summary, truncated_unflagged_rows=0))
                if f.code == "truncated-unflagged"]


# ── end to end ────────────────────────────────────────────────────────────────────────────

def run(tmp_path, name, texts, **settings):
    from pipeline.engines.local import run_job

    source = tmp_path / f"{name}-in"
    write_shards(source, pa.table({"id": list(range(len(texts))), "text": texts}), [len(texts)])
    config = RunConfig.of(input=(str(source),), output=str(tmp_path / name), progress=False, dtype="float32",
                          tokenize_workers=0, compile="off", max_length=32, **settings)
    summary = run_job(config)
    return pq.read_table(tmp_path / name / "part-00000.parquet"), summary


def segment_texts(model_path, text, segment_length=32):
    spec = dataclasses.replace(load_tokenizer_spec(model_path, 32), segment_length=segment_length)
    segments = encode(spec, [text]).segments
    return [text[a:b] for a, b in segments.spans.tolist()], segments.spans.tolist(), segments.lengths


LONG = BENIGN * 2 + RUN_ON + HIDDEN
ROWS = ["a short row", LONG, None, BENIGN, "another short one"]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["softmax", "multilabel"])
def test_a_long_row_scores_the_maximum_over_its_segments_scored_as_rows(tmp_path, head, tiny_classifier_path,
                                                                        tiny_multilabel_path):
    model = tiny_classifier_path if head == "softmax" else tiny_multilabel_path
    output, summary = run(tmp_path, "split", ROWS, model=model, job="classify", long_text="split")
    texts, _, _ = segment_texts(model, LONG)
    alone, _ = run(tmp_path, "alone", texts, model=model, job="classify", long_text="truncate")
    assert len(texts) > 2 and not any(alone["truncated"].to_pylist())
    expected = np.array(alone["scores"].to_pylist()).max(axis=0)
    assert np.array(output["scores"][1].as_py()) == pytest.approx(expected, abs=1e-6)
    labels = ("ok", "spam", "abuse") if head == "softmax" else ("toxic", "insult", "threat")
    assert output["label"][1].as_py() == labels[int(expected.argmax())]
    assert output["segments"].to_pylist() == [1, len(texts), None, 1, 1]
    assert output["truncated"].to_pylist() == [False] * 5
    assert output.column_names == ["id", "label", "score", "scores", "segments", "truncated", "error"]
    assert (summary.split_rows, summary.segments) == (1, len(texts))


@pytest.mark.slow
def test_moderate_names_the_span_that_raised_each_flag(tmp_path, tiny_multilabel_path):
    texts, spans, _ = segment_texts(tiny_multilabel_path, LONG)
    alone, _ = run(tmp_path, "alone", texts, model=tiny_multilabel_path, job="moderate", long_text="truncate")
    scores = np.array([[row[name] for name in ("toxic", "insult", "threat")] for row in alone["scores"].to_pylist()])
    output, summary = run(tmp_path, "split", ROWS, model=tiny_multilabel_path, job="moderate",  # auto: split
                          default_threshold=float(np.sort(scores[:, 0])[-2]))  # toxic: the top two segments hit
    row = output.to_pylist()[1]
    assert row["flagged_labels"] == ["toxic"] and row["segments"] == len(texts)
    assert row["flag_spans"] == [{"label": "toxic", "start": spans[int(scores[:, 0].argmax())][0],
                                  "end": spans[int(scores[:, 0].argmax())][1]}]
    short = output.to_pylist()[0]
    assert all(span["start"] == 0 and span["end"] == len(ROWS[0]) for span in short["flag_spans"] or [])
    assert output.column_names == ["id", "flagged", "flagged_labels", "scores", "flag_spans", "segments",
                                   "truncated", "error"]
    recorded = json.loads((tmp_path / "split" / ".lengthwise" / "run.json").read_text())["fingerprint"]
    assert (recorded["long_text"], recorded["segment_length"]) == ("split", 32)
    assert "split into" in summary.to_text()


@pytest.mark.slow
def test_embed_takes_the_token_weighted_mean_of_its_segments_normalised(tmp_path, tiny_encoder_path):
    output, _ = run(tmp_path, "split", ROWS, model=tiny_encoder_path, long_text="split")
    texts, _, lengths = segment_texts(tiny_encoder_path, LONG)
    alone, _ = run(tmp_path, "alone", texts, model=tiny_encoder_path)
    vectors = np.array(alone["embedding"].to_pylist())
    mean = (vectors * lengths[:, None]).sum(axis=0) / lengths.sum()
    assert np.array(output["embedding"][1].as_py()) == pytest.approx(mean / np.linalg.norm(mean), abs=1e-6)


@pytest.mark.slow
def test_rows_that_fit_are_bit_identical_to_truncate(tmp_path, tiny_multilabel_path):
    rows = [BENIGN * (i % 2 + 1) if i % 7 else LONG for i in range(40)]
    split, _ = run(tmp_path, "split", rows, model=tiny_multilabel_path, job="moderate", long_text="split")
    truncate, summary = run(tmp_path, "truncate", rows, model=tiny_multilabel_path, job="moderate",
                            long_text="truncate")
    fit = [i for i, count in enumerate(split["segments"].to_pylist()) if count == 1]
    assert len(fit) == 34 and "segments" not in truncate.column_names
    for name in ("flagged", "flagged_labels", "scores", "truncated", "error"):
        assert split[name].take(fit).to_pylist() == truncate[name].take(fit).to_pylist(), name
    assert summary.truncated_rows == 6 and summary.split_rows == 0


@pytest.mark.slow
def test_an_output_made_before_long_text_resumes_truncated(tmp_path, tiny_multilabel_path):
    """An output made with truncate (what every output before --long-text was: its fingerprint has
    no long_text) resumes under the default `auto`, not refused, and stays truncated."""
    from pipeline.engines.local import run_job

    write_shards(tmp_path / "in", pa.table({"id": list(range(6)), "text": [LONG, "short"] * 3}), [3, 3])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), job="moderate", progress=False,
                          model=tiny_multilabel_path, dtype="float32", tokenize_workers=0, compile="off", max_length=32)
    run_job(config.with_settings(long_text="truncate"))
    recorded = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())["fingerprint"]
    assert "long_text" not in recorded and "segment_length" not in recorded
    (tmp_path / "out" / "part-00001.parquet").unlink()  # a shard to redo
    summary = run_job(config)  # long_text auto
    assert summary.shards_done_before == 1 and summary.rows == 3 and summary.truncated_rows == 1
    assert "segments" not in pq.read_table(tmp_path / "out" / "part-00001.parquet").column_names
    with pytest.raises(UsageError, match="other settings"):
        run_job(config.with_settings(long_text="split"))


@pytest.mark.slow
def test_the_cli_takes_long_text_from_the_environment_and_refuses_a_segment_longer_than_the_window(
        tmp_path, tiny_encoder_path):
    from pipeline.cli import cli

    write_shards(tmp_path / "in", pa.table({"id": [1, 2], "text": [LONG, "short"]}), [2])
    base = ["run", "--input", str(tmp_path / "in"), "--model", tiny_encoder_path, "--max-length", "32",
            "--tokenize-workers", "0", "--dtype", "float32", "--compile", "off", "--no-progress"]
    refused = CliRunner().invoke(cli, [*base, "--output", str(tmp_path / "bad"), "--long-text", "split",
                                       "--segment-length", "64"])
    assert refused.exit_code == 2 and not (tmp_path / "bad").exists()
    assert refused.output.strip().splitlines()[-1] == ("error: --segment-length 64 is more than --max-length 32, "
                                                        "the tokens the model takes per row; set --segment-length "
                                                        "32 or less")
    done = CliRunner().invoke(cli, [*base, "--output", str(tmp_path / "out")], env={"LENGTHWISE_LONG_TEXT": "split"})
    assert done.exit_code == 0, done.output
    assert pq.read_table(tmp_path / "out" / "part-00000.parquet")["segments"].to_pylist()[0] > 1
    status = CliRunner().invoke(cli, ["status", "--output", str(tmp_path / "out")])
    assert "1 split into" in status.output


@pytest.mark.slow
def test_a_5_mb_text_splits_under_a_memory_cap(tmp_path, tiny_encoder_path):
    """One 5 MB row through a real `lengthwise run --long-text split`: it is read a segment at a
    time and stops at MAX_SEGMENTS_PER_ROW segments (truncated), and costs the run's peak resident
    set under 256 MiB (52 MiB measured)."""
    words = ("lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 90_000)[:5_000_000]
    finished, peak_rss_kib = run_one_huge_row(tmp_path, tiny_encoder_path, words, "--long-text", "split")
    assert peak_rss_kib < 256 << 10, f"the row cost {peak_rss_kib / 2 ** 10:.0f} MiB of peak resident set"
    output = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert output["segments"].to_pylist() == [1, MAX_SEGMENTS_PER_ROW, 1]
    assert output["truncated"].to_pylist() == [False, True, False]
    assert "truncated after 256 segments" in finished.stdout


@pytest.mark.slow
def test_duplicate_long_rows_each_fold_their_own_segments_and_short_duplicates_are_copied(tmp_path,
                                                                                         tiny_multilabel_path):
    """--dedupe beside --long-text split: a copy of a split row is not set aside (its result is folded from
    its own segments at the write), a copy of a row that fits takes its first copy's result."""
    rows = [LONG, "a short row", LONG, "a short row"]
    output, summary = run(tmp_path, "dupes", rows, model=tiny_multilabel_path, job="classify", long_text="split")
    scores = output["scores"].to_pylist()
    assert scores[0] == pytest.approx(scores[2], abs=1e-6) and scores[1] == scores[3]
    assert output["segments"].to_pylist()[0] == output["segments"].to_pylist()[2] > 1
    assert summary.deduplicated_rows == 1


@pytest.mark.slow
def test_a_20_mb_run_without_spaces_splits_for_under_256_mib(tmp_path, tiny_encoder_path):
    """20 MB of one character and no space with `--long-text split`: it peaked at 1.9-2.0 GB and took
    60-190 s, and reported `segments 1, truncated false` for one [UNK]."""
    text = "a" * 20_000_000  # tests/core/test_textcut.py runs a multi-byte one, truncated
    finished, peak_rss_kib = run_one_huge_row(tmp_path, tiny_encoder_path, text, "--long-text", "split")
    assert peak_rss_kib < 256 << 10, f"the row cost {peak_rss_kib / 2 ** 10:.0f} MiB of peak resident set"
    output = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert output["error"].to_pylist() == [None, None, None] and output["truncated"].to_pylist() == [False, True, False]
    assert 1 < output["segments"][1].as_py() <= MAX_SEGMENTS_PER_ROW
