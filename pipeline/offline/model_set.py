"""A run of several models (docs/jobs.md "Several models, one pass"): their tables checked, each model's
one-model config, what an output made by them records, and the `models` object of the summary.

Each model's settings are the run's model settings with its table's keys over them, so that a run-wide
--dtype or --compile holds for every model that does not set its own. The rows are read, deduplicated,
reused and tokenized once: the models must tokenize alike (one tokenizer, max length and long-text mode;
`pipeline.runtime.model_set.choose_model_set` checks it).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.core.errors import UsageError
from pipeline.core.settings import long_text_mode
from pipeline.offline.config import RunConfig

MODEL_KEYS = ("job", "model", "max_length", "prompt", "prompt_name", "thresholds", "default_threshold",  # a table's
              "flag_labels", "dtype", "compile", "unpad", "allow_pickle", "trust_remote_code")
NOT_YET = ("pair",)  # jobs a run of several models does not take yet: a pair reads a second input column


def model_tables(tables: Mapping[str, dict], options: Mapping) -> dict[str, dict]:
    """Each model's table with its values checked as the flags' are (`options`: the run options by name);
    a key no model setting has, an unknown job or a bad value is a UsageError naming the model."""
    from jobs.registry import JOBS  # here: the options import this module without torch

    checked = {}
    for name, table in tables.items():
        unknown = sorted(set(table) - set(MODEL_KEYS))
        if unknown:
            raise UsageError(f"models.{name}: unknown key(s) {', '.join(unknown)}; a model's table takes "
                             f"{', '.join(MODEL_KEYS)} (the run's other settings are for every model)")
        settings = {}
        for key, value in table.items():
            try:
                settings[key] = thresholds_of(value) if key == "thresholds" else options[key].kind.parse(value)
            except ValueError as error:
                raise UsageError(f"models.{name}.{key}: {error}") from None
        if settings.get("model") in ("", "default"):
            settings["model"] = None  # the packaged all-MiniLM-L6-v2, as --model default
        job = settings.get("job", "embed")
        if job not in JOBS:
            raise UsageError(f"models.{name}: unknown job {job!r}; set job to one of: {', '.join(sorted(JOBS))}")
        if job in NOT_YET:
            raise UsageError(f"models.{name}: job {job} is not yet supported in a run of several models; run it "
                             "on its own")
        checked[name] = settings
    return checked


def thresholds_of(value) -> dict[str, float]:
    """A model table's `thresholds = {label = score, …}`."""
    if not isinstance(value, Mapping) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value.values()):
        raise ValueError("takes a table of label = score, e.g. {toxic = 0.8}")
    return {str(label): float(score) for label, score in value.items()}


def check_model_flags(models: dict, model: str | None, thresholds: dict, flag_labels) -> None:
    """A run of several models names each model, its thresholds and flag labels in its table only."""
    if not models:
        return
    for flag, given in (("--model", model), ("--threshold", thresholds), ("--flag-labels", flag_labels)):
        if given:
            raise UsageError(f"{flag} and a [models] table both set it: give each model's in its table "
                             f"({', '.join(models)}) and drop {flag}")


def model_configs(config: RunConfig) -> dict[str, RunConfig]:
    """Each model's one-model config: the run's, with its table's settings over the run's model settings."""
    configs = {name: config.with_settings(**settings, models={}) for name, settings in config.models.items()}
    lengths = {name: each.model.max_length for name, each in configs.items()}
    if len(set(lengths.values())) > 1:
        listed = " and ".join(f"{name} ({length or 'the folder default'})" for name, length in lengths.items())
        raise UsageError(f"models {listed} take different --max-length; the models of one run share one "
                         "tokenization (a current limit): give them one max_length, or run them separately")
    modes = {name: long_text_mode(each.long_rows.long_text, each.model.job) for name, each in configs.items()}
    if len(set(modes.values())) > 1:
        listed = ", ".join(f"{name} ({mode})" for name, mode in modes.items())
        raise UsageError(f"--long-text {config.long_rows.long_text} treats long rows differently for {listed}; the "
                         "models of one run share one tokenization (a current limit): set --long-text split or "
                         "truncate for the run")
    return configs


def recorded_models(fingerprint: dict | None) -> dict[str, dict]:
    """What each model of a recorded fingerprint was made with ({} for a one-model output)."""
    return (fingerprint or {}).get("models", {})


def keep_recorded_model_choices(config: RunConfig, fingerprint: dict | None, recorded_config: dict | None) -> RunConfig:
    """`keep_recorded_choices` for several models: a model whose --dtype or --compile is auto keeps what
    the output (or the --reuse output) was made with, and --long-text auto the run's."""
    from pipeline.core.device import DTYPES

    models = {name: dict(settings) for name, settings in config.models.items()}
    for name, recorded in recorded_models(fingerprint).items():
        if name not in models:
            continue
        if models[name].get("dtype", config.model.dtype) == "auto" and recorded.get("dtype") in DTYPES:
            models[name]["dtype"] = recorded["dtype"]
        compiled = ((recorded_config or {}).get("models") or {}).get(name, {}).get("compile")
        if models[name].get("compile", config.model.compile) == "auto" and compiled in ("on", "off"):
            models[name]["compile"] = compiled
    changes = {"models": models}
    first = next(iter(recorded_models(fingerprint).values()), None)
    if config.long_rows.long_text == "auto" and first is not None:
        changes["long_text"] = first.get("long_text", "truncate")
    return config.with_settings(**changes)


def models_summary(config: RunConfig, computed_rows: int, reused_rows: int, by_label: dict,
                   opened: Mapping[str, dict]) -> dict:
    """The summary's `models` object: per model its job, rows computed and reused by this run, and (a
    moderating model) rows flagged and per label; `opened`: what each model's runtime settled (dtype, compile)."""
    summary = {}
    for name, settings in config.models.items():
        job = settings.get("job", config.model.job)
        entry = {"job": job, "computed_rows": computed_rows, "reused_rows": reused_rows, **opened.get(name, {})}
        if job == "moderate":
            prefix = f"{name}:"
            entry["flagged_rows"] = by_label.get(name, 0)
            entry["flagged_by_label"] = {key[len(prefix):]: count for key, count in by_label.items()
                                         if key.startswith(prefix)}
        summary[name] = entry
    return summary
