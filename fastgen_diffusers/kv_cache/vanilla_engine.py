"""The baseline engine: each self entry is a list of K/V tensors, one per stored run of contiguous frames.

Appending a chunk stores its tensors as they are (no copy); attention reads ``[cached runs | current chunk]`` with
one concatenation per call. With a sliding window, evicted frames are dropped (a run that loses part of its frames
is replaced by a copy of what is kept), so memory stays flat. Simple and exact;
:class:`~fastgen_diffusers.kv_cache.StaticKVCacheEngine` removes the per-call concatenation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .base import BaseKVCacheEngine
from .quantize import QuantizedFrames, stored_tensors
from .tags import TagState


@dataclass
class VanillaSelfEntry:
    """Self-attention K/V of one block and tag: ``keys[i]``/``values[i]`` ``(B, frames*S, H, D)`` hold the contiguous
    frames that start at ``starts[i]`` (ascending); :class:`QuantizedFrames` under ``kv_cache_dtype``."""

    keys: list[torch.Tensor | QuantizedFrames] = field(default_factory=list)
    values: list[torch.Tensor | QuantizedFrames] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    def runs(self, frame_seqlen: int):
        """``(start, end, key, value)`` of every stored run of frames."""
        for start, key, value in zip(self.starts, self.keys, self.values):
            yield start, start + key.shape[1] // frame_seqlen, key, value

    def replace(self, runs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self.starts = [start for start, _, _ in runs]
        self.keys = [key for _, key, _ in runs]
        self.values = [value for _, _, value in runs]


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

    def _new_self_entry(self, state: TagState, max_frames: int | None) -> VanillaSelfEntry:
        return VanillaSelfEntry()

    def _frame_pieces(self, entry: VanillaSelfEntry, state: TagState, ranges):
        seqlen = state.frame_seqlen
        keys, values = [], []
        for run_start, run_end, key, value in entry.runs(seqlen):
            for low, high in ranges:
                first, last = max(low, run_start), min(high, run_end)
                if first >= last:
                    continue
                piece_key, piece_value = key, value
                if (first, last) != (run_start, run_end):
                    tokens = slice((first - run_start) * seqlen, (last - run_start) * seqlen)
                    piece_key, piece_value = key[:, tokens], value[:, tokens]
                keys.append(self._decode_kv(piece_key, state))
                values.append(self._decode_kv(piece_value, state))
        return keys, values

    def append_self_kv(self, block_idx, cache_tag, key, value, start_frame):
        entry: VanillaSelfEntry = self._self_kv[block_idx][cache_tag]
        state = self._tags[cache_tag]
        end_frame = start_frame + key.shape[1] // state.frame_seqlen
        self._truncate_self_entry(entry, state, start_frame)
        kept = self._store_window(state, start_frame, end_frame)
        self._evict_self_entry(entry, state, state.evicted_before)
        for first, last in kept:
            if (first, last) == (start_frame, end_frame):
                run_key, run_value = key.detach(), value.detach()
            else:
                tokens = slice((first - start_frame) * state.frame_seqlen, (last - start_frame) * state.frame_seqlen)
                run_key, run_value = key[:, tokens].detach().clone(), value[:, tokens].detach().clone()
            entry.keys.append(self._encode_kv(run_key, state))
            entry.values.append(self._encode_kv(run_value, state))
            entry.starts.append(first)

    def _truncate_self_entry(self, entry: VanillaSelfEntry, state: TagState, end_frame: int) -> None:
        # A run stored by a multi-chunk call may straddle a chunk boundary: its kept part is copied (a view would pin
        # the dropped frames).
        runs = []
        for run_start, run_end, key, value in entry.runs(state.frame_seqlen):
            if run_start >= end_frame:
                break
            if run_end > end_frame:
                tokens = (end_frame - run_start) * state.frame_seqlen
                key, value = key[:, :tokens].clone(), value[:, :tokens].clone()
            runs.append((run_start, key, value))
        entry.replace(runs)

    def _evict_self_entry(self, entry: VanillaSelfEntry, state: TagState, before: int) -> None:
        sink = self.window.sink
        if before <= sink:
            return
        seqlen = state.frame_seqlen
        runs = []
        for run_start, run_end, key, value in entry.runs(seqlen):
            if run_end <= sink or run_start >= before:
                runs.append((run_start, key, value))
                continue
            # keep the sink part and the part from `before` on, as copies (a view would pin the evicted frames)
            for first, last in ((run_start, min(run_end, sink)), (max(run_start, before), run_end)):
                if first < last:
                    tokens = slice((first - run_start) * seqlen, (last - run_start) * seqlen)
                    runs.append((first, key[:, tokens].clone(), value[:, tokens].clone()))
        entry.replace(runs)

    def _replace_sink(self, entry: VanillaSelfEntry, state: TagState, key: torch.Tensor, value: torch.Tensor) -> None:
        # new run tensors, never an in-place write: a transaction's snapshot (the run lists) restores the old sink
        seqlen = state.frame_seqlen
        frames = key.shape[1] // seqlen
        runs = [(0, self._encode_kv(key, state), self._encode_kv(value, state))]
        for run_start, run_end, run_key, run_value in entry.runs(seqlen):
            if run_end <= frames:
                continue
            if run_start < frames:
                tokens = slice((frames - run_start) * seqlen, None)
                run_key, run_value, run_start = run_key[:, tokens].clone(), run_value[:, tokens].clone(), frames
            runs.append((run_start, run_key, run_value))
        entry.replace(runs)

    def _rotate_self_entry(
        self, entry: VanillaSelfEntry, state: TagState, rotate: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        entry.keys = [self._encode_kv(rotate(self._decode_kv(key, state)), state) for key in entry.keys]

    def _copy_self_entry(self, entry: VanillaSelfEntry) -> VanillaSelfEntry:
        # Stored run tensors are never written in place, so a fork can share them.
        return VanillaSelfEntry(list(entry.keys), list(entry.values), list(entry.starts))

    def _self_entry_tensors(self, entry: VanillaSelfEntry) -> list[torch.Tensor]:
        return [t for stored in (*entry.keys, *entry.values) for t in stored_tensors(stored)]


KVCacheEngine = VanillaKVCacheEngine
