"""`--engine ray`: the same shard runner on Ray Core actors.

The driver claims the output (lock, fingerprint, pending shards) as a local run does, then
feeds the pending shards, longest first, to K actors. Each actor loads the model once and
runs the shard runner on one shard at a time, reading its input and writing its output
itself: no rows travel through Ray's object store, only shards and summaries. An actor that
dies mid-shard (node lost, OOM-killed) is replaced and its shard handed to another actor, at
most MAX_SHARD_ATTEMPTS times; the dead attempt's temporary file is never committed and is
removed at the end. Exactly-once comes from the commit (temporary name → fixed name → marker),
so a shard committed twice by a zombie attempt is the same file with the same content.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time

from tqdm import tqdm
from transformers import AutoConfig

from pipeline.core.buckets import padding_efficiency
from pipeline.core.device import dtype_name
from pipeline.core.errors import UsageError
from pipeline.core.model import ModelChoice, check_max_length, load_model
from pipeline.core.settings import RunConfig
from pipeline.engines.claim import run_claimed
from pipeline.offline.manifest import RunManifest
from pipeline.offline.runner import ShardRunner
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot
from pipeline.offline.summary import RunSummary

log = logging.getLogger(__name__)


MAX_SHARD_ATTEMPTS = 3  # a shard whose actor died this many times is failed, as a bad shard is


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'lengthwise[ray]'") from None
    return ray


class ShardWorker:
    """The body of a Ray actor: one model on one device, shards in, summaries out."""

    def __init__(self, config: RunConfig, threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        self.config = config
        self.runner = ShardRunner(config, load_model(config))
        self.setup_s = time.perf_counter() - started

    def where(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "setup_s": round(self.setup_s, 2)}

    def run_shard(self, shard: Shard) -> dict:
        """Run one shard to its committed output (or its failure marker); its summary as a dict."""
        started = time.perf_counter()
        sink = ShardSink(self.config.output, self.config.storage_options)
        manifest = RunManifest(sink.fs, sink.output_dir)
        summary = RunSummary(shards=1, output=self.config.output)
        self.runner.run([shard], sink, manifest, summary, started)
        summary.wall_s = time.perf_counter() - started
        return dataclasses.asdict(summary)


def run_on_ray(config: RunConfig) -> RunSummary:
    """`lengthwise run --engine ray`: claim the output here, run the pending shards on actors."""
    import_ray()
    return run_claimed(config, WorkerSlot(), prepare_actors)


def prepare_actors(config: RunConfig, choice: ModelChoice):
    """What the driver can check before the output is touched (the actors load the model)."""
    check_max_length(AutoConfig.from_pretrained(choice.path, trust_remote_code=config.trust_remote_code),
                     choice.max_length)
    return functools.partial(run_on_actors, config, choice)


def run_on_actors(config: RunConfig, choice: ModelChoice, todo: list[Shard], sink: ShardSink, manifest: RunManifest,
                  summary: RunSummary, started: float) -> None:
    """The Ray engine: connect (unless this process already is), hand `todo` to actors, then
    remove what attempts whose actor died left behind."""
    ray = import_ray()
    # every actor runs what the fingerprint says, whatever its node's CPU would pick for `auto`
    config = dataclasses.replace(config, dtype=dtype_name(choice.dtype))
    connected_here = not ray.is_initialized()
    if connected_here:
        handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=config.ray_address, logging_level=logging.WARNING, log_to_driver=True)
        if threading.current_thread() is threading.main_thread():
            for number, handler in handlers.items():  # Ray installs its own; ours stop the run cleanly
                signal.signal(number, handler)
    try:
        ActorPool(ray, config, len(todo)).run(todo, manifest, summary, config.progress)
    finally:
        if connected_here:
            ray.shutdown()
    sink.remove_stale_temporaries([shard.stem for shard in todo])
    wall_s = time.perf_counter() - started
    summary.rows_per_s = summary.rows / wall_s
    summary.tokens_per_s = summary.real_tokens / wall_s


def actor_layout(config: RunConfig, cluster: dict, shards: int) -> tuple[int, dict, int | None]:
    """(actors, options, torch threads): one actor per GPU of the cluster with num_gpus=1, or
    CPU actors of --threads-per-worker each where there are none; never more than shards."""
    gpus = int(cluster.get("GPU", 0))
    if gpus and config.device != "cpu":
        workers = config.workers or gpus
        return min(workers, shards), {"num_gpus": 1, "num_cpus": 1}, config.threads_per_worker
    threads = config.threads_per_worker or 1
    workers = config.workers or max(1, int(cluster.get("CPU", 1)) // threads)
    return min(workers, shards), {"num_cpus": threads}, threads


class ActorPool:
    """K shard actors fed longest shard first; a dead actor is replaced and its shard retried."""

    def __init__(self, ray, config: RunConfig, shards: int):
        self.ray = ray
        self.config = dataclasses.replace(config, progress=False)  # one bar, the driver's
        self.count, self.options, self.threads = actor_layout(config, ray.cluster_resources(), shards)
        self.actor_class = ray.remote(ShardWorker).options(max_restarts=0, max_task_retries=0, **self.options)
        self.replacements_left = self.count * MAX_SHARD_ATTEMPTS
        self.actors: list = []
        self.where: dict[int, dict] = {}  # actor slot → pid, host, setup time
        self.stats = collections.defaultdict(lambda: {"shards": 0, "rows": 0, "busy_s": 0.0})

    def start(self, slots: list[int]) -> dict:
        """New actors for `slots`, created together; returns once every one has its model loaded.
        An actor that cannot start (no model folder on its node, a bad setting) is a usage error."""
        actors = {slot: self.actor_class.remote(self.config, self.threads) for slot in slots}
        try:
            found = self.ray.get([actor.where.remote() for actor in actors.values()])
        except self.ray.exceptions.RayActorError as error:
            raise UsageError(f"a Ray actor could not start: {error}") from error
        for slot, where in zip(actors, found):
            self.where[slot] = where
            log.info(f"actor {slot}: pid {where['pid']} on {where['host']}, model loaded in {where['setup_s']}s")
        return actors

    def run(self, todo: list[Shard], manifest: RunManifest, summary: RunSummary, progress: bool) -> None:
        ray = self.ray
        log.info(f"ray: {len(todo)} shard(s) on {self.count} actor(s) ({self.options})")
        queue = collections.deque(sorted(todo, key=lambda shard: shard.num_rows, reverse=True))
        attempts: collections.Counter = collections.Counter()
        actors = self.start(list(range(self.count)))
        idle = list(actors)
        running: dict = {}  # object ref → (actor slot, shard, dispatched at)
        bar = tqdm(total=sum(shard.num_rows for shard in todo), unit="rows", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True, smoothing=0.1)
        try:
            while queue or running:
                while queue and idle:
                    slot, shard = idle.pop(), queue.popleft()
                    attempts[shard.stem] += 1
                    log.info(f"actor {slot} (pid {self.where[slot]['pid']}) took {shard.url}")
                    running[actors[slot].run_shard.remote(shard)] = (slot, shard, time.perf_counter())
                finished, _ = ray.wait(list(running), num_returns=1)
                slot, shard, dispatched = running.pop(finished[0])
                try:
                    result = ray.get(finished[0])
                except ray.exceptions.RayActorError as error:
                    self._lost(slot, shard, attempts, queue, manifest, summary, error)
                    actors.update(self.start([slot]))
                    idle.append(slot)
                    continue
                except ray.exceptions.RayTaskError as error:  # not a bad shard: a bug or a bad setting
                    raise RuntimeError(f"{shard.url} raised on actor {slot}: {error}") from error
                merge_summary(summary, result)
                stats = self.stats[slot]
                stats["shards"] += 1
                stats["rows"] += result["rows"]
                stats["busy_s"] += time.perf_counter() - dispatched
                bar.update(shard.num_rows)
                idle.append(slot)
        finally:
            bar.close()
            for actor in actors.values():
                ray.kill(actor)  # an interrupt stops the actors too; their temporaries are cleaned up
        summary.workers = [{"actor": slot, **self.where[slot], **stats,
                            "rows_per_s": round(stats["rows"] / stats["busy_s"], 2) if stats["busy_s"] else 0.0}
                           for slot, stats in sorted(self.stats.items())]
        busy_s = sum(stats["busy_s"] for stats in self.stats.values())
        summary.device_busy_fraction = summary.stage_s.get("forward", 0.0) / busy_s if busy_s else 0.0

    def _lost(self, slot, shard, attempts, queue, manifest, summary, error) -> None:
        """An actor died with `shard` in hand: hand it out again, or fail it after the last attempt."""
        self.replacements_left -= 1
        if self.replacements_left < 0:
            raise RuntimeError(f"Ray actors keep dying (last: {error}); stopping")
        if attempts[shard.stem] < MAX_SHARD_ATTEMPTS:
            log.warning(f"actor {slot} (pid {self.where[slot]['pid']}) died running {shard.url}; handing the shard "
                        f"to another actor (attempt {attempts[shard.stem] + 1} of {MAX_SHARD_ATTEMPTS})")
            queue.appendleft(shard)
            return
        reason = f"its Ray actor died {MAX_SHARD_ATTEMPTS} times: {type(error).__name__}"
        manifest.mark(shard.stem, "failed", input=shard.url, error=reason)
        summary.failed_shards.append({"shard": shard.url, "error": reason})


def merge_summary(total: RunSummary, part: dict) -> None:
    """Add one shard's summary to the run's: counts add up, lists extend, the rest is kept."""
    for name in ("rows", "error_rows", "truncated_rows", "duplicate_ids", "batches", "real_tokens", "padded_tokens",
                 "oom_splits", "reused_rows", "computed_rows"):
        setattr(total, name, getattr(total, name) + part[name])
    total.failed_shards.extend(part["failed_shards"])
    if part["flagged_rows"] is not None:  # job moderate
        total.flagged_rows = (total.flagged_rows or 0) + part["flagged_rows"]
        for label, rows in part["flagged_by_label"].items():
            total.flagged_by_label[label] = total.flagged_by_label.get(label, 0) + rows
    total.duplicate_id_examples.extend(part["duplicate_id_examples"][:5 - len(total.duplicate_id_examples)])
    for name, seconds in part["stage_s"].items():
        total.stage_s[name] = round(total.stage_s.get(name, 0.0) + seconds, 3)
    total.lowered_batch_rows.update(part["lowered_batch_rows"])
    for reason, rows in part["error_reasons"].items():
        total.error_reasons[reason] = total.error_reasons.get(reason, 0) + rows
    for name, length in part["token_lengths"].items():  # the largest shard's percentile: an upper bound
        total.token_lengths[name] = max(total.token_lengths.get(name, 0), length)
    total.padding_efficiency = padding_efficiency(total.real_tokens, total.padded_tokens)
    for name in ("batch_setting", "batch_plan", "device", "dtype", "dtype_reason", "model", "settings",
                 "sweep_reference"):
        setattr(total, name, part[name])
