"""A run's batch limits: a number given, else (`auto`) the sweep's saved recommendation for this
model, device and dtype, else the device's default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.core.settings import SWEEP_VARIES, BatchSettings


def recommendation_key(model_fingerprint: str, job: str, device: str, dtype: str, max_length: int,
                       split_length: int | None, vary: str) -> tuple[dict, str]:
    """What a recommendation holds for: the same model shape, job, device, dtype, max length, long
    rows (`split_length`: the segment length of a run that splits them, None: truncated) and varied
    setting (and lengthwise version); and the file name it is saved under."""
    from pipeline.core.cache import plan_cache_key

    return plan_cache_key(kind="sweep", model=model_fingerprint, job=job, device=device, dtype=dtype,
                          max_length=max_length, long_rows="truncate" if split_length is None
                          else f"split {split_length}", vary=vary)


def recommendation_path(plan_cache: str | None, name: str) -> Path:
    from pipeline.core.cache import cache_dir

    return cache_dir(plan_cache) / f"sweep-{name}.json"


def load_recommendation(plan_cache: str | None, name: str, key: dict) -> dict | None:
    """The saved recommendation for exactly this key, or None."""
    from pipeline.core.cache import read_keyed

    path = recommendation_path(plan_cache, name)
    saved = read_keyed(path, key)
    if saved is None or not isinstance(saved.get("level"), int):
        return None
    return {**saved, "path": str(path)}


def resolve_batch_setting(batch: BatchSettings, device_type: str, saved_for: dict[str, dict | None] | None = None,
                          fields: tuple[str, ...] = ("max_batch_tokens", "max_batch_rows"),
                          model_config=None) -> tuple[BatchSettings, str]:
    """The one `auto` resolver: replace each of `fields` that is None (`auto`) in `batch` by the saved
    sweep recommendation for this model, device, dtype and max length (`saved_for`:
    `saved_recommendations`), else by the device's default
    (`device_batch_limit`: on CUDA the token budget follows `model_config`'s size). Returns the
    settings and where each limit came from. Rows above MAX_BATCH_ROWS become that many, said so."""
    from pipeline.core.settings import MAX_BATCH_ROWS, device_batch_limit

    changes, notes = {}, []
    for name in fields:
        vary, value = name.replace("_", "-"), getattr(batch, name)
        if value is not None:
            notes.append(f"--{vary} {value}")
            continue
        saved = (saved_for or {}).get(vary)
        if saved is not None:
            changes[name] = saved["level"]
            notes.append(f"--{vary} {saved['level']} recommended by the sweep of {saved['created']} ({saved['path']})")
        else:
            changes[name] = device_batch_limit(device_type, name, model_config)
            notes.append(f"--{vary} {changes[name]} (auto: no sweep recommendation for this model, device and dtype; "
                         f"the {device_type} default)")
    rows = changes.get("max_batch_rows", batch.max_batch_rows) if "max_batch_rows" in fields else None
    if rows is not None and rows > MAX_BATCH_ROWS:
        changes["max_batch_rows"] = MAX_BATCH_ROWS
        notes.append(f"rows capped at {MAX_BATCH_ROWS:,} (CUDA's grid limit, which the attention kernels' batch "
                     f"dimension meets)")
    return dataclasses.replace(batch, **changes), "; ".join(notes)


def saved_recommendations(plan_cache: str | None, job: str, max_length: int, split_length: int | None,
                          model_path: str, device_key: str, model) -> dict[str, dict | None]:
    """The saved recommendation (or None) per varied setting, for this model, job, device,
    dtype, max length and long rows (`recommendation_key`)."""
    from pipeline.core.cache import model_memory_fingerprint
    from pipeline.core.device import dtype_name

    dtype = dtype_name(next(model.parameters()).dtype)
    fingerprint = model_memory_fingerprint(model_path)
    saved = {}
    for vary in SWEEP_VARIES:
        key, file_name = recommendation_key(fingerprint, job, device_key, dtype, max_length, split_length,
                                             vary)
        saved[vary] = load_recommendation(plan_cache, file_name, key)
    return saved


def sweep_reference(saved_for: dict[str, dict | None]) -> dict:
    """The newest saved recommendation that records its throughput, as the run summary's
    `sweep_reference` (what the diagnosis compares the run's throughput with); {} if none."""
    figures = [{"vary": vary, "level": saved["level"], "rows_per_s": saved["rows_per_s"],
                "tokens_per_s": saved["tokens_per_s"], "created": saved["created"], "path": saved["path"]}
               for vary, saved in saved_for.items() if saved and saved.get("tokens_per_s")]
    return max(figures, key=lambda figure: figure["created"], default={})
