"""A run of several models (docs/jobs.md "Several models, one pass"): their tables checked, each model's
one-model config, what an output made by them records, and the `models` object of the summary.

Each model's settings are the run's model settings with its table's keys over them, so that a run-wide
--dtype or --compile holds for every model that does not set its own. The rows are read, deduplicated,
reused and tokenized once: the models must tokenize alike (one tokenizer, max length and long-text mode;
`pipeline.runtime.model_set.choose_model_set` checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


RUN_WIDE = ("id_column", "text_column", "pair_column", "keep_columns", "max_length", "long_text", "segment_length")
# the keys of a model's fingerprint that are the run's: every model holds the same, and a change of one is a change
# of the rows or their tokens, which no model's columns survive


@dataclass(frozen=True)
class ModelChange:
    """How this run's models differ from those an output's done shards were made with (`source`, a run
    fingerprint): `kept` models (same settings) have their columns carried from those shards, `computed`
    ones (added, or settings changed) run on every row, `dropped` ones lose their columns."""

    source: dict
    kept: tuple[str, ...]
    computed: tuple[str, ...]
    dropped: tuple[str, ...]

    def describe(self) -> str:
        """`models changed since OUTPUT was made: embed added; toxicity changed (computed); spam kept (carried); …`"""
        parts = [f"{', '.join(names)} {said}" for names, said in (
            (self.computed, "computed for every row (added or changed)"),
            (self.kept, "kept (columns carried)"), (self.dropped, "removed (columns dropped)")) if names]
        return "; ".join(parts)


def run_wide(fingerprint: dict) -> list[dict]:
    """The run-wide part of each model's fingerprint."""
    return [{key: each.get(key) for key in RUN_WIDE} for each in recorded_models(fingerprint).values()]


def model_change(recorded_run: dict | None, fingerprint: dict) -> ModelChange | None:
    """The change of models a rerun into the same output makes, or None where it is none (the output is new or
    of one model, every model is as recorded, no model is kept, or a run-wide setting differs: then what was
    recorded and what is asked differ as any settings do). `recorded_run`: run.json; a rerun resuming a change
    finds its source under `carried_from`."""
    if recorded_run is None or "models" not in fingerprint:
        return None
    source = recorded_run["fingerprint"]
    if source == fingerprint:
        source = recorded_run.get("carried_from")
    if not source or "models" not in source or set(map(repr, run_wide(source))) != set(map(repr, run_wide(fingerprint))):
        return None
    before, now = recorded_models(source), recorded_models(fingerprint)
    kept = tuple(name for name in now if before.get(name) == now[name])
    if not kept:
        return None
    return ModelChange(source, kept, tuple(name for name in now if name not in kept),
                       tuple(name for name in before if name not in now))


def models_summary(config: RunConfig, computed_rows: int, reused_rows: int, by_label: dict,
                   opened: Mapping[str, dict], carried_rows: int = 0, computed: tuple[str, ...] = ()) -> dict:
    """The summary's `models` object: per model its job, rows computed and reused by this run, and (a
    moderating model) rows flagged and per label; `opened`: what each model's runtime settled (dtype, compile).
    A change of models (`ModelChange`): a kept model's `carried_rows` count as reused, a `computed` model's as
    computed."""
    summary = {}
    for name, settings in config.models.items():
        job = settings.get("job", config.model.job)
        carried = 0 if name in computed else carried_rows
        entry = {"job": job, "computed_rows": computed_rows - carried, "reused_rows": reused_rows + carried,
                 **opened.get(name, {})}
        if job == "moderate":
            prefix = f"{name}:"
            entry["flagged_rows"] = by_label.get(name, 0)
            entry["flagged_by_label"] = {key[len(prefix):]: count for key, count in by_label.items()
                                         if key.startswith(prefix)}
        summary[name] = entry
    return summary
