"""The process heap: handing the pages of dropped models back to the operating system.

A module of its own (torch only) so loaders, pipelines, the trainer, the ComfyUI nodes and the demo
can all call it without importing one another.
"""

from __future__ import annotations

import torch


def release_freed_memory() -> None:
    """Collect garbage, hand freed heap pages back to the OS and empty CUDA's cache.

    Called after a large part of a model is dropped (the text encoder after encoding, a replaced
    pipeline). glibc keeps freed blocks under its mmap threshold (which rises to 32 MiB as large
    tensors come and go) in the heap: measured on the random full-width text encoder, 0.83 GiB stays
    resident after it is dropped until ``malloc_trim`` returns it, and the 12.8B transformer then
    loads on top of it. Elsewhere than glibc the trim is skipped (the pages are reused either way).
    """
    import gc

    gc.collect()
    trim_heap()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    Cheap (no garbage collection): the streamed loaders call it after each block, whose freed
    full-precision matrices would otherwise stay resident in holes between the packed weights
    kept since (see ``release_freed_memory``)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
HELD_CHUNK_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit)."""
HELD_FREE_BYTES = 1 << 30
"""Free memory at the top of a heap that glibc keeps instead of handing back at each ``free``."""
USER_MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def hold_freed_chunks() -> bool:
    """Keep the heap's freed blocks for reuse instead of handing them back to the OS after each use
    (glibc's ``mallopt``: mmap threshold 32 MiB, trim threshold 1 GiB; elsewhere nothing). Returns
    whether it changed anything.

    The quantized layers expand their weights a few MiB at a time (quantization/chunked_linear.py),
    thousands of times a step. With glibc's dynamic thresholds those blocks came and went: a freed
    block at the top of a heap above the trim threshold was handed back, and the next one faulted
    its pages in again, zeroed by the kernel. A full-size fp8 LoRA step on this CPU faulted in 6.5
    million pages in its backward (19 s of system time): 191.7 s a step, 135.6 s with these settings
    and 728 faults, the same peak (bench/full_size.py). The explicit trims (:func:`trim_heap`,
    :func:`release_freed_memory`) still hand everything free back. Entry points call it once, before
    loading (``krea2 generate / expand / train / posttrain / pretrain``, the demo); the library's
    classes never change the process's allocator. ``MALLOC_*`` variables set by the user win."""
    import ctypes
    import os

    if any(name in os.environ for name in USER_MALLOC_ENVIRONMENT):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HELD_CHUNK_BYTES)) & bool(libc.mallopt(M_TRIM_THRESHOLD, HELD_FREE_BYTES))
    except (OSError, AttributeError):
        return False
