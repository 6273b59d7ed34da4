"""The stages every product shares: the settings groups, buckets, tokenizer pool, device and dtype,
the memory formula and probe, the shared forward, the one keyed cache, batch settings. Knows
nothing of jobs, the model setup (`pipeline.runtime`), files, engines, the online batcher, tuning
or the CLI."""
