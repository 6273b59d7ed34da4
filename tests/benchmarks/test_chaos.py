"""The chaos soak's short version (benchmarks/chaos.py): a real job SIGKILLed at seeded random moments (the
driver, a tokenizer process, the whole process group), restarted until it exits 0, loses no row, duplicates
none, keeps every value within the tolerance of an uninterrupted run, passes `verify` and leaves nothing
behind. The long soak and its figures: docs/operations.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_four_random_kills_lose_nothing_and_leave_nothing(tmp_path, tiny_encoder_path):
    chaos = load_chaos()
    report = chaos.soak(kills=4, rows=600, shards=8, model=tiny_encoder_path, engine="local", seed=3,
                        workdir=tmp_path, extra=["--tokenize-workers", "1", "--max-batch-rows", "8"])
    assert report["kills_total"] == 4 and report["restarts"] >= 4
    assert (report["lost_rows"], report["duplicated_rows"], report["rows_out_of_order"]) == (0, 0, 0)
    assert report["over_tolerance"] == 0 and report["max_abs_difference"] <= chaos.TOLERANCE
    assert report["verify_failures"] == 0
    assert report["left_behind"] == {"temporaries": 0, "locks": 0, "processes": 0}
    assert sum(report["kills"].values()) == 4 and all(n["exit_codes"][-1] == 0 for n in report["per_night"])
    assert len([kind for kind, count in report["kills"].items() if count]) >= 2, report["kills"]  # not one kind only
