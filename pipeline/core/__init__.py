"""The stages every product shares: buckets, tokenizer pool, device and dtype, the one model
setup, the memory formula and probe, the shared forward, the one keyed cache, batch settings.
Knows nothing of files, engines, the online batcher, tuning or the CLI."""
