"""The run's diagnosis: findings read off a run summary's measured numbers (pure)."""

from __future__ import annotations

import math

from pipeline.core.findings import Finding, as_record
from pipeline.core.probe import NO_MEMORY_PLAN

# Run. The device thread waiting for batches more than a quarter of its time is called
# input-bound (the practice's reading of utilisation traces: an accelerator idle for the input
# pipeline a quarter of the time is worth fixing first); the runs in docs/performance.md wait 0.2–8%.
PREPROCESSING_WAIT_SHARE = 0.25
# A wait shorter than this is start-up (the first window is tokenized before any batch), not a bottleneck.
PREPROCESSING_MIN_WAIT_S = 1.0
# A fifth of the computed tokens being padding: the most uneven data in docs/performance.md (the sample,
# 20 to 2,664 characters) packs at 0.85, imdb reviews at 0.99.
LOW_PADDING_EFFICIENCY = 0.80
# More than 1% of the rows truncated means --max-length is below the data's p99 length.
TRUNCATED_SHARE = 0.01
# A run streaming at under half the sweep's figure: the sweep times the device alone on
# pre-tokenized rows of a sample, a run also reads, tokenizes and writes its own data; the
# 50,000-row imdb run in docs/performance.md (6,541 tokens/s at --max-batch-tokens 2048) came within 5% of its
# sweep (6,222 at 2048). Half is far beyond that and beyond the ±10% noise.
BELOW_SWEEP_SHARE = 0.5
LENGTH_STEP = 8  # a suggested --max-length is rounded up to a multiple of this (the GPU bucket step)


def diagnose_run(summary) -> list[Finding]:
    """Findings for a run summary (a RunSummary or its JSON dict), in the practice's order:
    memory, a machine shared with other jobs, throughput, the input pipeline, padding and truncation, ids,
    row errors."""
    s = as_record(summary)
    checks = (_oom_splits, _oversubscribed, _below_sweep, _preprocessing_bound, _low_padding, _truncated_unflagged,
              _truncated_rows, _duplicate_ids, _row_errors)
    return [finding for check in checks if (finding := check(s)) is not None]


def _oversubscribed(s: dict) -> Finding | None:
    """Other lengthwise jobs on this machine, or a 1-minute load average above this run's own
    busy threads (torch threads + tokenizer workers) by more than the cores: other work wanted
    the cores too (a second job on a 2-core machine took one run from ~850 to ~43 rows/s)."""
    settings = s.get("settings") or {}
    others, load, cores = settings.get("other_jobs") or [], settings.get("load_average"), settings.get("cores")
    own = (settings.get("torch_threads") or 0) + (settings.get("tokenize_workers") or 0)
    busy = load is not None and cores and load > own + cores
    if not s.get("rows") or not (others or busy):
        return None
    evidence = (f"{len(others)} other lengthwise job(s) ran on this machine (pid {', '.join(map(str, others))})"
                if others else "other work ran on this machine")
    if load is not None and cores:
        evidence += (f"; load average {load:.1f} on {cores} cores, this run's own threads {own} "
                     f"({settings.get('torch_threads')} torch, {settings.get('tokenize_workers')} tokenizer workers)")
    share = max(1, (cores or 2) // (len(others) + 1))
    return Finding(
        "oversubscribed", evidence,
        f"the jobs share the cores: give each --torch-threads {share} and --tokenize-workers {max(0, share - 1)} "
        "(their threads adding up to the cores), or run them one after the other")


def _row_errors(s: dict) -> Finding | None:
    if not s.get("error_rows"):
        return None
    reasons = s.get("error_reasons") or {}
    listed = "; ".join(f"{count:,} × {reason!r}" for reason, count in reasons.items())
    advice = []
    for reason in reasons:
        if "out of memory" in reason:
            advice.append("lower --max-length or use a larger device for the rows that run out of memory alone")
        elif "non-finite" in reason:
            advice.append("--dtype float32 for the rows whose outputs overflowed")
        else:  # null, empty, undecodable or untokenizable text, a null id
            advice.append("fix the input rows")
    return Finding(
        "row-errors",
        f"{s['error_rows']:,} of {s['rows']:,} rows have an error" + (f": {listed}" if listed else ""),
        "the rows are in the output with `error` set and no result (select them with `error IS NOT NULL`); "
        + "; ".join(dict.fromkeys(advice or ["read the output's `error` column"])))


def _duplicate_ids(s: dict) -> Finding | None:
    if not s.get("duplicate_ids"):
        return None
    examples = ", ".join(map(repr, s.get("duplicate_id_examples") or []))
    return Finding(
        "duplicate-ids",
        f"{s['duplicate_ids']:,} rows repeat the id of an earlier row" + (f" (e.g. {examples})" if examples else ""),
        "both rows are kept, so results joined back by id get mixed up: deduplicate the input, or set --id-column "
        "to a column that is unique")


def _oom_splits(s: dict) -> Finding | None:
    if not s.get("oom_splits"):
        return None
    settings = s.get("settings") or {}
    safety = settings.get("safety")
    lowered = s.get("lowered_batch_rows") or {}
    evidence = (f"{s['oom_splits']:,} batches ran out of memory and were halved"
                + (f"; rows per padded length lowered to {lowered}" if lowered else "")
                + f" ({s.get('batch_plan', '')})")
    if str(s.get("batch_plan", "")).startswith(NO_MEMORY_PLAN):
        fitting = min((int(length) * rows for length, rows in lowered.items()), default=None)
        return Finding("oom-splits", evidence,
                       "batches were sized without a memory plan (--no-probe): drop --no-probe so the probe sizes them"
                       + (f", or lower --max-batch-tokens to {fitting:,} (what ran after the splits)"
                          if fitting else ""))
    return Finding(
        "oom-splits", evidence,
        "the memory plan is stale or too tight: probe again with --no-plan-cache"
        + (f", or raise --safety from {safety:g} to {safety + 0.5:g}" if safety else ", or raise --safety"))


def _preprocessing_bound(s: dict) -> Finding | None:
    stages = s.get("stage_s") or {}
    wait, forward = stages.get("wait_for_batch", 0.0), stages.get("forward", 0.0)
    if wait + forward <= 0 or wait < PREPROCESSING_MIN_WAIT_S or wait / (wait + forward) <= PREPROCESSING_WAIT_SHARE:
        return None
    settings = s.get("settings") or {}
    workers, cores = settings.get("tokenize_workers"), settings.get("cores")
    read, tokenize, collate = stages.get("read", 0.0), stages.get("tokenize", 0.0), stages.get("collate", 0.0)
    tokenize_wall = tokenize / max(workers or 1, 1)  # tokenize is summed over the worker processes
    evidence = (f"the device waited for batches {wait:.1f}s, {wait / (wait + forward):.0%} of its time (forward "
                f"{forward:.1f}s; device busy {s.get('device_busy_fraction', 0.0):.0%}); the stages feeding it: read "
                f"{read:.1f}s, tokenize {tokenize:.1f}s over {workers} worker(s), collate {collate:.1f}s")
    if read >= max(tokenize_wall, collate):
        action = ("reading the input is the slowest stage: read from a faster store or a nearer copy; more "
                  "--tokenize-workers will not help")
    elif collate > tokenize_wall:
        action = "collating on the one prefetch thread is the slowest stage: smaller batches (--max-batch-tokens)"
    elif workers == 0:
        action = f"--tokenize-workers {max(1, (cores or 2) - 1)}: tokenizing runs in the main process now"
    elif cores and workers >= cores:
        action = (f"--tokenize-workers {max(1, cores - 1)}: {workers} tokenizer processes on {cores} cores starve "
                  "the thread that feeds the device")
    elif cores and workers < cores - 1:
        action = f"--tokenize-workers {min(cores - 1, 2 * workers)} (now {workers}, on {cores} cores)"
    else:
        action = "tokenizing is the slowest stage and every core has a worker: a machine with more cores per device"
    return Finding("preprocessing-bound", evidence, action)


def _low_padding(s: dict) -> Finding | None:
    efficiency = s.get("padding_efficiency", 1.0)
    if not s.get("padded_tokens") or efficiency >= LOW_PADDING_EFFICIENCY:
        return None
    settings = s.get("settings") or {}
    window = settings.get("window_rows")
    rows = s.get("rows", 0) + s.get("error_rows", 0)
    evidence = (f"padding efficiency {efficiency:.3f}: {1 - efficiency:.0%} of the {s['padded_tokens']:,} computed "
                f"tokens were padding")
    if window and rows > window:
        action = (f"--window-rows {4 * window} (now {window}): more rows of each length to pack together, "
                  "or smaller batches (--max-batch-tokens) that span fewer lengths")
    else:
        action = ("the whole input was one window, so only smaller batches (--max-batch-tokens, --max-batch-rows) "
                  "span fewer lengths; on a GPU, rows much shorter than the 8-token bucket step pad more")
    return Finding("low-padding-efficiency", evidence, action)


SPLIT_ADVICE = "--long-text split judges all of every row (its segments scored as rows, folded into one result)"
PAIR_ADVICE = "a larger --max-length, up to the model's positions (a pair is truncated, never split)"


def split_advice(s: dict) -> str:
    """What judges the rest of a long row: split it, or for a pair job (never split) a larger --max-length."""
    return PAIR_ADVICE if (s.get("settings") or {}).get("pair") else SPLIT_ADVICE


def _truncated_unflagged(s: dict) -> Finding | None:
    """Moderation: a truncated row that was not flagged was judged on its first --max-length
    tokens only, so a text padded with benign words past them passes whatever follows."""
    rows = s.get("truncated_unflagged_rows", 0)
    if not rows or s.get("flagged_rows") is None:
        return None
    max_length = (s.get("settings") or {}).get("max_length")
    return Finding(
        "truncated-unflagged",
        f"{rows:,} truncated rows were not flagged: only their first {max_length} tokens were judged, and a text "
        "padded past them hides what follows",
        f"rerun with {PAIR_ADVICE}" if settings_of(s).get("pair") else
        f"rerun with {SPLIT_ADVICE} (the default of --job moderate; --long-text truncate made this output, so give "
        "--overwrite or another --output)")


def settings_of(s: dict) -> dict:
    return s.get("settings") or {}


def _truncated_rows(s: dict) -> Finding | None:
    rows, truncated = s.get("rows", 0), s.get("truncated_rows", 0)
    if not rows or truncated / rows <= TRUNCATED_SHARE:
        return None
    settings, lengths = s.get("settings") or {}, s.get("token_lengths") or {}
    max_length, positions = settings.get("max_length"), settings.get("max_positions")
    evidence = (f"{truncated:,} of {rows:,} rows ({truncated / rows:.1%}) were longer than --max-length "
                f"{max_length} tokens and truncated")
    if lengths:
        evidence += (f"; token lengths before truncation: p50 {lengths['p50']:,}, p99 {lengths['p99']:,}, "
                     f"max {lengths['max']:,}")
        covering = math.ceil(lengths["p99"] / LENGTH_STEP) * LENGTH_STEP
        if positions and covering > positions:
            if max_length is not None and max_length >= positions:
                action = (f"--max-length is at the model's limit ({positions} positions): {split_advice(s)}")
            else:
                action = (f"--max-length {positions} (the model's limit) keeps more of each row; p99 is beyond "
                          f"what the model takes, so {split_advice(s)}")
        else:
            action = (f"--max-length {covering} covers 99% of the rows (longer rows cost more per batch: "
                      f"`lengthwise plan --max-length {covering}` shows the rows per batch)"
                      + ("" if settings.get("pair") else f"; or {SPLIT_ADVICE}"))
    else:
        action = "a larger --max-length (the summary has no token lengths to size it)"
    return Finding("truncated-rows", evidence, action)


def _below_sweep(s: dict) -> Finding | None:
    reference = s.get("sweep_reference") or {}
    streaming_s = s.get("wall_s", 0.0) - (s.get("stage_s") or {}).get("setup", 0.0)
    if not reference.get("tokens_per_s") or streaming_s <= 0 or not s.get("real_tokens"):
        return None
    tokens_per_s = s["real_tokens"] / streaming_s  # after setup, as the sweep times it
    if tokens_per_s >= BELOW_SWEEP_SHARE * reference["tokens_per_s"]:
        return None
    return Finding(
        "below-sweep",
        f"{tokens_per_s:,.0f} tokens/s after setup is {tokens_per_s / reference['tokens_per_s']:.0%} of the "
        f"{reference['tokens_per_s']:,.0f} tokens/s that the sweep of {reference['created']} measured at "
        f"--{reference['vary']} {reference['level']} on this model, device and dtype",
        "something else changed: other work on the device (see device busy and the stage times), the data's "
        f"lengths, --tokenize-workers or --dtype; run `lengthwise sweep --vary {reference['vary']}` again to "
        "refresh the figure")
