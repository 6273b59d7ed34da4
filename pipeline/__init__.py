"""lengthwise: offline batch inference over Parquet shards with length-bucketed batches."""

__version__ = "0.1.0"
