"""The model engine: weights, the transformer, KV cache, sampling, speculative decoding.

oneDNN, and ideep (torch's layer above it), keep a compiled kernel per weight shape and row count
a packed linear layer meets, up to 1024 each by default. A prefill of each of 120 prompt lengths
left 311 MB that malloc_trim could not give back; 126 MB with 256 (bench/prefill_memory.py). meshllm holds
KERNEL_CACHE_SIZE of each (the row counts a decode batch walks through stay cached); a kernel
rebuilt is the same kernel, so outputs do not change. The caches are sized when first used, so
this runs before any of the engine's torch work; a value already in the environment wins.
"""

import os

KERNEL_CACHE_SIZE = "256"
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, KERNEL_CACHE_SIZE)
