"""The online dynamic batcher: requests arriving one by one, batched by size or timeout."""
