"""The batch job: shards in (fsspec, pyarrow), windows, the shard runner, atomic per-shard
outputs, the manifest and locks, the summary and its diagnosis."""
