"""The Ray actors' device and dtype, settled on the driver from the cluster's resources (not the driver's own
hardware), and checked against what each actor loaded: every actor runs what the output's fingerprint records."""

from __future__ import annotations

import dataclasses
import logging

from pipeline.core.device import DTYPES, dtype_name, gpu_auto_dtype
from pipeline.core.errors import UsageError
from pipeline.core.settings import ModelSettings
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import model_configs
from pipeline.offline.model_set_setup import ONE_MODEL
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.model_set import ModelSetChoice

log = logging.getLogger(__name__)

PRE_AMPERE_GPUS = frozenset({"K80", "M60", "P4", "P40", "P100", "V100", "T4"})  # Ray's accelerator_type names


def actor_device_and_dtype(device: str, dtype: str, cluster: dict) -> tuple[str, str | None, str]:
    """(device, dtype, why) of the actors, from the cluster's resources rather than the driver's
    own hardware: a CPU-only head (KubeRay's `num-gpus: "0"`) must neither put GPU actors in
    float32 nor refuse --device cuda. Every actor gets the same explicit dtype, so the output
    fingerprint recorded here holds for all of them. dtype None: CPU actors, whose `auto` the
    driver settles as a local run does."""
    gpus = int(cluster.get("GPU", 0))
    if device == "cpu" or not gpus:
        if device.startswith("cuda"):
            raise UsageError(f"--device {device}: the Ray cluster has no GPU; use --device cpu or auto")
        return "cpu", None, ""
    if device not in ("auto", "cuda"):
        raise UsageError(f"--device {device} names one GPU, but each Ray actor has a GPU of its own; "
                         "use --device cuda or auto")
    if dtype != "auto":
        return "cuda", dtype, f"{dtype}: --dtype"
    kinds = sorted(name.removeprefix("accelerator_type:") for name in cluster if name.startswith("accelerator_type:"))
    older = [kind for kind in kinds if kind in PRE_AMPERE_GPUS]
    if older and len(older) < len(kinds):
        raise UsageError(f"the Ray cluster mixes GPUs before Ampere ({', '.join(older)}) with later ones "
                         f"({', '.join(k for k in kinds if k not in older)}), whose --dtype auto differ; "
                         "set --dtype float16 or bfloat16")
    chosen = gpu_auto_dtype((7, 0) if older else (8, 0))
    return "cuda", chosen, f"{chosen}: the default on the cluster's GPUs ({', '.join(kinds) or 'type not reported'})"


def choose_on_cluster(cluster: dict, settings: ModelSettings, plan_cache: str | None, dtype_source: str | None = None,
                      trial_texts=None) -> ModelChoice:
    """A model's choice (`choose_model`'s arguments) with the device and dtype its actors will run
    in (see `actor_device_and_dtype`); everything else is settled on the driver as for a local run
    (on CPUs the bf16 trial runs on `trial_texts()`)."""
    device, dtype, reason = actor_device_and_dtype(settings.device, settings.dtype, cluster)
    if device == "cpu":
        return choose_model(dataclasses.replace(settings, device="cpu"), plan_cache, dtype_source, trial_texts)
    import torch

    # the driver needs no GPU
    choice = choose_model(dataclasses.replace(settings, device="cpu", dtype="float32"), plan_cache)
    log.info(f"actors: dtype {reason}")
    return dataclasses.replace(choice, device=torch.device("cuda"), dtype=DTYPES[dtype], dtype_reason=reason)


def actors_config(config: RunConfig, choice: ModelChoice | ModelSetChoice) -> RunConfig:
    """The config every actor runs: on the device type and in the dtype (each model's) that the output's
    fingerprint records, whatever its node would pick."""
    if isinstance(choice, ModelSetChoice):
        return config.with_settings(device=choice.device.type, models={
            name: {**config.models[name], "dtype": dtype_name(each.dtype)} for name, each in choice.choices.items()})
    return config.with_settings(device=choice.device.type, dtype=dtype_name(choice.dtype))


def settled_dtypes(config: RunConfig) -> dict[str, str]:
    """The dtype of each model of `config`, by name (ONE_MODEL for a one-model run)."""
    if config.models:
        return {name: each.model.dtype for name, each in model_configs(config).items()}
    return {ONE_MODEL: config.model.dtype}


def said_dtypes(dtypes: dict[str, str]) -> str:
    """`float32` for one model; `toxicity float32, embed bfloat16` for several."""
    if set(dtypes) == {ONE_MODEL}:
        return dtypes[ONE_MODEL]
    return ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
