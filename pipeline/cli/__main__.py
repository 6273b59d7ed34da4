"""`python -m pipeline.cli`: the same as the `lengthwise` command."""

from pipeline.cli import main

main()
