"""Two nights of a snapshot export, for measuring `--reuse` (docs/operations.md, "a realistic night"):
    python benchmarks/reuse_night.py SOURCE_DIR ROWS_PER_SHARD ROOT
Night 1 (ROOT/night1/dt=2026-11-29/part-0000N.parquet): the first ROWS_PER_SHARD rows (id, text) of each
Parquet file of SOURCE_DIR. Night 2 (ROOT/night2/dt=2026-11-30/part-0000N-<uuid>.parquet, Spark-style names):
5% of the texts edited, 1% of the rows deleted, 2% new rows (texts from the rest of SOURCE_DIR), 10% moved
to the next shard. Seeded: the same nights every time."""
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

source_dir, rows_per_shard, root = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
rng = np.random.default_rng(31)
source = sorted(source_dir.glob("*.parquet"))
tables = [pq.read_table(p, columns=["id", "text"]) for p in source]
night1 = [t.slice(0, rows_per_shard).to_pylist() for t in tables]
spare = [row for t in tables for row in t.slice(rows_per_shard).to_pylist()]
for i, rows in enumerate(night1):
    (root / "night1/dt=2026-11-29").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), root / f"night1/dt=2026-11-29/part-{i:05d}.parquet")
total = sum(map(len, night1))
night2 = [list(rows) for rows in night1]
flat = [(s, r) for s, rows in enumerate(night2) for r in range(len(rows))]
picks = rng.permutation(len(flat))
n_edit, n_del, n_move, n_new = round(0.05 * total), round(0.01 * total), round(0.10 * total), round(0.02 * total)
edit, delete, move = (picks[:n_edit], picks[n_edit:n_edit + n_del], picks[n_edit + n_del:n_edit + n_del + n_move])
for k in edit:
    s, r = flat[k]
    night2[s][r] = {**night2[s][r], "text": night2[s][r]["text"] + " (edited)"}
gone = {flat[k] for k in delete} | {flat[k] for k in move}
moved = [(flat[k][0], night2[flat[k][0]][flat[k][1]]) for k in move]
night2 = [[row for r, row in enumerate(rows) if (s, r) not in gone] for s, rows in enumerate(night2)]
for s, row in moved:
    night2[(s + 1) % len(night2)].append(row)
for j, row in enumerate(spare[:n_new]):
    night2[j % len(night2)].insert(int(rng.integers(0, len(night2[j % len(night2)]))),
                                   {"id": f"new/{j}", "text": row["text"]})
(root / "night2/dt=2026-11-30").mkdir(parents=True, exist_ok=True)
for i, rows in enumerate(night2):
    pq.write_table(pa.Table.from_pylist(rows), root / f"night2/dt=2026-11-30/part-{i:05d}-{uuid.uuid4()}.parquet")
print(f"night1 {total} rows; night2 {sum(map(len, night2))} rows: {n_edit} edited, {n_del} deleted, {n_new} new, "
      f"{n_move} moved")
