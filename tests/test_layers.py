"""The house's plan, held by tests: each layer of `pipeline/` imports only layers below it,
and the pure parts import without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower first. A module may import its own layer and those below it, never one above.
LAYERS = {"pipeline": 0, "pipeline.core": 0, "pipeline.sample_data": 0, "jobs": 1, "pipeline.runtime": 2,
          "pipeline.offline": 3, "pipeline.online": 3, "pipeline.engines": 4, "pipeline.tuning": 5,
          "pipeline.cli": 6, "pipeline.api": 6, "pipeline.integrations": 6}
SIDE_BY_SIDE = {("pipeline.offline", "pipeline.online"), ("pipeline.online", "pipeline.offline"),  # neither knows the other
                ("pipeline.cli", "pipeline.api"), ("pipeline.api", "pipeline.cli"),  # the API builds settings itself, never through click
                # a scheduler runs the `lengthwise` command as a child process: it imports neither the CLI nor the API
                ("pipeline.integrations", "pipeline.cli"), ("pipeline.integrations", "pipeline.api")}


def layer_of(module: str) -> str:
    """The layer (package) a dotted module name belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    raise KeyError(module)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every pipeline/jobs module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ("pipeline", "jobs")}


SOURCES = sorted(p for folder in ("pipeline", "jobs") for p in (ROOT / folder).rglob("*.py"))


def test_no_layer_imports_a_layer_above_it_or_beside_it():
    wrong = []
    for path in SOURCES:
        here = layer_of(module_name(path))
        for imported in imports_of(path):
            there = layer_of(imported)
            if LAYERS[there] > LAYERS[here] or (here, there) in SIDE_BY_SIDE:
                wrong.append(f"{module_name(path)} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_layers_are_few_and_no_module_is_over_500_lines():
    assert len(set(LAYERS.values())) <= 7
    long = {module_name(p): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 500}
    assert not long


@pytest.mark.parametrize("module", ["pipeline.core.buckets", "pipeline.core.clock", "pipeline.core.memory", "pipeline.core.units",
                                    "pipeline.core.collate", "pipeline.offline.windows",  # what builds batches
                                    "pipeline.offline.producer", "pipeline.offline.feeder",  # and where
                                    "pipeline.core.findings", "pipeline.offline.diagnosis",
                                    "pipeline.offline.manifest", "pipeline.tuning.diagnosis", "pipeline.tuning.levels",
                                    "pipeline.online.rules", "pipeline.online.batcher", "pipeline.cli",
                                    "pipeline.offline.reuse", "pipeline.tuning.estimate",
                                    "pipeline.core.exit_codes", "pipeline.tuning.report", "pipeline.core.values",
                                    "pipeline.offline.options", "pipeline.api", "pipeline.integrations.commands",
                                    "pipeline.tuning.options", "jobs.moderate_options"])
def test_imports_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, '{module} imported torch'"
    completed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
