"""lengthwise: offline batch inference over Parquet shards with length-bucketed batches."""

import os
from importlib import metadata

__version__ = "0.1.0"

CUDA_ALLOCATOR_SETTING = "expandable_segments:True"
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch ≥ 2.9's name first, then the old one


def _allocator_variable() -> str:
    """torch reads PYTORCH_ALLOC_CONF from 2.9 on (PYTORCH_CUDA_ALLOC_CONF before, deprecated since)."""
    try:
        major, minor = (int(part) for part in metadata.version("torch").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return ALLOCATOR_VARIABLES[1]
    return ALLOCATOR_VARIABLES[0] if (major, minor) >= (2, 9) else ALLOCATOR_VARIABLES[1]


# Set before torch starts CUDA (it reads the variable once): expandable segments let the caching
# allocator grow one mapping instead of reserving a block per batch shape, so what a run reserves
# stays near what it allocates and the memory plan's budget holds across many shapes. A setting
# of the user's own wins.
if not set(ALLOCATOR_VARIABLES) & set(os.environ):
    os.environ[_allocator_variable()] = CUDA_ALLOCATOR_SETTING
