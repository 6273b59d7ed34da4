"""How many rows a batch of a given padded length may hold: the memory formula, and the probe
that checks it on the real device.

    batch_rows(L) = floor((available_bytes − base_bytes) / (per_sample_bytes(L) × safety))
    per_sample_bytes(L) = linear_bytes · L + quadratic_bytes · L²     (linear layers; attention)

The coefficients are fitted from a few small forward passes on the device. Then the longest
bucket's planned batch, and those of the buckets near half and a quarter of it, run at full size
and are kept only if their peak stays within the budget (else the rows shrink); the other buckets
are covered by a verified bucket at least as long with as many rows, or interpolated by a fit
through the full-size measurements. The top of this module is pure (no torch); the probe at the
bottom imports torch when it runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from pipeline.core.units import format_bytes

log = logging.getLogger(__name__)


SAFETY_RANGE = (1.0, 4.0)
MEMORY_BUCKETS = 8  # lengths probed: max_length/8, 2·max_length/8, …, max_length
PROBE_ROUNDS = 3  # rounds a size must pass on the CPU when its peak comes near the budget (on CUDA the
# caching allocator is deterministic for one shape: one round)
CLEAR_SHARE = 0.85  # a first round peaking at or below this share of the budget passes at once: the
# rounds guard against run-to-run noise near the limit, which is a few % here, not 15%
FIT_ROWS = (2, 8)  # the fewest rows of the fitting grid's two batch sizes (more where `fit_rows` floors apply)
FIT_LENGTH_FRACTIONS = (0.25, 0.5, 1.0)  # lengths of the fitting grid, as fractions of max_length
CPU_FIT_FLOOR_BYTES = 192 * 2**10  # on the CPU the smallest fitting batch's hidden state holds at least this: a
# resident set moves by a MiB or so between forwards (kernel and thread caches), which hid a 32-wide model's growth
# at 2 and 8 rows; MiniLM's grid at 256 tokens stays 2 and 8 rows
CUDA_FIT_FLOOR_BYTES = 32 * 2**20  # on CUDA at least this: 16 of the caching allocator's 2 MiB pages (its small
# requests share 2 MiB blocks, 1-10 MiB ones 20 MiB blocks), so the fit measures activations rather than page rounding
CUDA_FIT_MAX_TOKENS = 262144  # and the largest fitting batch holds no more tokens than this (nor the token budget)


def fit_rows(device_type: str, shortest_length: int, longest_length: int, hidden_size: int, element_bytes: int,
             max_batch_tokens: int | None) -> tuple[int, int]:
    """The fitting grid's two batch sizes, the second four times the first: as many rows as put
    the device's floor (CPU_FIT_FLOOR_BYTES, CUDA_FIT_FLOOR_BYTES) in the shortest fitting batch's
    hidden state, and never fewer than FIT_ROWS. On CUDA, within CUDA_FIT_MAX_TOKENS and the token
    budget at the longest length (on the CPU the floor is small enough to need no cap)."""
    if hidden_size < 1:
        return FIT_ROWS
    floor = CUDA_FIT_FLOOR_BYTES if device_type == "cuda" else CPU_FIT_FLOOR_BYTES
    small = math.ceil(floor / (shortest_length * hidden_size * element_bytes))
    if device_type == "cuda":
        tokens = min(CUDA_FIT_MAX_TOKENS, max_batch_tokens or CUDA_FIT_MAX_TOKENS)
        small = min(small, tokens // (4 * longest_length))
    small = max(FIT_ROWS[0], small)
    return small, 4 * small


def batch_rows(available_bytes: float, per_sample_bytes: float, safety: float) -> int:
    """The memory formula: rows that fit `available_bytes` at `per_sample_bytes` each, with
    `safety` headroom for framework workspace, caches and temporaries."""
    if not SAFETY_RANGE[0] <= safety <= SAFETY_RANGE[1]:
        raise ValueError(f"safety must be in {SAFETY_RANGE[0]}–{SAFETY_RANGE[1]}, got {safety}")
    if per_sample_bytes <= 0:
        raise ValueError(f"per-sample bytes must be positive, got {per_sample_bytes}")
    return max(0, math.floor(available_bytes / (per_sample_bytes * safety)))


@dataclass(frozen=True)
class MemoryModel:
    """Peak activation bytes of one batch: base + rows × (linear·L + quadratic·L²)."""

    base_bytes: float
    linear_bytes: float  # per row per token
    quadratic_bytes: float  # per row per token²

    def per_sample_bytes(self, length: int) -> float:
        return self.linear_bytes * length + self.quadratic_bytes * length**2

    def peak_bytes(self, rows: int, length: int) -> float:
        return self.base_bytes + rows * self.per_sample_bytes(length)

    def rows_within(self, available_bytes: float, safety: float, length: int) -> int:
        """The formula's rows for one padded length; the base is taken off the budget first."""
        return batch_rows(available_bytes - self.base_bytes, self.per_sample_bytes(length), safety)


@dataclass(frozen=True)
class PeakMeasurement:
    rows: int
    length: int
    peak_bytes: float


def fit_memory_model(measurements: Sequence[PeakMeasurement]) -> MemoryModel:
    """Least squares of peak on [1, rows·L, rows·L²] with every coefficient ≥ 0.

    Tries each subset of the three terms and keeps the best fit whose coefficients are all
    non-negative (a negative memory term is noise, not physics).
    """
    if len(measurements) < 3:
        raise ValueError(f"need at least 3 measurements to fit, got {len(measurements)}")
    rows = np.array([m.rows for m in measurements], dtype=float)
    lengths = np.array([m.length for m in measurements], dtype=float)
    peaks = np.array([m.peak_bytes for m in measurements], dtype=float)
    columns = np.stack([np.ones_like(rows), rows * lengths, rows * lengths**2], axis=1)
    best, best_error = None, math.inf
    for size in (3, 2, 1):
        for subset in itertools.combinations(range(3), size):
            solution, *_ = np.linalg.lstsq(columns[:, subset], peaks, rcond=None)
            if (solution < 0).any():
                continue
            error = float(np.sum((columns[:, subset] @ solution - peaks) ** 2))
            if error < best_error * (1 - 1e-9):
                coefficients = np.zeros(3)
                coefficients[list(subset)] = solution
                best, best_error = coefficients, error
    largest = max(measurements, key=lambda m: m.rows * m.length)
    if best is None or best[1] * largest.rows * largest.length + best[2] * largest.rows * largest.length**2 \
            < 1e-3 * max(largest.peak_bytes, 1.0):
        raise ValueError("peak memory does not grow with rows × length in these measurements; "
                         "the probe batches are too small to measure")
    return MemoryModel(*(float(c) for c in best))


def memory_bucket_lengths(max_length: int, count: int = MEMORY_BUCKETS) -> list[int]:
    """The lengths the plan is made for: `count` steps up to max_length, multiples of 8."""
    lengths = {min(max_length, max(8, int(math.ceil(max_length * i / count / 8)) * 8)) for i in range(1, count + 1)}
    return sorted(lengths)


@dataclass
class BucketPlan:
    length: int  # the longest padded length this bucket covers
    formula_rows: int  # what the fitted formula allows
    planned_rows: int  # formula rows capped by --max-batch-rows and --max-batch-tokens
    probed_rows: int  # what survived the probe (≤ planned_rows); 0: not even one row fits
    predicted_peak_bytes: float
    measured_peak_bytes: float  # 0 where the bucket was not run at full size
    check: str = "measured"  # or "covered by <length>" (a verified bucket as long, with as many rows), "interpolated"


@dataclass
class MemoryPlan:
    available_bytes: int
    safety: float
    coefficients: MemoryModel
    buckets: list[BucketPlan]
    device: str = ""
    dtype: str = ""
    probe_s: float = 0.0
    source: str = "probe"  # or the cache file it came from
    key: dict = field(default_factory=dict)

    def rows_for(self, padded_length: int) -> int:
        """Rows for a batch of this padded length, from the smallest bucket covering it: as
        many padded tokens as the bucket's probed worst case (its length × its rows). A
        shorter batch with no more tokens needs no more memory (the linear term is the same,
        the attention term smaller), so lengths between bucket bounds keep the full token
        budget instead of the longest length's row count."""
        for bucket in self.buckets:
            if padded_length <= bucket.length:
                return bucket.probed_rows * bucket.length // padded_length
        raise ValueError(f"padded length {padded_length} is beyond the plan's {self.buckets[-1].length}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MemoryPlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPlan:
        data = dict(data)
        data["coefficients"] = MemoryModel(**data["coefficients"])
        data["buckets"] = [BucketPlan(**bucket) for bucket in data["buckets"]]
        return cls(**data)

    def to_table(self) -> str:
        lines = [f"available {format_bytes(self.available_bytes)} · safety {self.safety} · "
                 f"per row: {self.coefficients.linear_bytes:,.0f} B·L + {self.coefficients.quadratic_bytes:,.1f} B·L² "
                 f"+ {format_bytes(self.coefficients.base_bytes)} per batch",
                 "| length | formula rows | probed rows | predicted peak | measured peak | headroom | check |",
                 "|---:|---:|---:|---:|---:|---:|---|"]
        for b in self.buckets:
            measured = b.measured_peak_bytes > 0
            headroom = f"{1 - b.measured_peak_bytes / self.available_bytes:.0%}" if measured else "—"
            lines.append(f"| {b.length} | {b.formula_rows:,} | {b.probed_rows:,} | "
                         f"{format_bytes(b.predicted_peak_bytes)} | "
                         f"{format_bytes(b.measured_peak_bytes) if measured else '—'} | {headroom} | {b.check} |")
        return "\n".join(lines)


def largest_accepted(upper: int, accept: Callable[[int], bool]) -> int:
    """The largest rows in 1..upper that `accept`s, by binary search (0 if even 1 fails).
    Assumes acceptance is monotone: if n rows fit, fewer rows fit too."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if accept(middle):
            low = middle
        else:
            high = middle - 1
    return low


CORRECTION_AIM = 0.82  # a corrected or fitted size aims at this share of the budget: just under CLEAR_SHARE, so
# that it passes in one round (3 rounds near the budget cost more probe time than the last 15% of rows gain:
# throughput is flat beyond the sweep's knee, docs/tuning.md "Choosing batch settings")


def corrected_rows(rows: int, peak_bytes: float, base_bytes: float, available_bytes: float) -> int:
    """Rows expected to peak at CORRECTION_AIM of the budget, from a size that peaked above it:
    the peak is base + rows × per-row bytes, and this measurement says what a row costs here.
    0 when the measurement says nothing (out of memory)."""
    if not math.isfinite(peak_bytes) or peak_bytes <= base_bytes:
        return 0
    per_row = (peak_bytes - base_bytes) / rows
    return max(0, math.floor((available_bytes * CORRECTION_AIM - base_bytes) / per_row))


VERIFIED_LENGTH_FRACTIONS = (1.0, 0.5, 0.25, 0.0)  # buckets run at full size: the longest, those nearest half and
# a quarter of it, and the shortest; every other bucket lies between two of them
INTERPOLATION_AIM = CORRECTION_AIM  # a bucket between verified ones aims where a verified size does, by the fit
# through the full-size measurements (between verified lengths it is within a few %; on the CPU a re-measured peak
# moves by more than that, docs/design.md "How batch sizes are chosen"; the OOM split stays behind it)


def verified_lengths(lengths: Sequence[int]) -> list[int]:
    """The bucket lengths the probe runs at full size, longest first."""
    longest = max(lengths)
    chosen = {min(lengths, key=lambda length: abs(length - fraction * longest))
              for fraction in VERIFIED_LENGTH_FRACTIONS}
    return sorted(chosen, reverse=True)


def plan_buckets(model: MemoryModel, available_bytes: int, safety: float, lengths: Sequence[int],
                 max_batch_rows: int, max_batch_tokens: int | None,
                 measure: Callable[[int, int], float], rounds: int = PROBE_ROUNDS,
                 fit_measurements: Sequence[PeakMeasurement] = ()) -> list[BucketPlan]:
    """Formula rows per bucket, capped by the user's limits and never more for a longer bucket;
    then checked on the device without running every bucket at full size:

    - the longest bucket, those nearest half and a quarter of it and the shortest run at full
      size (`verify_rows`), longest first, each at the size that a fit through the full-size
      measurements so far (with `fit_measurements`, the small fitting grid) puts at
      CORRECTION_AIM of the budget, if that is below the formula's — so after the first, most
      pass in one round — unless a verified bucket at least as long with at least as many rows
      covers it (memory grows with rows and with length);
    - every other bucket lies between two verified ones: covered the same way, or given the rows
      that fit puts at INTERPOLATION_AIM, between the longer and the shorter verified rows.
    """
    planned: dict[int, tuple[int, int]] = {}  # length → (formula rows, planned rows)
    for length in sorted(lengths):
        formula_rows = model.rows_within(available_bytes, safety, length)
        token_cap = max_batch_tokens // length if max_batch_tokens else formula_rows
        rows = max(1, min(formula_rows, max_batch_rows, max(1, token_cap)))
        if planned:
            rows = min(rows, planned[max(planned)][1])
        planned[length] = (formula_rows, rows)

    verified: dict[int, tuple[int, float]] = {}  # length → (rows that passed, their peak)
    large: list[PeakMeasurement] = []

    def covering(length: int) -> tuple[int, int | None]:
        """The most rows of a verified bucket at least as long, and its length."""
        return max(((ok, other) for other, (ok, _) in verified.items() if other >= length), default=(0, None))

    def current_fit() -> MemoryModel | None:
        try:
            return fit_memory_model([*fit_measurements, *large]) if large else None
        except ValueError:  # degenerate measurements: the small-batch fit it is
            return None

    for length in verified_lengths(lengths):
        rows = planned[length][1]
        fit = current_fit()
        if fit is not None:
            rows = min(rows, max(1, fit.rows_within(available_bytes * CORRECTION_AIM, 1.0, length)))
        cover_rows, _ = covering(length)
        if rows <= cover_rows:
            continue
        ok, peak, tried = verify_rows(rows, length, model.base_bytes, available_bytes, measure, rounds)
        verified[length] = (max(ok, cover_rows), peak if ok >= cover_rows else 0.0)
        large += [PeakMeasurement(r, length, p) for r, p in tried.items() if math.isfinite(p) and p > 0]
    refit = current_fit() or model

    buckets = []
    for length in sorted(lengths):
        formula_rows, rows = planned[length]
        predicted = model.peak_bytes(max(rows, 1), length)
        if length in verified:
            ok, peak = verified[length]
            buckets.append(BucketPlan(length, formula_rows, rows, ok, predicted, peak))
            continue
        cover_rows, cover = covering(length)
        if rows <= cover_rows:
            buckets.append(BucketPlan(length, formula_rows, rows, rows, predicted, 0.0, f"covered by {cover}"))
            continue
        shorter = min(ok for other, (ok, _) in verified.items() if other < length)  # the shortest is verified
        fitted = refit.rows_within(available_bytes * INTERPOLATION_AIM, 1.0, length)
        ok = max(cover_rows, min(rows, shorter, fitted))
        buckets.append(BucketPlan(length, formula_rows, rows, ok, refit.peak_bytes(ok, length), 0.0, "interpolated"))
    for shorter_bucket, longer_bucket in zip(buckets, buckets[1:]):  # never more rows for a longer bucket
        longer_bucket.probed_rows = min(longer_bucket.probed_rows, max(shorter_bucket.probed_rows, 1))
    return buckets


def verify_rows(planned: int, length: int, base_bytes: float, available_bytes: int,
                measure: Callable[[int, int], float], rounds: int) -> tuple[int, float, dict[int, float]]:
    """(rows that fit, their peak, every size tried → its peak) for one bucket, measured with
    `measure(rows, length) → peak bytes`: once when the peak is clearly within the budget
    (CLEAR_SHARE), else up to `rounds` times. Where a size exceeds the budget, the size its
    measurement predicts just under the budget is tried next, and a binary search below it
    only if that fails too."""
    peaks: dict[int, float] = {}

    def accept(rows: int) -> bool:
        """Within the budget: one round clearly within, or `rounds` rounds near it; stops at the
        first round over it."""
        peaks[rows] = 0.0
        for _ in range(rounds):
            peaks[rows] = max(peaks[rows], measure(rows, length))
            if peaks[rows] > available_bytes:
                return False
            if peaks[rows] <= CLEAR_SHARE * available_bytes:
                return True
        return True

    if accept(planned):
        probed = planned
    else:  # aim just under the budget from what the failing size measured, then search below if needed
        guess = min(planned - 1, corrected_rows(planned, peaks[planned], base_bytes, available_bytes))
        if guess < 1:  # out of memory: the measurement says nothing, search all sizes below
            probed = largest_accepted(planned - 1, accept)
        else:
            probed = guess if accept(guess) else largest_accepted(guess - 1, accept)
    return probed, peaks.get(max(probed, 1), 0.0), peaks


SMALLER_PLAN_SERVES = 0.75  # a plan made for a budget at least this share of the current one is reused as is


def plan_for_budget(plan: MemoryPlan, available_bytes: int) -> MemoryPlan | None:
    """A cached plan adapted to the budget of this run, without probing: as it is when it was
    made for this budget or a somewhat smaller one (it fits; at most a quarter of the budget
    goes unused), scaled down when it was made for a larger one; None when a new probe should
    be made (a much larger budget, or one that the per-batch base alone fills).

    Scaling keeps each bucket's share of the budget after the base: rows that passed the probe
    at budget B with the fitted base b get ⌊rows × (A − b) / (B − b)⌋ at budget A, never more
    than the formula gives at A. A bucket whose rows --max-batch-tokens or --max-batch-rows set
    (memory allowed more, and the probe passed them all) keeps them while the formula at A still
    allows them: free memory moving by a GiB neither probes again nor changes a batch that memory
    never bounded (which changed a run's outputs in their last bits from one run to the next)."""
    if plan.available_bytes == available_bytes or (
            SMALLER_PLAN_SERVES * available_bytes <= plan.available_bytes < available_bytes):
        return plan
    base = plan.coefficients.base_bytes
    if plan.available_bytes < available_bytes or available_bytes <= base:
        return None
    share = (available_bytes - base) / (plan.available_bytes - base)

    def scaled(bucket: BucketPlan) -> BucketPlan:
        capped = bucket.planned_rows < bucket.formula_rows and bucket.probed_rows == bucket.planned_rows
        rows = min(bucket.probed_rows if capped else int(bucket.probed_rows * share),
                   plan.coefficients.rows_within(available_bytes, plan.safety, bucket.length))
        return replace(bucket, probed_rows=rows, predicted_peak_bytes=plan.coefficients.peak_bytes(rows, bucket.length),
                       measured_peak_bytes=0.0, check=f"scaled from a {format_bytes(plan.available_bytes)} plan")

    buckets = [scaled(bucket) for bucket in plan.buckets]
    if any(before.probed_rows and not after.probed_rows for before, after in zip(plan.buckets, buckets)):
        return None
    return replace(plan, available_bytes=available_bytes, buckets=buckets,
                               source=f"{plan.source}, made for {format_bytes(plan.available_bytes)}, scaled to "
                                      f"{format_bytes(available_bytes)}")
