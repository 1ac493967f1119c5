"""The baseline engine: each block and tag's self K/V are a list of tensors, one per stored run of contiguous frames.

Appending a chunk stores its tensors as they are (no copy); attention reads ``[cached runs | current chunk]`` with
one concatenation per call. With a sliding window, evicted frames are dropped (a run that loses part of its frames
is replaced by a copy of what is kept), so memory stays flat. Simple and exact;
:class:`~fastgen_diffusers.kv_cache.StaticKVCacheEngine` removes the per-call concatenation. The storage is
:class:`~fastgen_diffusers.kv_cache.storage.ChunkListStorage`.
"""

from __future__ import annotations

from .base import BaseKVCacheEngine
from .storage import ChunkListStorage


class VanillaKVCacheEngine(BaseKVCacheEngine):
    """List-of-runs self cache and dense cross cache (exported as ``KVCacheEngine``).

    Args: the options of :class:`BaseKVCacheEngine` (window, sink, key positions, sink rule, storage dtype); an 8-bit
    ``kv_cache_dtype`` quantizes each stored run once and dequantizes it at every read.
    """

    storage_class = ChunkListStorage


KVCacheEngine = VanillaKVCacheEngine
