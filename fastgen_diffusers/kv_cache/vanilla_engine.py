"""The baseline engine: each self entry is a list of chunk K/V tensors plus the cached token count.

Appending a chunk stores its tensors as they are (no copy); attention reads ``[cached chunks | current chunk]`` with
one concatenation per call. Simple and exact; :class:`~fastgen_diffusers.kv_cache.StaticKVCacheEngine` removes the
per-call concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import BaseKVCacheEngine, TagState


@dataclass
class VanillaSelfEntry:
    """Self-attention K/V of one block and tag: one ``(B, frames*S, H, D)`` tensor per stored chunk."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    chunk_starts: list[int] = field(default_factory=list)
    len: int = 0  # cached tokens

    def num_chunks_before(self, start_frame: int) -> int:
        return sum(1 for s in self.chunk_starts if s < start_frame)


class VanillaKVCacheEngine(BaseKVCacheEngine):
    """List-of-chunks self cache and dense cross cache (exported as ``KVCacheEngine``)."""

    def _new_self_entry(self, state: TagState, max_frames: int | None) -> VanillaSelfEntry:
        return VanillaSelfEntry()

    def get_self_prefix(self, block_idx: int, cache_tag: str, start_frame: int):
        entry: VanillaSelfEntry = self._self_kv[block_idx][cache_tag]
        count = entry.num_chunks_before(start_frame)
        if count == 0:
            return None
        if count == 1:
            return entry.keys[0], entry.values[0]
        return torch.cat(entry.keys[:count], dim=1), torch.cat(entry.values[:count], dim=1)

    def self_attention_kv(self, block_idx, cache_tag, key, value, start_frame):
        entry: VanillaSelfEntry = self._self_kv[block_idx][cache_tag]
        count = entry.num_chunks_before(start_frame)
        if count == 0:
            return key, value
        return torch.cat([*entry.keys[:count], key], dim=1), torch.cat([*entry.values[:count], value], dim=1)

    def append_self_kv(self, block_idx, cache_tag, key, value, start_frame):
        entry: VanillaSelfEntry = self._self_kv[block_idx][cache_tag]
        self._truncate_self_entry(entry, self._tags[cache_tag], start_frame)
        entry.keys.append(key.detach())
        entry.values.append(value.detach())
        entry.chunk_starts.append(start_frame)
        entry.len += key.shape[1]

    def _truncate_self_entry(self, entry: VanillaSelfEntry, state: TagState, end_frame: int) -> None:
        count = entry.num_chunks_before(end_frame)
        del entry.keys[count:], entry.values[count:], entry.chunk_starts[count:]
        entry.len = sum(k.shape[1] for k in entry.keys)

    def _copy_self_entry(self, entry: VanillaSelfEntry) -> VanillaSelfEntry:
        # Stored chunk tensors are never written in place, so a fork can share them.
        return VanillaSelfEntry(list(entry.keys), list(entry.values), list(entry.chunk_starts), entry.len)

    def _self_entry_tensors(self, entry: VanillaSelfEntry) -> list[torch.Tensor]:
        return [*entry.keys, *entry.values]


KVCacheEngine = VanillaKVCacheEngine
