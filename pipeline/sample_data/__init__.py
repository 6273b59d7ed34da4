"""400 docstrings of the Python standard library in two Parquet shards (README.md here says how
they were picked): the demo's input, shipped as package data so that `lengthwise run --demo`
works from an installed wheel, without the source checkout."""

from pathlib import Path

SAMPLE_DIR = str(Path(__file__).resolve().parent)  # its *.parquet files are the shards
