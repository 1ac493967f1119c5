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

VanillaSelfEntry = ChunkListStorage  # the storage of one block and tag (its former name)


class VanillaKVCacheEngine(BaseKVCacheEngine):
    """List-of-runs self cache and dense cross cache (exported as ``KVCacheEngine``).

    Args:
        window_frames: sliding attention window in latent frames (see :class:`BaseKVCacheEngine`); ``None`` keeps
            every frame.
        sink_frames: first frames kept for ever inside the window.
        rope_positions, sink_update, sink_decay: window-relative RoPE and the EMA sink (see
            :class:`BaseKVCacheEngine`; keyword-only).
        kv_cache_dtype: ``None`` or 8-bit storage (``torch.float8_e4m3fn``, ``torch.int8``): each stored run is
            quantized once and dequantized at every read (see :class:`BaseKVCacheEngine`).
    """

    storage_class = ChunkListStorage


KVCacheEngine = VanillaKVCacheEngine
