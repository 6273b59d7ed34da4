"""The one keyed cache under ~/.cache/lengthwise: memory plans, dtype verdicts and sweep
recommendations, each a JSON file holding the key it was made for."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


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
    """What decides a model's memory use: its config and the sizes of its weight files
    (retrained weights of the same shape reuse the plan)."""
    digest = hashlib.sha256()
    folder = Path(model_path)
    digest.update((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


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
