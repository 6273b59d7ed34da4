#!/usr/bin/env bash
# Same rows, two commits, alternating rounds: does a change make `lengthwise run` faster or slower?
#   benchmarks/compare_commits.sh OLD_REF NEW_REF INPUT [ROUNDS]
# e.g. benchmarks/compare_commits.sh 7c6ae69 main ../shared/data/tweets/shard-00000.parquet 3
# Each commit is checked out into a temporary worktree and run with this checkout's .venv, in
# bfloat16 and float32, with --no-probe --max-batch-tokens 2048 (no probe time in the figure).
# Prints: round, commit, dtype, rows/s, forward seconds, rows.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2 input=$(realpath "$3") rounds=${4:-3}
python=$(pwd)/.venv/bin/python
scratch=$(mktemp -d)
trap 'git worktree remove --force "$scratch/old" 2>/dev/null; git worktree remove --force "$scratch/new" 2>/dev/null; rm -rf "$scratch"' EXIT
git worktree add -q --detach "$scratch/old" "$old"
git worktree add -q --detach "$scratch/new" "$new"
for round in $(seq "$rounds"); do
  for tree in old new; do
    for dtype in bfloat16 float32; do
      out="$scratch/out-$tree-$dtype-$round"
      (cd "$scratch/$tree" && HF_HUB_OFFLINE=1 PYTHONPATH="$scratch/$tree" "$python" -m pipeline.cli run \
          --input "$input" --output "$out" --dtype "$dtype" --no-probe --max-batch-tokens 2048 \
          --max-batch-rows 512 --no-progress --quiet --summary-json "$out.json" > /dev/null)
      "$python" -c "import json; s = json.load(open('$out.json')); \
print($round, '$tree', '$dtype', round(s['rows_per_s'], 1), round(s['stage_s']['forward'], 2), s['rows'])"
    done
  done
done
