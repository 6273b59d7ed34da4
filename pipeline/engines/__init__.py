"""Who runs the shard runner: this process, worker I of N, or Ray actors. Engines move shard
lists and summaries only."""
