"""Everything that depends on which device runs the model: choice, dtype, collate, prefetch.

The CPU path runs the same code as CUDA; only `DeviceFeeder` (pinned memory and a copy
stream on CUDA) and the memory measurement differ.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import traceback

import torch

from pipeline.core.errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` is the current CUDA device when there is one, else the CPU. A CUDA device always
    carries its index (`cuda` is `cuda:N`, N the current device): `torch.cuda.set_device` and
    `set_per_process_memory_fraction` refuse a device without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"unknown device {name!r}; set --device to auto, cpu or cuda[:N]") from error
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name} asked for CUDA but torch sees no GPU; use --device cpu")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s), cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}; set --device cuda or one of those")
    return device


def gpu_auto_dtype(compute_capability: tuple[int, int]) -> str:
    """bfloat16 from Ampere (compute capability 8.0) on, where it is native; float16 before,
    where torch emulates bfloat16 slowly even though it says it is supported."""
    return "bfloat16" if compute_capability >= (8, 0) else "float16"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU from Ampere on (float16 before), else float32 (on the CPU
    the model setup may then measure its way to bfloat16: see `pipeline.runtime.model.choose_cpu_dtype`)."""
    if name == "auto":
        if device.type == "cuda":
            return DTYPES[gpu_auto_dtype(torch.cuda.get_device_capability(device))]
        return torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; set --dtype to auto, {', '.join(DTYPES)}")
    return DTYPES[name]


NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")  # CPU flags whose bf16 matmuls oneDNN runs natively


def native_bf16_feature(cpu_flags: str | None = None) -> str | None:
    """The CPU feature that runs bf16 natively (amx_bf16, avx512_bf16) when torch's oneDNN
    uses it, else None. Without one, bf16 is emulated: 5x slower than fp32 on an AVX2-only CPU (docs/performance.md)."""
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                cpu_flags = next((line for line in cpuinfo if line.startswith("flags")), "")
        except OSError:
            cpu_flags = ""
    flags = set(cpu_flags.split())
    feature = next((name for name in NATIVE_BF16_FEATURES if name in flags), None)
    return feature if feature and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def allocator_config() -> str:
    """The CUDA caching allocator's configuration in effect, read from torch once CUDA has started
    ("" before: nothing is in effect yet, and the CPU path never uses it). Not the variable's
    text: it is read once when CUDA starts, so a caller that started CUDA before importing
    lengthwise runs without it, and torch 2.9 ignored PYTORCH_ALLOC_CONF for CUDA."""
    if not torch.cuda.is_initialized():
        return ""
    read_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch ≥ 2.9
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":  # cudaMallocAsync has no segments, and memory_snapshot() raises under it
        return describe_allocator(backend, read_settings() if read_settings else None, None)
    segments = torch.cuda.memory_snapshot()
    return describe_allocator(backend, read_settings() if read_settings else None,
                              any(segment.get("is_expandable") for segment in segments) if segments else None)


def describe_allocator(backend: str, settings: str | None, expandable_segments: bool | None) -> str:
    """One line for the plan key and the environment report: the allocator backend, the
    settings torch parsed, and whether the segments it holds are expandable (None: it holds
    none yet, so cannot tell; or the backend is not the caching allocator, which alone has them)."""
    seen = {True: "yes", False: "no", None: "none held yet"}[expandable_segments]
    if backend != "native":
        seen = f"not used by {backend}"
    return f"{backend}; settings {settings if settings is not None else 'unknown'}; expandable segments {seen}"


def padding_multiple(device: torch.device) -> int:
    """What a batch's padded length is rounded up to. On a GPU, multiples of 8: tensor-core
    friendly shapes, and few distinct shapes for the kernels to settle on. On the CPU aligned
    shapes buy nothing, so a batch pads only to its own longest row (on short comments the
    8-token step left 15% of the computed tokens padding)."""
    return 8 if device.type == "cuda" else 1


def dtype_name(dtype: torch.dtype) -> str:
    """`float32`, `bfloat16`, …: how fingerprints, plan keys and summaries name a dtype."""
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    """What a cached plan or a sweep recommendation was measured on: the GPU model, or the
    CPU and the thread count torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}threads"


def available_memory_bytes(device: torch.device, budget_bytes: int | None, reserve_fraction: float) -> int:
    """Bytes the batches may use. An explicit budget wins on any device. On CUDA: free device
    memory (after the model is loaded) minus a reserve of the total; on CPU: half of the
    RAM available now, in whole GiB so that the plan cache key stays stable."""
    if budget_bytes is not None:
        return int(budget_bytes)
    step = 2**30
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # free inside the allocator
        usable = free + cached - reserve_fraction * total
        return int(usable) // step * step
    import psutil

    return max(step, int(psutil.virtual_memory().available * 0.5) // step * step)


def _read_proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def measure_peak_bytes(run, device: torch.device, since_bytes: int | None = None) -> float:
    """Peak memory that `run()` adds on `device`, measured so that each call starts afresh.

    CUDA: the caching allocator's peak above where it stood before (reset per call): the peak
    reserved above reserved-before (what the device must really hold: fragmentation
    included), or allocated above allocated-before if larger; plus what grew outside the
    allocator (cuBLAS/cuDNN workspaces).
    CPU (Linux): the process's peak resident set (VmHWM) above `since_bytes` (a
    `resident_bytes()` read before the first forward) or, without it, above its resident set
    before the call; freed heap memory is first returned to the OS (malloc_trim) and the peak
    is reset through /proc/self/clear_refs, so earlier calls do not hide or inflate this one; the
    collection `resident_bytes` runs stays here, since garbage freed during `run()` would drop the
    resident set below an uncollected baseline.
    """
    if device.type == "cuda":  # no gc.collect(): garbage earlier calls left is in the before and the peak figures
        # alike, so their difference leaves it out (a full collection per measurement cost ~15 s of a GPU lease)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before, reserved_before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        run()
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        reserved_after = torch.cuda.memory_reserved(device)
        outside_allocator = (free_before - free_after) - (reserved_after - reserved_before)
        within_allocator = max(torch.cuda.max_memory_allocated(device) - allocated_before,
                               torch.cuda.max_memory_reserved(device) - reserved_before)
        return float(within_allocator + max(0, outside_allocator))
    before = resident_bytes()
    if not reset_peak_rss():
        raise RuntimeError(NEEDS_PROC)
    run()
    return float(_read_proc_status_kib("VmHWM") - (before if since_bytes is None else since_bytes))


NEEDS_PROC = ("measuring CPU peak memory needs Linux's /proc/self/clear_refs; give --memory-budget and --no-probe, "
              "or run on Linux")


def resident_bytes() -> int:
    """The process's resident set after garbage is collected and freed heap memory went back to
    the OS (malloc_trim): a baseline that later collections do not lower."""
    gc.collect()
    _release_free_heap()
    try:
        return _read_proc_status_kib("VmRSS")
    except OSError as error:
        raise RuntimeError(NEEDS_PROC) from error


@contextlib.contextmanager
def garbage_frozen(device: torch.device):
    """On CPU: collect garbage once, then keep every object alive now out of later collections
    (gc.freeze) for the block, so the collection `resident_bytes` runs per measurement scans only
    what the block made. A full collection of a process holding torch and transformers takes about
    0.2 s; a CPU probe measures a dozen times per model. Left as is where something else froze objects."""
    if device.type != "cpu" or gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current one; False if the OS
    cannot (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The process's peak resident set since start or the last reset_peak_rss; 0 if unknown."""
    try:
        return _read_proc_status_kib("VmHWM")
    except (OSError, RuntimeError):
        return 0


def _glibc():
    """The C library if it is glibc (its malloc tunables exist), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _release_free_heap() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, from glibc's malloc.h
HOST_MMAP_THRESHOLD_BYTES = 32 * 2**20  # the largest value glibc accepts on every 64-bit version
HOST_TRIM_THRESHOLD_BYTES = 2**30


def keep_freed_host_memory(device: torch.device) -> bool:
    """On the CPU, let glibc keep the memory a forward pass frees for the next one.

    By default glibc serves large blocks with mmap and gives the heap top back to the kernel
    once a (self-adjusting) threshold of it is free, so every batch's activations were faulted
    in again page by page: 4.1 million minor page faults and ~10% of the run time on 1,500 imdb
    rows at 2,048 tokens per batch (26.2 → 29.7 rows/s with fixed thresholds). Resident memory
    then stays near the largest batch's peak, which the memory plan already bounds. Returns
    whether the setting was applied (CPU device and glibc only).
    """
    libc = _glibc() if device.type == "cpu" else None
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD_BYTES))


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or a CPU allocation that failed."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and ("can't allocate memory" in str(error)
                                                or "out of memory" in str(error).lower())


def release_cached_memory(device: torch.device, error: BaseException) -> None:
    """After an out-of-memory `error` (call it inside the `except`): drop what the failed attempt
    still references and return the allocator's free blocks to the device. The locals of the
    traceback's finished frames hold its tensors, and a frame that caught and re-raised the error
    holds the error itself: a cycle that only a full collection would find, about 0.1 s each time
    in a real run, once per split. Clearing those frames frees the tensors at once; the cycle left
    behind holds none."""
    traceback.clear_frames(error.__traceback__)
    if device.type == "cuda":
        torch.cuda.empty_cache()
