"""`--engine ray`: the same shard runner on Ray Core actors.

The driver claims the output (lock, fingerprint, pending shards) as a local run does, then feeds the
pending shards, longest first, to K actors. Each actor loads the model (or a run's several models,
as a local run opens them: `open_shard_runner`) once and runs the shard runner on one shard at a
time, reading its input and writing its output itself: no rows travel through Ray's object store,
only shards, summaries and id hashes. The driver keeps one more shard queued on each actor, which
reads and tokenizes that shard's first window while the current one runs, so the device does not
wait for a shard's start. An actor that dies at any moment (while loading the model, mid-shard,
while committing: node lost, OOM-killed) is replaced, and its shard handed to another actor, at most
MAX_SHARD_ATTEMPTS times; actors are replaced at most MAX_SHARD_ATTEMPTS × K times a run. The same
Python exception from loading the model in two actors is a usage error. Each attempt carries a token
the driver grants before handing the shard out; the commit checks it, so a zombie attempt that comes
back never commits over a newer one, and reads the driver's lock, so no actor on any node commits
once its driver's lock was taken over or its lease ran out (docs/scale-out.md).
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
import uuid
from contextlib import contextmanager
from typing import NamedTuple

from tqdm import tqdm

from pipeline.core.buckets import padding_efficiency
from pipeline.core.clock import SetupClock
from pipeline.core.errors import StorageError, UsageError
from pipeline.core.settings import CUDA_HOST_THREADS
from pipeline.engines.claim import choose_here, run_claimed
from pipeline.engines.model_set import run_model_set
from pipeline.offline.model_set_setup import choose_models
from pipeline.engines.ray_devices import actors_config, choose_on_cluster, said_dtypes, settled_dtypes
from pipeline.engines.runner_setup import open_shard_runner
from pipeline.offline.carry import Carry
from pipeline.offline.config import RunConfig
from pipeline.offline.manifest import RunManifest
from pipeline.offline.reuse import remove_stale_hash_temporaries
from pipeline.offline.sink import ShardSink, output_paths
from pipeline.offline.source import Shard, WorkerSlot
from pipeline.offline.summary import IdTracker, RunSummary, add_counts
from pipeline.runtime.choice import ModelChoice
from pipeline.runtime.model_set import ModelSetChoice

log = logging.getLogger(__name__)


MAX_SHARD_ATTEMPTS = 3  # a shard whose actor died this many times is failed, as a bad shard is
SHARDS_PER_ACTOR = 2  # in an actor's hands at once: one running, the next starting (its first window tokenizing)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"  # warns about token auth on every start


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'lengthwise[ray]'") from None
    return ray


class ShardWorker:
    """The body of a Ray actor: one model, or several, on one device, shards in, summaries out. A
    Python exception while loading a model is kept and reported by `where`, so that the driver can
    tell it (the same in every actor: a usage error) from an actor killed while it loads."""

    def __init__(self, config: RunConfig, carry: Carry | None = None):
        """`config`: the driver's, with the actor's torch threads and tokenizer processes, and the device
        and dtypes it settled (`actors_config`); `carry`: a change of models the driver found."""
        started = time.perf_counter()
        self.config = config
        self.start_error, self.device, self.dtype, self.models = None, None, None, {}
        try:
            # the device settled here, on the actor's node: cuda is its GPU (cuda:0)
            choice = (choose_models if config.models else choose_here)(config, None, None)
            # one tokenizer pool for the actor's life
            opening = open_shard_runner(config, choice, None, SetupClock(), keep_pool=True, carry=carry)
            self.runner, self.models = opening.runner, opening.opened
            self.device = str(choice.device)
            self.dtype = said_dtypes({name: each["dtype"] for name, each in self.models.items()})
        except Exception as error:
            self.start_error = str(error) if isinstance(error, UsageError) else f"{type(error).__name__}: {error}"
        self.setup_s = time.perf_counter() - started
        self.turn = threading.Lock()  # one shard at a time through the device and the writer
        self.last_run_ended = 0.0  # time.time() when the shard before ended

    def where(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "setup_s": round(self.setup_s, 2),
                "device": self.device, "dtype": self.dtype, "start_error": self.start_error, "models": self.models}

    def run_shard(self, shard: Shard, attempt: str, lock_token: str | None = None) -> dict:
        """Run one shard to its committed output (or its failure marker) as attempt `attempt`, under
        the driver's lock that carries `lock_token` (the commit reads the lock and refuses, a
        StorageError, once it was taken over or its lease ran out); its summary as a dict, its rows'
        id hashes, and whether it started before the shard ahead of it ended. The call for the next
        shard comes while one runs (a threaded actor, SHARDS_PER_ACTOR): it reads and tokenizes its
        first window at once, then waits its turn."""
        begun = self.runner.start([shard])
        with self.turn:
            started = time.perf_counter()
            started_early = begun.started_at < self.last_run_ended
            sink = ShardSink(self.config.output, self.config.source.storage_options, attempt)
            manifest = RunManifest(sink.fs, sink.output_dir)
            if lock_token:
                manifest.follow_lock(lock_token)
            summary = RunSummary(shards=1, output=self.config.output)
            ids = IdTracker()
            try:
                self.runner.run([shard], sink, manifest, summary, started, ids, begun)
            finally:
                self.last_run_ended = time.time()
            summary.wall_s = time.perf_counter() - started
        return {"summary": dataclasses.asdict(summary), "id_hashes": ids.hashes(),
                "committed": bool(sink.committed), "started_early": started_early}


def run_on_ray(config: RunConfig) -> RunSummary:
    """`lengthwise run --engine ray`: connect, settle the actors' device and dtype (each model's) from the
    cluster, claim the output here, run the pending shards on actors."""
    ray = import_ray()
    with ray_connection(ray, config.ray_address):
        choose_one = functools.partial(choose_on_cluster, ray.cluster_resources())
        if config.models:
            return run_model_set(config, WorkerSlot(), prepare_actors,
                                 functools.partial(choose_models, choose_one=choose_one))
        return run_claimed(config, WorkerSlot(), prepare_actors, functools.partial(choose_here, choose_one=choose_one))


@contextmanager
def ray_connection(ray, address: str | None):
    """Connected to Ray (unless this process already is) for the block; disconnected after if
    connected here. Ray installs its own SIGINT/SIGTERM handlers; ours stop the run cleanly."""
    connected_here = not ray.is_initialized()
    logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)  # its token-auth notice is not ours to print
    if connected_here:
        handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        if threading.current_thread() is threading.main_thread():
            for number, handler in handlers.items():
                signal.signal(number, handler)
    try:
        yield
    finally:
        if connected_here:
            ray.shutdown()


def prepare_actors(config: RunConfig, choice: ModelChoice | ModelSetChoice, todo: list[Shard], clock=None,
                   carry: Carry | None = None):
    """Nothing to load on the driver: the actors load the model, or models (the max length was
    checked against each architecture in `choose_model`), and each settles --compile auto from the
    cached verdict on its own device; their setup is in the summary's actor lines, not on the
    driver's `clock`. `carry`: a change of models, handed to every actor."""
    return functools.partial(run_on_actors, config, choice, carry=carry), config


def run_on_actors(config: RunConfig, choice: ModelChoice | ModelSetChoice, todo: list[Shard], sink: ShardSink,
                  manifest: RunManifest, summary: RunSummary, started: float, carry: Carry | None = None) -> None:
    """The Ray engine: hand `todo` to actors, then remove what attempts whose actor died left behind; several
    models: the summary's `models` says what each settled on the actors."""
    ray = import_ray()
    pool = ActorPool(ray, actors_config(config, choice), len(todo), carry)
    pool.run(todo, sink, manifest, summary, config.progress)
    if config.models:
        summary.models = pool.models
    sink.remove_stale_temporaries([shard.stem for shard in todo])
    remove_stale_hash_temporaries(manifest, [shard.stem for shard in todo])
    summary.dtype_reason = choice.dtype_reason  # the driver's choice; the actors were handed its result
    wall_s = time.perf_counter() - started
    summary.rows_per_s = summary.rows / wall_s
    summary.tokens_per_s = summary.real_tokens / wall_s


class ActorLayout(NamedTuple):
    count: int  # actors
    options: dict  # Ray resources of each: num_gpus, num_cpus
    threads: int | None  # torch threads per actor
    tokenize_workers: int  # tokenizer processes per actor (0: in the actor's process)
    note: str = ""  # why fewer actors than --workers asked for


def actor_layout(config: RunConfig, nodes: list[dict], shards: int) -> ActorLayout:
    """One actor per GPU with num_gpus=1 and its share of its node's CPUs (node CPUs / GPUs,
    the smallest share over the GPU nodes) and torch threads 1 unless --threads-per-worker; or
    CPU actors of --threads-per-worker CPUs each where there are no GPUs. The tokenizer pool is
    the share less the CPU the actor's own loop runs on (`actor_tokenize_workers`). Never more actors than shards, nor
    than the nodes can place at once: Ray would hold the others back until one ends, and an
    actor never ends. `nodes`: each live node's resources."""
    gpu_nodes = [node for node in nodes if int(node.get("GPU", 0))]
    on_gpu = bool(gpu_nodes) and config.model.device != "cpu"
    if on_gpu:
        share = min(int(node.get("CPU", 0)) // int(node["GPU"]) for node in gpu_nodes)
        fits, unit = sum(int(node["GPU"]) for node in gpu_nodes), "GPU(s)"
        options, threads = {"num_gpus": 1, "num_cpus": share}, config.threads_per_worker or 1
    else:
        share = threads = config.threads_per_worker or 1
        fits, unit = max(1, sum(int(node.get("CPU", 0)) // threads for node in nodes)), f"slot(s) of {threads} CPU(s)"
        options = {"num_cpus": threads}
    workers, note = config.workers or fits, ""
    if workers > fits:
        note = f"--workers {workers} is more than the cluster's {fits} {unit}; running {fits} actor(s)"
        workers = fits
    return ActorLayout(min(workers, shards), options, threads, actor_tokenize_workers(config, share, on_gpu), note)


def actor_tokenize_workers(config: RunConfig, share: int, on_gpu: bool) -> int:
    """An actor's tokenizer processes from its share of its node's CPUs: --tokenize-workers, at
    most the share less the core the actor's own loop runs on; auto: that ceiling on a CPU, and
    on a GPU the share less the CUDA host threads, as a local run (`tokenize_workers_for`)."""
    if config.tokenize_workers is not None:
        return max(0, min(config.tokenize_workers, share - 1))
    return max(0, share - (CUDA_HOST_THREADS if on_gpu else 1))


class ActorPool:
    """K shard actors fed longest shard first; an actor that dies is replaced and its shard
    retried, within the budgets; every hand-out is a fenced attempt."""

    def __init__(self, ray, config: RunConfig, shards: int, carry: Carry | None = None):
        self.ray, self.carry = ray, carry
        layout = actor_layout(config, [node["Resources"] for node in ray.nodes() if node["Alive"]], shards)
        if layout.note:
            log.warning(layout.note)
        self.count, self.options, self.threads = layout.count, layout.options, layout.threads
        # one bar, the driver's; a tokenizer pool from the actor's share of its node's CPUs
        self.config = config.with_settings(progress=False, tokenize_workers=layout.tokenize_workers,
                                           torch_threads=layout.threads)
        self.recorded_dtypes = said_dtypes(settled_dtypes(self.config))  # what every actor must run in
        self.actor_class = ray.remote(ShardWorker).options(max_restarts=0, max_task_retries=0,
                                                           max_concurrency=SHARDS_PER_ACTOR, **self.options)
        self.replacements_left = self.count * MAX_SHARD_ATTEMPTS
        self.actors: dict = {}  # actor slot → its current actor
        self.generation: collections.Counter = collections.Counter()  # actor slot → actors launched in it
        self.starting: dict = {}  # object ref of `where` → actor slot, while its model loads
        self.start_errors: dict[str, int] = {}  # a Python exception from loading the model → actors it stopped
        self.last_death = ""
        self.run_token = uuid.uuid4().hex[:8]  # this driver's attempts: RUN.1, RUN.2, …
        self.attempts_made = 0
        self.where: dict[int, dict] = {}  # actor slot → pid, host, setup time
        self.models: dict[str, dict] = {}  # what each model settled on the actors (`open_shard_runner`)
        self.stats = collections.defaultdict(lambda: {"shards": 0, "rows": 0, "busy_s": 0.0, "forward_s": 0.0,
                                                      "started_early": 0})

    def _launch(self, slot: int) -> None:
        self.generation[slot] += 1
        self.actors[slot] = self.actor_class.remote(self.config, self.carry)
        self.starting[self.actors[slot].where.remote()] = slot

    def _replace(self, slot: int, why: str) -> None:
        """Start another actor in `slot`, unless the run's replacements are spent."""
        self.last_death = why
        self.replacements_left -= 1
        if self.replacements_left >= 0:
            self._launch(slot)
        else:
            log.warning(f"actor {slot} is not replaced: the run's {self.count * MAX_SHARD_ATTEMPTS} actor "
                        f"replacements are spent")

    def _started(self, ref) -> int | None:
        """The slot whose actor has loaded its model, or None when it could not (it is replaced).
        The same Python exception in two actors is a usage error: a bad model folder or setting."""
        slot = self.starting.pop(ref)
        try:
            where = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as error:  # killed while loading: node lost, OOM, preempted
            log.warning(f"actor {slot} died while loading the model ({first_line(error)}); starting another")
            self._replace(slot, f"died while loading the model: {first_line(error)}")
            return None
        load_error = where.pop("start_error")
        if load_error:
            self.ray.kill(self.actors[slot])
            self.start_errors[load_error] = self.start_errors.get(load_error, 0) + 1
            if self.start_errors[load_error] >= 2:
                raise UsageError(f"the Ray actors could not load the model: {load_error}")
            log.warning(f"actor {slot} could not load the model ({load_error}); trying another actor")
            self._replace(slot, f"could not load the model: {load_error}")
            return None
        recorded = self.recorded_dtypes
        if (where["device"].split(":")[0], where["dtype"]) != (self.config.model.device, recorded):
            for actor in self.actors.values():
                self.ray.kill(actor)
            raise UsageError(f"Ray actor {slot} on {where['host']} runs on {where['device']} in {where['dtype']}, "
                             f"not {self.config.model.device} in {recorded} as the output records; "
                             "set --device and --dtype")
        self.models = where.pop("models")
        self.where[slot] = where
        log.info(f"actor {slot}: pid {where['pid']} on {where['host']}, model loaded in {where['setup_s']}s")
        return slot

    def _dispatch(self, slot: int, shard: Shard, manifest: RunManifest, running: dict) -> None:
        """Grant `shard` to a new attempt (the fence), then hand it to the actor in `slot` (its next
        shard, if it runs one: it starts reading and tokenizing it at once). A driver that lost its
        lock grants nothing more: its grant would fence out the attempts of the run that took it over."""
        manifest.check_lock_held()
        self.attempts_made += 1
        token = f"{self.run_token}.{self.attempts_made}"
        manifest.grant_attempt(shard.stem, token)
        log.info(f"actor {slot} (pid {self.where[slot]['pid']}) took {shard.url} (attempt {token})")
        running[self.actors[slot].run_shard.remote(shard, token, manifest.lock_token())] = (
            slot, self.generation[slot], shard)

    def run(self, todo: list[Shard], sink: ShardSink, manifest: RunManifest, summary: RunSummary,
            progress: bool) -> None:
        ray = self.ray
        log.info(f"ray: {len(todo)} shard(s) on {self.count} actor(s) ({self.options})")
        queue = collections.deque(sorted(todo, key=lambda shard: shard.num_rows, reverse=True))
        attempts: collections.Counter = collections.Counter()
        ids, committed = IdTracker(), []
        for slot in range(self.count):
            self._launch(slot)
        held: dict[int, int] = {}  # slot of a loaded actor → the shards in its hands
        running: dict = {}  # object ref → (actor slot, its actor's generation, shard)
        bar = tqdm(total=sum(shard.num_rows for shard in todo), unit="rows", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True, smoothing=0.1)
        try:
            while queue or running:
                # every actor one shard first, then its next one (least held first)
                while queue and held and min(held.values()) < SHARDS_PER_ACTOR:
                    shard, slot = queue.popleft(), min(held, key=held.get)
                    attempts[shard.stem] += 1
                    held[slot] += 1
                    self._dispatch(slot, shard, manifest, running)
                if not running and not self.starting:  # every actor died and none may replace it
                    self._fail_left(queue, manifest, summary)
                    break
                finished = wait_for_one(ray, [*self.starting, *running])
                if finished in self.starting:
                    if (started := self._started(finished)) is not None:
                        held[started] = 0
                    continue
                slot, generation, shard = running.pop(finished)
                current = generation == self.generation[slot]  # not a shard of an actor replaced already
                try:
                    result = ray.get(finished)
                except ray.exceptions.RayActorError as error:
                    self._lost(slot, shard, attempts, queue, manifest, summary, error)
                    if current:  # its other shard comes back lost too, and finds the slot replaced
                        held.pop(slot, None)
                        self._replace(slot, f"died running {shard.url}: {first_line(error)}")
                    continue
                except ray.exceptions.RayTaskError as error:  # not a bad shard: storage, a bug or a bad setting
                    if isinstance(error.cause, StorageError):
                        raise StorageError(str(error.cause)) from None
                    raise RuntimeError(f"{shard.url} raised on actor {slot}: {error}") from error
                merge_summary(summary, result["summary"])
                ids.add_hashes(result["id_hashes"])
                if result["committed"]:
                    committed.append(output_paths(sink.output_dir, shard.stem)[0])
                stats = self.stats[slot]
                stats["shards"] += 1
                stats["rows"] += result["summary"]["rows"]
                stats["busy_s"] += result["summary"]["wall_s"]  # the actor's own time on the shard
                stats["forward_s"] += result["summary"]["stage_s"].get("forward", 0.0)
                stats["started_early"] += result["started_early"]
                bar.update(shard.num_rows)
                held[slot] -= 1
        finally:
            bar.close()
            for actor in self.actors.values():
                ray.kill(actor)  # an interrupt stops the actors too; their temporaries are cleaned up
        summary.duplicate_ids, summary.duplicate_id_examples = ids.duplicates(sink.fs, committed)
        summary.workers = [{"actor": slot, **self.where[slot], **stats,
                            "rows_per_s": round(stats["rows"] / stats["busy_s"], 2) if stats["busy_s"] else 0.0,
                            "device_busy_fraction": round(stats["forward_s"] / stats["busy_s"], 3)
                            if stats["busy_s"] else 0.0}
                           for slot, stats in sorted(self.stats.items())]
        # over the actors' own time on their shards, and their model loading as the setup
        busy_s = sum(stats["busy_s"] for stats in self.stats.values())
        summary.device_busy_fraction = sum(s["forward_s"] for s in self.stats.values()) / busy_s if busy_s else 0.0
        summary.stage_s["setup"] = round(sum(self.where[slot]["setup_s"] for slot in self.stats), 3)

    def _lost(self, slot, shard, attempts, queue, manifest, summary, error) -> None:
        """An actor died with `shard` in hand: hand it out again, or fail it after the last attempt."""
        if attempts[shard.stem] < MAX_SHARD_ATTEMPTS:
            log.warning(f"actor {slot} (pid {self.where[slot]['pid']}) died running {shard.url}; handing the shard "
                        f"to another actor (attempt {attempts[shard.stem] + 1} of {MAX_SHARD_ATTEMPTS})")
            queue.appendleft(shard)
            return
        reason = f"its Ray actor died {MAX_SHARD_ATTEMPTS} times: {type(error).__name__}"
        manifest.mark(shard.stem, "failed", input=shard.url, error=reason)
        summary.failed_shards.append({"shard": shard.url, "error": reason})

    def _fail_left(self, queue, manifest, summary) -> None:
        """No actor is left to run the queued shards: fail them (a rerun retries them)."""
        reason = (f"no Ray actor left to run it: the run's {self.count * MAX_SHARD_ATTEMPTS} actor replacements are "
                  f"spent (last: {self.last_death})")
        log.warning(f"{reason}; {len(queue)} shard(s) not run")
        for shard in queue:
            manifest.mark(shard.stem, "failed", input=shard.url, error=reason)
            summary.failed_shards.append({"shard": shard.url, "error": reason})
        queue.clear()


def wait_for_one(ray, refs: list):
    """The first of `refs` to finish. A signal handler that raises (SIGTERM → the CLI's
    Interrupted) while Ray waits comes out of Ray's wait as a SystemError caused by it: raise the
    interruption itself, so the run stops as it does anywhere else (exit 143/130)."""
    try:
        return ray.wait(refs, num_returns=1)[0][0]
    except SystemError as error:
        if error.__cause__ is not None and not isinstance(error.__cause__, Exception):
            raise error.__cause__ from None
        raise


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def merge_summary(total: RunSummary, part: dict) -> None:
    """Add one shard's summary to the run's: counts add up, lists extend, the rest is kept
    (duplicate ids are counted across shards from the actors' id hashes, not added up)."""
    for name in ("rows", "error_rows", "truncated_rows", "batches", "real_tokens", "padded_tokens", "oom_splits",
                 "reused_rows", "computed_rows", "deduplicated_rows", "split_rows", "segments",
                 "truncated_unflagged_rows"):
        setattr(total, name, getattr(total, name) + part[name])
    total.failed_shards.extend(part["failed_shards"])
    total.reuse = add_counts([total.reuse, part["reuse"]])
    total.reuse_warning = total.reuse_warning or part["reuse_warning"]
    if part["flagged_rows"] is not None:  # job moderate
        total.flagged_rows = (total.flagged_rows or 0) + part["flagged_rows"]
        for label, rows in part["flagged_by_label"].items():
            total.flagged_by_label[label] = total.flagged_by_label.get(label, 0) + rows
    for name, seconds in part["stage_s"].items():
        total.stage_s[name] = round(total.stage_s.get(name, 0.0) + seconds, 3)
    total.lowered_batch_rows.update(part["lowered_batch_rows"])
    for name in ("peak_rss_bytes", "peak_device_bytes"):  # of the largest actor
        setattr(total, name, max(getattr(total, name), part[name]))
    for reason, rows in part["error_reasons"].items():
        total.error_reasons[reason] = total.error_reasons.get(reason, 0) + rows
    for name, length in part["token_lengths"].items():  # the largest shard's percentile: an upper bound
        total.token_lengths[name] = max(total.token_lengths.get(name, 0), length)
    total.padding_efficiency = padding_efficiency(total.real_tokens, total.padded_tokens)
    for name in ("batch_setting", "batch_plan", "device", "dtype", "dtype_reason", "model", "settings",
                 "sweep_reference", "long_text", "compile", "compile_s", "compiled_graphs", "unpad"):
        setattr(total, name, part[name])
