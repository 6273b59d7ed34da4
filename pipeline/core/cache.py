"""The one keyed cache under ~/.cache/lengthwise: memory plans, dtype and compile verdicts, sweep
recommendations and model content hashes, each a JSON file holding the key it was made for."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir(plan_cache: str | None) -> Path:
    """--plan-cache, else ~/.cache/lengthwise/plans (under $XDG_CACHE_HOME when set)."""
    if plan_cache:
        return Path(plan_cache)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "lengthwise", "plans")


def read_keyed(path: Path, key: dict) -> dict | None:
    """The record saved at `path` if it was made for exactly `key`; None when missing,
    unreadable or made for other settings (the caller measures again)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def write_keyed(path: Path, key: dict, record: dict) -> str:
    """Save `record` with the key it was made for, atomically; the path written."""
    write_text_atomically(Path(path), json.dumps({**record, "key": key}, indent=2, default=str) + "\n")
    return str(path)


def model_memory_fingerprint(model_path: str) -> str:
    """What decides a model's memory use and speed: its config and the sizes of its weight files
    (retrained weights of the same shape reuse the memory plan and sweep recommendations; what
    depends on the weights' values, the dtype and compile verdicts, is keyed by
    `model_content_hash`)."""
    digest = hashlib.sha256()
    folder = Path(model_path)
    digest.update((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


CONTENT_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".bin")  # config, tokenizer and weight files


def model_content_files(folder: Path) -> list[Path]:
    """What decides a model's outputs: the config, tokenizer and weight files at the top of the
    folder (modules.json: normalisation; config_sentence_transformers.json: prompts) and the
    config.json of its sentence-transformers modules (1_Pooling/config.json: the pooling)."""
    top = [p for p in folder.iterdir() if p.is_file() and p.suffix in CONTENT_SUFFIXES]
    return sorted(top + list(folder.glob("*/config.json")))


def file_identity(path: Path) -> list[int]:
    """What changes when a file is written: size, mtime, ctime (set by the kernel on every
    write, even one that restores the mtime), inode and device (a replaced or copied file)."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def hash_files(folder: Path, files: list[Path]) -> str:
    """sha256 over each file's name (relative to `folder`) and bytes, in order."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:24]


def model_content_hash(model_path: str, plan_cache: str | None = None) -> str:
    """The hash of the model's content (`model_content_files`): the output fingerprint and the
    key of every verdict that depends on the weights' values. Read from the plan cache while
    every file has the identity it had when hashed (`file_identity`); hashed again otherwise
    (a touched file gets the same hash back). MiniLM's 90 MB: docs/performance.md."""
    folder = Path(model_path)
    files = model_content_files(folder)
    identity = {"folder": str(folder.resolve()),
                "files": [[p.relative_to(folder).as_posix(), *file_identity(p)] for p in files]}
    record = cache_dir(plan_cache) / "content" / f"{hashlib.sha256(identity['folder'].encode()).hexdigest()[:20]}.json"
    cached = read_keyed(record, identity)
    if cached and isinstance(cached.get("sha256"), str):
        return cached["sha256"]
    content = hash_files(folder, files)
    if [[p.relative_to(folder).as_posix(), *file_identity(p)] for p in files] == identity["files"]:
        try:  # not while a file changed under the hash: the next run hashes again
            write_keyed(record, identity, {"sha256": content})
        except OSError as error:
            log.debug(f"model content hash not cached ({error}); the next run hashes the model again")
    return content


def runtime_versions() -> dict:
    """The software that decides memory use and speed besides the settings: torch (its kernels),
    CUDA, transformers (its attention and mask code), lengthwise, and the CUDA allocator's
    configuration (expandable segments change what is reserved)."""
    import torch
    import transformers

    from pipeline import __version__
    from pipeline.core.device import allocator_config

    return {"lengthwise": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "allocator": allocator_config()}


def plan_cache_key(**settings) -> tuple[dict, str]:
    """The settings a cached plan, dtype choice or recommendation depends on, with the runtime
    versions, and a short hash of them (the cache file name)."""
    key = {**settings, **runtime_versions()}
    return key, hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def write_text_atomically(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename, so concurrent readers never see
    half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temp.write_text(text)
    os.replace(temp, path)
