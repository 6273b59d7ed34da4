"""lengthwise: offline batch inference over Parquet shards with length-bucketed batches."""

import os
from importlib import metadata

__version__ = "0.1.0"

CUDA_ALLOCATOR_SETTING = "expandable_segments:True"


def _allocator_variable() -> str:
    """torch reads PYTORCH_ALLOC_CONF from 2.9 on (PYTORCH_CUDA_ALLOC_CONF before, deprecated since)."""
    try:
        major, minor = (int(part) for part in metadata.version("torch").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return "PYTORCH_CUDA_ALLOC_CONF"
    return "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 9) else "PYTORCH_CUDA_ALLOC_CONF"


# Set before torch starts CUDA (it reads the variable once): expandable segments let the caching
# allocator grow one mapping instead of reserving a block per batch shape, so what a run reserves
# stays near what it allocates and the memory plan's budget holds across many shapes. A setting
# of the user's own wins.
if not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ):
    os.environ[_allocator_variable()] = CUDA_ALLOCATOR_SETTING
