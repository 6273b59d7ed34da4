"""`moderate`'s options of `lengthwise run` (`pair` takes them too: it flags as `moderate` does), declared
by the job and torch-free, so that the run's option table (`pipeline.offline.options`) takes them in
without loading a job. What they become: `ModerateJob.options` (jobs/moderate.py)."""

from __future__ import annotations

from pipeline.core import values
from pipeline.core.options import Option
from pipeline.core.settings import ModelSettings

MODERATE_OPTIONS: dict[str, Option] = {  # in the order `lengthwise run --help` lists them
    # LABEL=SCORE pairs; a TOML [thresholds] table
    "threshold": Option(values.Text(), multiple=True,
        help="--job moderate: LABEL=SCORE flags LABEL when its score is at least SCORE. Repeatable; in the --config "
             "file a [thresholds] table, which a flag overrides label by label."),
    "default_threshold": Option(values.Number(0, 1), ModelSettings.default_threshold,
        help="--job moderate: the threshold of every flag label without a --threshold."),
    "flag_labels": Option(values.Names(),
        help="--job moderate: the labels that can flag a row, comma-separated. Default: all labels of a multi-label "
             "(sigmoid) model; a single-label (softmax) model needs it (e.g. all but `normal`)."),
}
