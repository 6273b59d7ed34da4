"""What limits a sweep or a load test: the practice's troubleshooting table, read off the
numbers their levels already measure (a run's own diagnosis is `offline/diagnosis.py`).

Pure Python (no torch): a sweep's levels or a load test's rows in, a list of findings out, each
a stable code, the evidence (the numbers that triggered it) and the action (the flag to change,
and to what). Nothing is found when nothing is wrong.

The thresholds are judgment, not law; each says where it comes from. The measurements they are
compared with come from this project's sweeps on a shared 2-core CPU machine (docs/tuning.md,
"Choosing batch settings"), which repeat within about ±10%.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.core.findings import Finding, as_record
from pipeline.core.settings import MIN_WINDOW_ROWS
from pipeline.core.units import format_bytes

# Sweep. Differences under ~10% are this machine's noise (docs/tuning.md: repeat a sweep before
# trusting a difference under ~10%), so a level within 10% of the best is "as fast".
FLAT_TOLERANCE = 0.10
# Padding efficiency 5 points lower at a larger level: the larger batches are short of rows of
# similar length (on imdb a 2,000-row sample keeps it within 2 points from 512 to 16k tokens).
PADDING_DROP = 0.05
# Throughput down by more than the noise.
THROUGHPUT_DROP = 0.10
# p99 three times p50: the practice's "p99 jumps while p50 is fine". The imdb sweep in docs/tuning.md
# keeps row p99 within 1.5x of p50 at every level.
TAIL_RATIO = 3.0
# Under 20% of the memory budget free at the recommended level: twice the sweep's default
# --memory-headroom (10%), which the recommendation already keeps.
LOW_MEMORY_FREE = 0.20


# Online load test. Most batches sent by the wait timeout, and on average under half full: they
# leave by the timeout, not by size (at half full the size trigger is not what forms them).
BATCH_FILL_SHARE = 0.5
# Batches holding three quarters of the token budget on average (or most sent by the token
# trigger) are capped by tokens: topped-up batches sit at 80-100% of it in the runs in docs/tuning.md.
TOKEN_CAPPED_SHARE = 0.75
# Answers coming at under 95% of the offered rate fall behind the arrivals: a level that keeps up
# answers at 97-101% of it in the runs in docs/tuning.md (Poisson arrivals over 10 s vary by ~3%).
OVER_CAPACITY_SHARE = 0.95


def diagnose_sweep(levels: Sequence, recommendation, settings: dict) -> list[Finding]:
    """Findings for a sweep: its levels (LevelResult or CSV-row dicts), its recommendation
    (Recommendation or dict) and its settings (as written to OUT.json: vary, rows,
    sample_token_lengths, memory_budget_bytes, max_length)."""
    results = sorted((as_record(level) for level in levels), key=lambda r: r["level"])
    chosen = as_record(recommendation).get("level")
    checks = (_sweep_out_of_memory(results, settings), _thin_sample(results, settings),
              _padding_dominates(results, settings), _knee(results, settings), _latency_tail(results, settings),
              _memory_nearly_gone(results, chosen, settings))
    return [finding for finding in checks if finding is not None]


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if r["status"] == "ok" and r["rows_per_s"] > 0]


def _sweep_out_of_memory(results: list[dict], settings: dict) -> Finding | None:
    failed = [r for r in results if r["status"] != "ok"]
    if not failed:
        return None
    vary, first = settings["vary"], failed[0]
    below = [r["level"] for r in _ok(results) if r["level"] < first["level"]]
    return Finding(
        "sweep-out-of-memory",
        f"--{vary} {first['level']} ran out of memory ({first['oom_splits']} batch splits); the sweep stopped there",
        (f"levels up to {max(below)} fit; " if below else "no level fit; ")
        + "larger ones need a larger device, a lower --max-length or another --dtype")


def _thin_sample(results: list[dict], settings: dict) -> Finding | None:
    """Padding falling with the level because the sample is smaller than a run's window: the
    larger levels are measured with more padding than the run will have."""
    ok, sample_rows = _ok(results), settings.get("rows", 0)
    window = MIN_WINDOW_ROWS
    if len(ok) < 2 or sample_rows >= window:
        return None
    first, worst = ok[0], min(ok[1:], key=lambda r: r["padding_efficiency"])
    if worst["padding_efficiency"] >= first["padding_efficiency"] - PADDING_DROP:
        return None
    vary, best = settings["vary"], max(ok, key=lambda r: r["rows_per_s"])
    fell = worst["rows_per_s"] < (1 - THROUGHPUT_DROP) * best["rows_per_s"] and worst["level"] > best["level"]
    return Finding(
        "sweep-sample-too-thin",
        f"padding efficiency falls {first['padding_efficiency']:.3f} → {worst['padding_efficiency']:.3f} from "
        f"--{vary} {first['level']} to {worst['level']} (rows/s {first['rows_per_s']:,.1f} → "
        f"{worst['rows_per_s']:,.1f}" + (f", {worst['rows_per_s'] / best['rows_per_s'] - 1:+.0%} from the best "
                                        f"{best['rows_per_s']:,.1f} at {best['level']}" if fell else "")
        + f"); the sample has {sample_rows:,} rows",
        f"--sample-rows {window}: a run packs its batches out of --window-rows ({window}) rows at once, the sweep "
        f"out of its {sample_rows:,}-row sample, which has too few rows of each length to fill the larger batches; "
        "the larger levels are measured with more padding than the run will have"
        + (", so their fall in throughput may be the sample's, not the device's" if fell else ""))


def _padding_dominates(results: list[dict], settings: dict) -> Finding | None:
    """Throughput and padding falling together at the larger levels of a sample as large as
    a run's window: the padding is real, the larger batches span too many lengths."""
    ok, sample_rows = _ok(results), settings.get("rows", 0)
    if len(ok) < 2 or sample_rows < MIN_WINDOW_ROWS:
        return None
    best = max(ok, key=lambda r: r["rows_per_s"])
    fallen = [r for r in ok if r["level"] > best["level"]
              and r["rows_per_s"] < (1 - THROUGHPUT_DROP) * best["rows_per_s"]
              and r["padding_efficiency"] < best["padding_efficiency"] - PADDING_DROP]
    if not fallen:
        return None
    worst, vary = min(fallen, key=lambda r: r["padding_efficiency"]), settings["vary"]
    return Finding(
        "padding-dominates",
        f"from --{vary} {best['level']} to {worst['level']} rows/s fall {best['rows_per_s']:,.1f} → "
        f"{worst['rows_per_s']:,.1f} ({worst['rows_per_s'] / best['rows_per_s'] - 1:+.0%}) while padding "
        f"efficiency falls {best['padding_efficiency']:.3f} → {worst['padding_efficiency']:.3f}",
        f"stay at --{vary} {best['level']}, or raise --window-rows in the run so that batches span fewer lengths")


def _knee(results: list[dict], settings: dict) -> Finding | None:
    ok = _ok(results)
    if len(ok) < 2:
        return None
    best = max(ok, key=lambda r: r["rows_per_s"])
    band = (1 - FLAT_TOLERANCE) * best["rows_per_s"]
    knee = next(r for r in ok if r["rows_per_s"] >= band)
    flat = [knee]
    for result in ok[ok.index(knee) + 1:]:
        if result["rows_per_s"] < band:
            break
        flat.append(result)
    if len(flat) < 2:
        return None
    vary, last = settings["vary"], flat[-1]
    speeds = [r["rows_per_s"] for r in flat]
    return Finding(
        "throughput-flat",
        f"rows/s stay within {FLAT_TOLERANCE:.0%} of the best ({best['rows_per_s']:,.1f}) from --{vary} "
        f"{knee['level']} to {last['level']} ({min(speeds):,.1f}–{max(speeds):,.1f}); meanwhile row p99 "
        f"{knee['row_latency_ms_p99']:,.0f} → {last['row_latency_ms_p99']:,.0f} ms, peak memory "
        f"{format_bytes(knee['peak_device_bytes'])} → {format_bytes(last['peak_device_bytes'])}",
        f"the device is saturated from --{vary} {knee['level']} (the knee): use it, or the recommendation if it is "
        "within the band; larger batches buy no throughput, only "
        + ("latency and memory" if last["row_latency_ms_p99"] > knee["row_latency_ms_p99"] else "memory"))


def _latency_tail(results: list[dict], settings: dict) -> Finding | None:
    tails = [r for r in _ok(results)
             if r["row_latency_ms_p50"] > 0 and r["row_latency_ms_p99"] > TAIL_RATIO * r["row_latency_ms_p50"]]
    if not tails:
        return None
    worst = max(tails, key=lambda r: r["row_latency_ms_p99"] / r["row_latency_ms_p50"])
    vary, lengths = settings["vary"], settings.get("sample_token_lengths") or {}
    evidence = (f"row p99 is over {TAIL_RATIO:g}× p50 at --{vary} {', '.join(str(r['level']) for r in tails)}; "
                f"worst at {worst['level']}: p99 {worst['row_latency_ms_p99']:,.0f} ms = "
                f"{worst['row_latency_ms_p99'] / worst['row_latency_ms_p50']:.1f}× p50 "
                f"{worst['row_latency_ms_p50']:,.0f} ms")
    evidence += (f" (one batch: p50 {worst['batch_latency_ms_p50']:,.0f} ms, p99 "
                 f"{worst['batch_latency_ms_p99']:,.0f} ms)")
    if lengths:
        evidence += f"; sample token lengths median {lengths['median']:,.0f}, p99 {lengths['p99']:,.0f}"
    if lengths and lengths["p99"] >= 2 * lengths["median"]:
        action = (f"long rows: --max-p99-ms picks a level that meets your limit; a lower --max-length (now "
                  f"{settings.get('max_length')}) caps the longest rows")
    elif worst["batch_latency_ms_p99"] > TAIL_RATIO * worst["batch_latency_ms_p50"]:
        action = ("stalls: some batches of rows of similar length took far longer than the rest, so other work "
                  "shared the device or its host cores; sweep again when the machine is otherwise idle")
    else:
        action = ("queueing: rows wait behind earlier batches in the prefetch queue; fewer --prefetch-batches"
                  + (" or a smaller level" if worst is not _ok(results)[0] else "")
                  + ", and --max-p99-ms to make the recommendation respect the limit")
    return Finding("latency-tail", evidence, action)


def _memory_nearly_gone(results: list[dict], chosen: int | None, settings: dict) -> Finding | None:
    budget = settings.get("memory_budget_bytes")
    picked = next((r for r in results if r["level"] == chosen), None)
    if picked is None or not budget or 1 - picked["peak_device_bytes"] / budget >= LOW_MEMORY_FREE:
        return None
    vary, lengths = settings["vary"], settings.get("sample_token_lengths") or {}
    smaller = [r["level"] for r in _ok(results) if r["level"] < chosen]
    free = 1 - picked["peak_device_bytes"] / budget
    return Finding(
        "memory-headroom-low",
        f"at the recommended --{vary} {chosen} the batches peaked at {format_bytes(picked['peak_device_bytes'])} of the "
        f"{format_bytes(budget)} budget: {free:.0%} free",
        f"rows longer than the sample's (p99 {lengths.get('p99', '?')} tokens) or another process on the device "
        "will run out of memory: "
        + (f"use --{vary} {max(smaller)}, or " if smaller else "")
        + f"sweep with --memory-headroom {LOW_MEMORY_FREE:.2f} to keep more free")


LOADTEST_KEYS = ("max_batch_size", "batch_timeout_ms", "max_batch_tokens", "requests", "qps_offered", "qps_achieved",
                 "latency_ms_p50", "latency_ms_p99", "latency_ms_max", "rejected", "timed_out", "mean_batch_size",
                 "mean_batch_padded_tokens", "batches_by_size", "batches_by_tokens", "batches_by_timeout",
                 "max_queue_depth", "queue_depth_at_end", "wait_ms_p99", "compute_ms_p99")


def falls_behind(qps_achieved: float, qps_offered: float) -> bool:
    """Whether answers came slower than requests arrived (the queue grows without bound)."""
    return qps_achieved < OVER_CAPACITY_SHARE * qps_offered


def diagnose_loadtest(rows: Sequence[dict]) -> list[Finding]:
    """Findings for an online load test: one dict per level with LOADTEST_KEYS (the load
    test's CSV row)."""
    for row in rows:
        missing = [key for key in LOADTEST_KEYS if key not in row]
        if missing:
            raise ValueError(f"a load-test row lacks {', '.join(missing)}")
    checks = (_batches_never_fill, _token_capped, _queue_grows, *map(_lost_requests, LOST_REQUESTS), _online_tail)
    return [finding for check in checks if (finding := check(rows)) is not None]


def _at(row: dict) -> str:
    return (f"max batch size {row['max_batch_size']}, batch timeout {row['batch_timeout_ms']:g} ms, "
            f"{row['qps_offered']:,.1f} requests/s offered")


def _formed(row: dict) -> int:
    return row["batches_by_size"] + row["batches_by_tokens"] + row["batches_by_timeout"]


def _is_token_capped(row: dict) -> bool:
    formed = _formed(row)
    return bool(formed) and (row["batches_by_tokens"] > 0.5 * formed
                             or row["mean_batch_padded_tokens"] >= TOKEN_CAPPED_SHARE * row["max_batch_tokens"])


def _over_capacity(row: dict) -> bool:
    return bool(row["rejected"] or row["timed_out"] or falls_behind(row["qps_achieved"], row["qps_offered"]))


def _batches_never_fill(rows: list[dict]) -> Finding | None:
    hit = [r for r in rows if _formed(r) and r["batches_by_timeout"] > BATCH_FILL_SHARE * _formed(r)
           and r["mean_batch_size"] < BATCH_FILL_SHARE * r["max_batch_size"]
           and not _over_capacity(r) and not _is_token_capped(r)]
    if not hit:
        return None
    return Finding(
        "batches-never-fill",
        "; ".join(f"{_at(r)}: {r['batches_by_timeout']:,} of {_formed(r):,} batches sent by the timeout, "
                  f"mean batch {r['mean_batch_size']:.1f} of {r['max_batch_size']} (a window gathers "
                  f"~{r['qps_offered'] * r['batch_timeout_ms'] / 1000:.1f})" for r in hit),
        "the arrival rate is below the size trigger, so every request waits out the window: lower "
        "--batch-timeout-ms for latency; a larger --max-batch-size only adds waiting")


def _token_capped(rows: list[dict]) -> Finding | None:
    hit = [r for r in rows if _is_token_capped(r)]
    if not hit:
        return None
    return Finding(
        "batches-token-capped",
        "; ".join(f"{_at(r)}: {r['mean_batch_padded_tokens']:,.0f} padded tokens per batch on average of "
                  f"--max-batch-tokens {r['max_batch_tokens']:,} ({r['batches_by_tokens']:,} of {_formed(r):,} sent "
                  f"by the token trigger), mean batch {r['mean_batch_size']:.1f} of {r['max_batch_size']}"
                  for r in hit),
        "raising --max-batch-size alone changes nothing; raise --max-batch-tokens (within the memory plan) "
        "for larger batches")


def _queue_grows(rows: list[dict]) -> Finding | None:
    hit = [r for r in rows if falls_behind(r["qps_achieved"], r["qps_offered"])]
    if not hit:
        return None
    full = all(r["mean_batch_size"] >= 0.9 * r["max_batch_size"] for r in hit)
    return Finding(
        "queue-grows",
        "; ".join(f"{_at(r)}: {r['qps_achieved']:,.1f} answered per s "
                  f"({r['qps_achieved'] / r['qps_offered']:.0%}), queue {r['queue_depth_at_end']:,} deep at the "
                  f"last arrival (peak {r['max_queue_depth']:,}), p99 {r['latency_ms_p99']:,.0f} ms" for r in hit),
        "the device serves less than is offered, so the queue grows without bound: "
        + ("batches are full, so a larger --max-batch-size if memory allows, else " if full else "")
        + "another replica, or admit less (rate limit)")


LOST_REQUESTS = {  # the load test's count of lost requests → (finding code, what a level that lost some says, advice)
    "rejected": ("rejections",
                 lambda r: f"{_at(r)}: {r['rejected']:,} of {r['requests']:,} requests rejected "
                           f"({r['rejected'] / max(r['requests'], 1):.1%})",
                 "the queue was full: the offered rate is above capacity; add capacity (a replica, a larger max "
                 "batch size if batches are full); a longer queue only trades rejections for latency"),
    "timed_out": ("timeouts",
                  lambda r: f"{_at(r)}: {r['timed_out']:,} of {r['requests']:,} requests timed out, p99 "
                            f"{r['latency_ms_p99']:,.0f} ms, max {r['latency_ms_max']:,.0f} ms",
                  "requests waited past their timeout: capacity is below the offered rate, or the batch wait plus "
                  "one batch's compute exceeds the timeout; a smaller max batch size shortens each batch"),
}


def _lost_requests(count: str):
    """The check of one kind of lost request (`LOST_REQUESTS`): a finding over the levels that lost any."""
    code, says, advice = LOST_REQUESTS[count]

    def check(rows: list[dict]) -> Finding | None:
        hit = [r for r in rows if r[count] > 0]
        return Finding(code, "; ".join(map(says, hit)), advice) if hit else None

    return check


def _online_tail(rows: list[dict]) -> Finding | None:
    hit = [r for r in rows if r["latency_ms_p50"] > 0 and r["latency_ms_p99"] > TAIL_RATIO * r["latency_ms_p50"]]
    if not hit:
        return None
    queueing = all(r["wait_ms_p99"] >= r["compute_ms_p99"] for r in hit)
    return Finding(
        "latency-tail",
        "; ".join(f"{_at(r)}: p99 {r['latency_ms_p99']:,.0f} ms = {r['latency_ms_p99'] / r['latency_ms_p50']:.1f}× "
                  f"p50 {r['latency_ms_p50']:,.0f} ms (queue wait p99 {r['wait_ms_p99']:,.0f} ms, batch compute p99 "
                  f"{r['compute_ms_p99']:,.0f} ms)" for r in hit),
        "mostly waiting in the queue: add capacity or admit less (see queue-grows)" if queueing else
        "long batches: cap long rows with --max-length or lower --max-batch-tokens")
