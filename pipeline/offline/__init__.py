"""The batch job: its settings, shards in (fsspec, pyarrow), windows, the shard runner, atomic
per-shard outputs, the output's claim, the manifest and locks, the summary and its diagnosis."""
