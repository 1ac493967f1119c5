"""``BaseKVCacheEngine``: a KV-cache engine (one branch of a causal model) = a ledger over a narrow storage.

An engine serves one branch of attention modules (``"main"``: ``transformer.blocks``, ``"vace"``:
``transformer.vace_blocks``). As llama.cpp splits its cells from its memory, it is made of a torch-free ledger and
tensor storages, with small parts around them:

============  ===========================================  ===================================================
part          module                                       holds
============  ===========================================  ===================================================
``ledger``    :mod:`~fastgen_diffusers.kv_cache.ledger`    per tag: stored frames, window and sink rule, slots,
                                                           key positions, transaction state; plans each call
``_self_kv``  :mod:`~fastgen_diffusers.kv_cache.storage`   ``[block_idx][cache_tag]``: one self K/V storage
``cross``     :mod:`~fastgen_diffusers.kv_cache.cross`     ``[block_idx][cache_tag]`` cross K/V + their source
``blocks``    :mod:`~fastgen_diffusers.kv_cache.registry`  ``id(attn_module) -> block index``
============  ===========================================  ===================================================

**The interface** is about a dozen methods, on :class:`BaseKVCacheEngine` itself: registration
(:meth:`~BaseKVCacheEngine.register_blocks`), one forward (:meth:`~BaseKVCacheEngine.check_call`,
:meth:`~BaseKVCacheEngine.ensure_capacity`, :meth:`~BaseKVCacheEngine.begin_transaction`,
:meth:`~BaseKVCacheEngine.begin_call`, :meth:`~BaseKVCacheEngine.plan_call`, :meth:`~BaseKVCacheEngine.cache_view`,
:meth:`~BaseKVCacheEngine.store`, :meth:`~BaseKVCacheEngine.end_transaction`, :meth:`~BaseKVCacheEngine.rollback`)
and edits between forwards (:meth:`~BaseKVCacheEngine.truncate`, :meth:`~BaseKVCacheEngine.copy_tag`,
:meth:`~BaseKVCacheEngine.clear`). No caller asks which storage an engine has: the plan and the views
(:mod:`~fastgen_diffusers.kv_cache.plan`) serve every storage alike. The other public names (the spec's
``ensure_capacity`` / ``append_self_kv`` / ``get_self_prefix``, ``_self_kv``, ``_cross_kv``, ``_module_to_block``,
``_block_masks``, and named reads and edits the pipelines use) are thin views over the ledger, the storages and the
cross cache, gathered in :class:`EngineViews`.

Self-attention keys are stored after ``norm_k`` and RoPE (``rope_positions="absolute"``, the default) or after
``norm_k`` only (any other mode, :mod:`~fastgen_diffusers.kv_cache.positions`: the model rotates them at read time at
the positions :meth:`~fastgen_diffusers.kv_cache.ledger.Ledger.key_positions` gives), values as projected, both
``(B, tokens, H, D)`` and detached. The rules every engine keeps (checked by :meth:`BaseKVCacheEngine.check_call`
before anything is written):

* a tag's entries all have one batch size, dtype, device, head layout and frame token count;
* a call may start at frame 0, at the end of what is stored, or at the start of a stored chunk; a later start is
  a hole and an error (never a read of zeros);
* a ``store_kv`` call writes frames ``[start_frame, start_frame + F)`` and drops anything stored after them, so
  re-running a stored chunk replaces it;
* cross-attention K/V are filled by the first ``store_kv`` call of a tag, read by later no-grad calls with the same
  conditioning (compared by content), and recomputed (never read) when gradients are enabled or it differs;
* the engine operations of one forward form a transaction (:meth:`BaseKVCacheEngine.begin_transaction`): a forward
  that fails midway is rolled back to exactly what the tag held before (frames, evictions, cross K/V, positions).

Sliding window and sink (``window_frames``, ``sink_frames``, ``sink_update``): the engine's :class:`AttentionWindow`
(``self.window``) states the window once, the ledger's :class:`~fastgen_diffusers.kv_cache.ledger.SinkRule` which
frames are pinned and how they are updated; the engine evicts what the ledger says is out of every later window, per
frame and the same for every storage: a call evicts the non-sink frames before its first chunk's window, a store
keeps the sink and the frames from :meth:`AttentionWindow.recent_start` on. With absolute positions keys are stored
after RoPE, so positions stay absolute; ``rope_positions="window"`` puts them at their slot of the window instead,
and ``sink_update="ema"`` folds the evicted frames into the sink (:meth:`BaseKVCacheEngine.begin_call`). A call that
needs an evicted frame is an error, except inside a windowed recache (:meth:`EngineViews.skip_evicted`), whose
calls attend to the frames held.

Storage (:mod:`~fastgen_diffusers.kv_cache.storage`): each block and tag's self K/V live in a storage of the engine's
:attr:`BaseKVCacheEngine.storage_class` (fixed slots for the static engine, a list of runs for the vanilla one), whose
codec keeps the compute dtype or, with ``kv_cache_dtype``, 8-bit data and one float32 scale per (sample, frame,
head) (:mod:`~fastgen_diffusers.kv_cache.quantize`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch._dynamo
from torch import nn

from .accounting import expected_scale_bytes
from .cross import CrossKVCache, CrossKVEntry, CrossKVMode
from .ema_sink import ema_update
from .ledger import Ledger
from .masks import BlockMaskMemo
from .options import SINK_UPDATES, check_kv_cache_dtype, check_rope_and_sink_settings
from .plan import CallPlan, PrefixView, SlotPlan, SlotView
from .positions import RopePositions
from .registry import BlockRegistry
from .sink import SinkRule
from .storage import ChunkListStorage, KVStorage, StorageLayout, codec_for
from .tags import TagState, TagTable
from .window import AttentionWindow

__all__ = ["SINK_UPDATES", "BaseKVCacheEngine", "EngineViews", "Transaction"]  # SINK_UPDATES: re-exported


def _tag_layout(
    batch_size: int, frame_seqlen: int, num_heads: int, head_dim: int, dtype: torch.dtype, device
) -> dict[str, Any]:
    """The layout of a call's entries as :meth:`TagState.layout` has it (the fields of :class:`StorageLayout`), the
    device normalized."""
    return dict(vars(StorageLayout(batch_size, frame_seqlen, num_heads, head_dim, dtype, torch.device(device))))


@dataclass
class Transaction:
    """What one forward may change of ``cache_tag``, as it was before the forward (see
    :meth:`BaseKVCacheEngine.begin_transaction`). ``undo`` lists in-place writes to undo, newest last."""

    cache_tag: str
    state: TagState | None
    self_entries: list[Any]
    cross: tuple
    undo: list[Callable[[], None]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class EngineViews:
    """Thin named views of an engine: reads of the ledger, named edits the pipelines call, the cross cache's
    operations, byte counts, and the spec's names (``ensure_capacity`` / ``append_self_kv`` / ``get_self_prefix``,
    ``_self_kv`` / ``_cross_kv`` / ``_module_to_block`` / ``_block_masks``). Each is a line or two over the engine's
    interface, its ledger, storages or cross cache; none holds state or a rule of its own."""

    ledger: Ledger
    cross: CrossKVCache
    blocks: BlockRegistry
    window: AttentionWindow
    _self_kv: list[dict[str, KVStorage]]
    _mask_memo: BlockMaskMemo | None

    # ------------------------------------------------------------------ configuration
    @property
    def window_frames(self) -> int | None:
        return self.window.frames

    @property
    def sink_frames(self) -> int:
        return self.window.sink

    @property
    def keys_before_rope(self) -> bool:
        """Whether self-attention keys are stored un-rotated and rotated at read time (:meth:`key_positions`)."""
        return self.ledger.positions.keys_before_rope

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    # ------------------------------------------------------------------ the spec's structures
    @property
    def _tags(self) -> TagTable:
        return self.ledger.tags

    @property
    def _cross_kv(self) -> list[dict[str, CrossKVEntry]]:
        """Cross entries ``[block_idx][cache_tag]``."""
        return self.cross.entries

    @property
    def _module_to_block(self) -> Mapping[int, int]:
        """The spec's ``_module_to_block[id(attn)] -> block_idx``: a read-only view of the registration."""
        return MappingProxyType(self.blocks.module_to_block)

    @property
    def _block_masks(self) -> Mapping[tuple, Any]:
        """The spec's memoised block masks, keyed by the chunk layout and everything else the pattern depends on
        (:meth:`~fastgen_diffusers.kv_cache.masks.BlockMaskMemo.keys`): a read-only view of the memo of the model
        that registered this engine (empty before)."""
        return MappingProxyType({}) if self._mask_memo is None else self._mask_memo.view()

    # ------------------------------------------------------------------ registration
    def owns(self, attn: nn.Module) -> bool:
        return self.blocks.owns(attn)

    def block_index(self, attn: nn.Module) -> int:
        """Branch-local block index of a registered attention module."""
        return self.blocks.block_index(attn, type(self).__name__)

    # ------------------------------------------------------------------ ledger reads
    def tag_state(self, cache_tag: str) -> TagState | None:
        return self.ledger.state(cache_tag)

    def num_stored_frames(self, cache_tag: str) -> int:
        return self.ledger.num_frames(cache_tag)

    def held_frames(self, cache_tag: str) -> int:
        """Frames of ``cache_tag`` whose K/V the engine holds (the sink and the frames not evicted)."""
        return self.ledger.held_frames(cache_tag)

    def rope_offset(self, cache_tag: str) -> int:
        """Temporal RoPE positions of ``cache_tag`` are ``frame - rope_offset`` (0 until re-based)."""
        return self.ledger.rope_offset(cache_tag)

    def visible_window(self, start_frame: int, first_chunk_frames: int) -> tuple[int, int]:
        """``(sink_end, recent_start)``: the cached frames a call's first chunk attends to are ``[0, sink_end)`` and
        ``[recent_start, start_frame)`` (:meth:`AttentionWindow.visible`)."""
        return self.window.visible(start_frame, first_chunk_frames)

    def visible_prefix_frames(self, cache_tag: str, start_frame: int, first_chunk_frames: int) -> int:
        """How many cached frames a call at ``start_frame`` whose first chunk has ``first_chunk_frames`` frames
        attends to (every frame before it, or the window and sink)."""
        return self.window.visible_frames(start_frame, first_chunk_frames)

    def held_visible(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> tuple[int, int]:
        """:meth:`Ledger.held_visible <fastgen_diffusers.kv_cache.ledger.Ledger.held_visible>`."""
        return self.ledger.held_visible(cache_tag, start_frame, first_chunk_frames, attention_window)

    def prefix_key_frames(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int = 1,
        attention_window: AttentionWindow | None = None,
    ) -> list[int]:
        """The latent frame of each frame of keys :meth:`get_self_prefix` returns, in its order (frame order)."""
        return self.ledger.prefix_frames(cache_tag, start_frame, first_chunk_frames, attention_window)

    def key_positions(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        *,
        in_place: bool = False,
        attention_window: AttentionWindow | None = None,
    ) -> RopePositions:
        """Temporal RoPE positions of the keys a call attends to, in the order the engine returns them
        (``in_place``: the slot order of a storage read in place), and of its queries
        (:meth:`Ledger.key_positions <fastgen_diffusers.kv_cache.ledger.Ledger.key_positions>`)."""
        return self.ledger.key_positions(
            cache_tag,
            start_frame,
            num_frames,
            first_chunk_frames,
            in_place=in_place,
            attention_window=attention_window,
        )

    # ------------------------------------------------------------------ the spec's per-block names
    def get_self_prefix(
        self,
        block_idx: int,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int = 1,
        attention_window: AttentionWindow | None = None,
    ):
        """Cached ``(key, value)``, each ``(B, prefix_tokens, H, D)`` in frame order, visible to a call at
        ``start_frame`` whose first chunk has ``first_chunk_frames`` frames, under the engine's window or the call's
        own ``attention_window``; ``None`` when nothing is visible (what a :class:`PrefixView` gathers)."""
        ranges = self.ledger.prefix_ranges(cache_tag, start_frame, first_chunk_frames, attention_window)
        keys, values = self._self_kv[block_idx][cache_tag].read(self.ledger.slot_ranges(ranges))
        if not keys:
            return None
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def append_self_kv(
        self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor, start_frame: int
    ) -> None:
        """Store ``key``/``value`` ``(B, F*S, H, D)`` as frames ``[start_frame, start_frame + F)``; drop later ones."""
        entry = self._self_kv[block_idx][cache_tag]
        state = self.ledger.tags[cache_tag]
        end_frame = start_frame + key.shape[1] // state.frame_seqlen
        self._drop(entry, start_frame, max(state.num_frames, start_frame))
        kept = self.ledger.store_window(cache_tag, start_frame, end_frame)
        self._evict(entry, 0, state.evicted_before)
        for frames in kept:
            self._write(entry, state, key.detach(), value.detach(), start_frame, frames)

    def commit_store(
        self, cache_tag: str, start_frame: int, num_frames: int, chunk_layout: Sequence[int] | None = None
    ) -> None:
        """Record, once every block has appended, that frames ``[start_frame, start_frame + num_frames)`` exist, as
        the chunks ``chunk_layout`` (frame counts; one chunk when ``None``), each a boundary a later call may use."""
        self.ledger.commit_store(cache_tag, start_frame, num_frames, chunk_layout)

    def static_call(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> SlotPlan | None:
        """The in-place part of :meth:`BaseKVCacheEngine.plan_call`: a :class:`SlotPlan` when attention can read the
        storage in place (:meth:`~fastgen_diffusers.kv_cache.storage.KVStorage.view`), else ``None`` and the call
        gathers its prefix: a storage with no in-place view (a list of runs, 8-bit data), gradients on, or a call
        the ledger does not serve in place (:meth:`Ledger.reads_in_place
        <fastgen_diffusers.kv_cache.ledger.Ledger.reads_in_place>`).

        Slots that hold frames the open transaction must be able to restore are kept first, as a write does. Built
        once per chunk (every step of a chunk and its store share it).
        """
        ledger = self.ledger
        if not self._self_kv or cache_tag not in self._self_kv[0]:
            return None
        if not ledger.reads_in_place(cache_tag, start_frame, num_frames, first_chunk_frames, attention_window):
            return None
        view = self._self_kv[0][cache_tag].view()
        if view is None or torch.is_grad_enabled():
            return None
        state = ledger.tags[cache_tag]
        seqlen = state.frame_seqlen
        end_frame = start_frame + num_frames
        runs = ledger.slot_runs(start_frame, end_frame)
        for per_tag in self._self_kv:
            entry = per_tag[cache_tag]
            for _, slot, count in runs:
                self._keep_for_undo(entry, slot, slot + count, seqlen)
        capacity = view[0].shape[1]
        key = (start_frame, num_frames, seqlen, capacity, state.device, state.dtype)
        if self._last_slot_plan is not None and self._last_slot_plan[0] == key:
            return self._last_slot_plan[1]
        write_index = torch.cat(
            [torch.arange(slot * seqlen, (slot + count) * seqlen, device=state.device) for _, slot, count in runs]
        )
        valid_length = torch.empty(self.window.slots(end_frame) * seqlen, 0, device=state.device)
        torch._dynamo.maybe_mark_dynamic(valid_length, 0)
        plan = SlotPlan(write_index, valid_length, ledger.slot_frames(end_frame), capacity // seqlen)
        self._last_slot_plan = (key, plan)
        return plan

    def static_buffers(self, block_idx: int, cache_tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V tensors of one block and tag's storage that attention reads in place (:meth:`cache_view`);
        ``RuntimeError`` for a storage read only through a gathered prefix."""
        view = self._self_kv[block_idx][cache_tag].view()
        if view is None:
            raise RuntimeError(
                f"{type(self).__name__}'s storage has no compute-dtype buffers to attend to in place (an 8-bit KV "
                "cache, or a list of chunks): its calls read a gathered prefix."
            )
        return view

    # ------------------------------------------------------------------ named edits
    def rewind(self, cache_tag: str, num_frames: int) -> None:
        """Drop the newest ``num_frames`` frames of ``cache_tag`` (a whole number of stored chunks)."""
        stored = self.ledger.num_frames(cache_tag)
        if not 0 <= num_frames <= stored:
            raise ValueError(f"Cannot rewind {num_frames} frames: cache_tag {cache_tag!r} holds {stored} frames.")
        self.truncate(cache_tag, stored - num_frames)

    def skip_evicted(self, cache_tag: str, resume_frame: int) -> None:
        """Open a windowed recache of ``cache_tag``: the frames ``[stored, resume_frame)`` count as stored and
        evicted, so the next store may start at ``resume_frame``; until :meth:`end_recache`, calls attend to the
        frames the tag holds (the sink and what the recache has re-stored) instead of raising for evicted ones.

        LongLive's recache under a window: only the chunks the window still holds are re-run, each seeing the sink
        and the re-run chunks before it.
        """
        self._evict_all(cache_tag, *self.ledger.skip_evicted(cache_tag, resume_frame))

    def end_recache(self, cache_tag: str) -> None:
        """Close the windowed recache of ``cache_tag`` (:meth:`skip_evicted`): the usual rules apply again."""
        self.ledger.end_recache(cache_tag)

    def flush(self, cache_tag: str, keep_frames: int) -> None:
        """KV flush: keep only the sink and the last ``keep_frames`` stored frames of ``cache_tag`` (Infinity-RoPE's
        ``kv_flush`` at a prompt switch). Until the window slides past the dropped frames, calls attend to the held
        frames only (the dropped ones are no error, as evicted frames of a windowed recache are not)."""
        dropped = self.ledger.flush(cache_tag, keep_frames)
        if dropped is not None:
            self._evict_all(cache_tag, *dropped)

    def set_rope_cut(self, cache_tag: str, position: int | None) -> None:
        """Scene cut (Infinity-RoPE's ``rope_cut``): until set back to ``None``, the frames of each call of
        ``cache_tag`` (queries and their own keys) sit at temporal positions ``position, position + 1, ...``; the
        cached keys keep their positions. Needs keys stored before RoPE (the cut is not written into the cache)."""
        self.ledger.set_rope_cut(cache_tag, position)

    def rebase_positions(
        self, cache_tag: str, rope_offset: int, rotate: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Record the new ``rope_offset`` of ``cache_tag`` and re-rotate every cached key with ``rotate``.

        ``rotate`` maps ``(B, tokens, H, D)`` keys rotated for positions ``frame - old_offset`` to keys rotated for
        ``frame - rope_offset`` (a rotation by the difference on the temporal channels: RoPE rotations compose).
        """
        state = self.ledger.state(cache_tag)
        if state is None:
            raise ValueError(f"cache_tag {cache_tag!r} holds nothing to re-base; stored tags: {sorted(self._tags)}.")
        for per_tag in self._self_kv:
            entry = per_tag[cache_tag]
            self._keep_for_undo(entry, 0, entry.num_slots, state.frame_seqlen)
            entry.map_keys(rotate)
        state.rope_offset = rope_offset

    # ------------------------------------------------------------------ the cross cache
    def cross_mode(
        self,
        cache_tag: str,
        conditioning: tuple[torch.Tensor | None, ...],
        *,
        store_kv: bool,
        grad_enabled: bool,
        matches: dict | None = None,
    ) -> CrossKVMode:
        """Decide, once per forward, whether cross-attention reads, fills or just computes its K/V
        (:meth:`CrossKVCache.mode`)."""
        return self.cross.mode(cache_tag, conditioning, store_kv=store_kv, grad_enabled=grad_enabled, matches=matches)

    def get_cross_kv(self, block_idx: int, cache_tag: str) -> CrossKVEntry:
        return self.cross.get(block_idx, cache_tag)

    def invalidate_cross(self, cache_tag: str | None = None) -> None:
        """Forget the cross K/V of ``cache_tag`` (every tag when ``None``); the next ``store_kv`` call refills them."""
        self.cross.invalidate(list(self._tags) if cache_tag is None else [cache_tag])

    # ------------------------------------------------------------------ byte counts
    def self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the self-attention K/V held (all tags when ``cache_tag`` is ``None``): each storage's bytes for
        the tag's :meth:`held_frames` (a preallocating storage counts the cache formula over them, never its
        capacity: :meth:`allocated_self_cache_bytes`), scales of an 8-bit cache included
        (:meth:`self_cache_scale_bytes`)."""
        return sum(
            entry.held_bytes(self.ledger.held_frames(tag))
            for per_tag in self._self_kv
            for tag, entry in per_tag.items()
            if cache_tag is None or tag == cache_tag
        )

    def self_cache_scale_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the float32 scales of an 8-bit cache held (0 without ``kv_cache_dtype``), part of
        :meth:`self_cache_bytes`: :func:`~fastgen_diffusers.kv_cache.accounting.expected_scale_bytes` over the
        :meth:`held_frames`."""
        if self.kv_cache_dtype is None:
            return 0
        return sum(
            expected_scale_bytes(self.num_blocks, state.batch_size, state.num_heads, self.held_frames(tag))
            for tag, state in self._tags.items()
            if cache_tag is None or tag == cache_tag
        )

    def allocated_self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the self-attention tensors the engine has allocated (preallocating engines: their capacity)."""
        return sum(
            entry.nbytes
            for per_tag in self._self_kv
            for tag, entry in per_tag.items()
            if cache_tag is None or tag == cache_tag
        )

    def cross_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes held by cross-attention K/V (all tags when ``cache_tag`` is ``None``)."""
        return self.cross.nbytes(cache_tag)

    def cache_bytes(self, cache_tag: str | None = None) -> int:
        return self.self_cache_bytes(cache_tag) + self.cross_cache_bytes(cache_tag)


class BaseKVCacheEngine(EngineViews):
    """A ledger (:class:`~fastgen_diffusers.kv_cache.ledger.Ledger`) over one self-attention storage per block and tag
    (:attr:`storage_class`, with the engine's codec: the compute dtype or 8-bit) and a cross cache.

    The engine asks the ledger what a call or an edit does (frames, slots, evictions, the sink rule's fold) and
    applies it with the storage's operations only, the same for every storage; a storage written in place gets its
    overwritten slots kept in the open :class:`Transaction` first.

    Args:
        window_frames: attend to at most this many latent frames per chunk (its own frames and the sink included);
            ``None`` keeps and attends to every frame.
        sink_frames: the first frames of the video, kept and attended to for ever (needs ``window_frames``).
        rope_positions: temporal RoPE positions of the keys (:mod:`~fastgen_diffusers.kv_cache.positions`):
            ``"absolute"`` (keys stored after RoPE at their frame) or ``"window"`` (keys stored before RoPE and rotated
            at read time by their slot in ``[sink | recent | call]``; needs ``window_frames``).
        sink_update: ``"fixed"`` (the sink keeps its first K/V) or ``"ema"``: when frames leave the window, per tag
            and block, ``sink = sink_decay * sink + (1 - sink_decay) * evicted`` for K and V (needs sink frames and
            keys stored before RoPE; see :meth:`begin_call`).
        sink_decay: the EMA's decay in ``(0, 1)`` (Reward Forcing: 0.999).
        kv_cache_dtype: ``None`` (default: self K/V stored in the compute dtype) or an 8-bit storage dtype,
            ``torch.float8_e4m3fn`` or ``torch.int8`` (or its name): completed frames are stored quantized with one
            float32 scale per (sample, frame, head) (:mod:`~fastgen_diffusers.kv_cache.quantize`) and dequantized
            on read; a call's own K/V stay in the compute dtype. Inference only: a forward with gradients enabled
            is an error. Cross-attention K/V are not quantized.
    """

    storage_class: type[KVStorage] = ChunkListStorage

    def __init__(
        self,
        *,
        window_frames: int | None = None,
        sink_frames: int = 0,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str = "absolute",
        sink_update: str = "fixed",
        sink_decay: float = 0.999,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
    ) -> None:
        self.window = AttentionWindow.from_arguments(window_frames, sink_frames, frames_name="window_frames")
        rope_mode = check_rope_and_sink_settings(self.window, rope_positions, sink_update, sink_decay)
        self.rope_positions = rope_positions
        self.sink_update = sink_update
        self.sink_decay = float(sink_decay)
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, sink_update)
        sink = SinkRule(self.window.sink, sink_update, self.sink_decay)
        self.ledger = Ledger(self.window, sink, rope_mode, rope_positions, self.storage_class.fixed_slots)
        self._codec = codec_for(self.kv_cache_dtype)
        self.blocks = BlockRegistry()
        self._mask_memo: BlockMaskMemo | None = None
        self._self_kv: list[dict[str, KVStorage]] = []
        self.cross = CrossKVCache()
        self._transaction: Transaction | None = None
        self._last_slot_plan: tuple[tuple, SlotPlan] | None = None

    # ------------------------------------------------------------------ registration
    def register_blocks(self, blocks: Sequence[nn.Module], block_masks: BlockMaskMemo | None = None) -> None:
        """Register the ``attn1``/``attn2`` modules of ``blocks``; ``blocks[i]`` becomes block index ``i``.

        ``block_masks``: the model's mask memo, which the spec's ``_block_masks`` view reads. Registering again
        replaces the previous registration and empties the cache.
        """
        self.blocks = BlockRegistry(blocks)
        self._mask_memo = block_masks
        self.clear()

    # ------------------------------------------------------------------ one forward
    def check_call(
        self,
        cache_tag: str,
        *,
        start_frame: int,
        batch_size: int,
        frame_seqlen: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk_layout: tuple[int, ...] = (1,),
        attention_window: AttentionWindow | None = None,
        store_kv: bool = False,
    ) -> None:
        """Raise ``ValueError`` if a call cannot be served by what ``cache_tag`` holds. Writes nothing.

        ``chunk_layout`` is the call's split into chunks (frame counts); windowed engines check that each chunk fits
        the window and that the frames its first chunk attends to are still held. With ``sink_update="ema"`` the
        frames the call evicts must be as many as the sink's (see :meth:`begin_call`). ``attention_window`` is the
        call's own window, checked instead of the engine's (it must see only held frames). With keys stored before
        RoPE, a call of several chunks must give each chunk its chunk-by-chunk key positions.
        """
        if self.kv_cache_dtype is not None and torch.is_grad_enabled():
            raise ValueError(
                f"An 8-bit KV cache (`kv_cache_dtype={self.kv_cache_dtype}`) serves inference only: run the forward "
                "under `torch.no_grad()` or `torch.inference_mode()`, or use engines without `kv_cache_dtype`."
            )
        layout = _tag_layout(batch_size, frame_seqlen, num_heads, head_dim, dtype, device)
        self.ledger.check_call(cache_tag, start_frame, chunk_layout, layout, attention_window, store_kv)

    def ensure_capacity(
        self,
        cache_tag: str,
        *,
        batch_size: int,
        frame_seqlen: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        text_len: int,
        image_len: int = 0,
        max_frames: int | None = None,
    ) -> None:
        """Create the entries of ``cache_tag`` for every block if they do not exist yet (the spec's name for
        reserving).

        Self entries start empty; cross entries start as zero K/V with ``is_init=False``. ``max_frames`` is the
        number of frames the rollout will store at most (storages that preallocate reserve them).
        """
        state = self.ledger.state(cache_tag)
        if state is None:
            layout = _tag_layout(batch_size, frame_seqlen, num_heads, head_dim, dtype, device)
            state = self.ledger.tags.create(cache_tag, **layout)
            for block_idx in range(self.num_blocks):
                self._self_kv[block_idx][cache_tag] = self._new_self_entry(state, max_frames)
        shape = (state.batch_size, state.num_heads, state.head_dim)
        self.cross.ensure(cache_tag, shape, state.dtype, state.device, text_len, image_len)
        self._reserve(state, cache_tag, max_frames)

    def begin_transaction(self, cache_tag: str) -> None:
        """Remember what ``cache_tag`` holds, so that :meth:`rollback` restores it exactly.

        The model opens one transaction per forward before its first engine operation and ends it once the
        forward's writes are committed; a forward that fails midway is rolled back. For storages written in place
        it also notes which slots hold frames the tag holds now: an in-place write to them during the transaction
        first keeps their contents (:meth:`_keep_for_undo`); writes to free slots keep nothing.
        """
        state = self.ledger.state(cache_tag)
        self._transaction = Transaction(
            cache_tag,
            None if state is None else state.copy(),
            [None if entry is None else entry.snapshot() for entry in (t.get(cache_tag) for t in self._self_kv)],
            self.cross.snapshot(cache_tag),
        )
        if self.storage_class.writes_in_place:
            self._transaction.extra.update(held_slots=self.ledger.held_slots(cache_tag), unsaved={})

    def begin_call(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> None:
        """Evict (windowed engines) the non-sink frames before the window of a call about to run.

        Called once per forward, after :meth:`ensure_capacity` and before the blocks run, so that every block of the
        branch evicts the same frames. The ledger's sink rule may first fold the evicted frames into the sink: with
        ``sink_update="ema"`` the evicted frames ``e`` (exactly ``sink_frames`` of them, checked by
        :meth:`check_call`), per block, K and V alike: ``sink[i] = sink_decay * sink[i] + (1 - sink_decay) * e[i]``
        (Reward Forcing's update at the first forward of a chunk that evicts; every call of that chunk then sees the
        updated sink). Inside the forward's transaction, so a failed forward restores the sink. A windowed recache
        folds nothing. A call under its own ``attention_window`` evicts nothing.
        """
        eviction = self.ledger.begin_call(cache_tag, start_frame, first_chunk_frames, attention_window)
        if eviction is None:
            return
        if eviction.fold is not None:
            self._fold_into_sink(cache_tag, *eviction.fold)
        self._evict_all(cache_tag, 0, eviction.last)

    def plan_call(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> CallPlan:
        """The plan of a call, shared by every block of the branch (once per forward, after :meth:`begin_call`):
        whether attention reads the storage in place (:meth:`EngineViews.static_call`) or a gathered prefix."""
        slots = self.static_call(cache_tag, start_frame, num_frames, first_chunk_frames, attention_window)
        return CallPlan(cache_tag, start_frame, num_frames, first_chunk_frames, attention_window, slots)

    def cache_view(self, block_idx: int, plan: CallPlan, store: bool = False) -> SlotView | PrefixView:
        """What block ``block_idx``'s self-attention reads for the call ``plan``: the storage read in place, or the
        visible prefix gathered right before the block runs (``store``: it hands the call's K/V back for
        :meth:`store`; written in place they need no hand-back)."""
        if plan.slots is not None:
            key, value = self._self_kv[block_idx][plan.cache_tag].view()
            return SlotView(key, value, plan.slots.write_index, plan.slots.valid_length)
        load = functools.partial(
            self.get_self_prefix,
            block_idx,
            plan.cache_tag,
            plan.start_frame,
            plan.first_chunk_frames,
            plan.attention_window,
        )
        return PrefixView(load, store=store)

    def store(self, plan: CallPlan, views: Sequence[SlotView | PrefixView], chunk_layout: Sequence[int]) -> None:
        """Store the call ``plan`` once every block has run, from each block's view (:meth:`cache_view`): K/V
        written in place are only recorded, handed-back ones are appended (:meth:`EngineViews.append_self_kv`)."""
        start, num_frames = plan.start_frame, plan.num_frames
        if plan.slots is not None:
            self.ledger.store_window(plan.cache_tag, start, start + num_frames)
        else:
            for block_idx, view in enumerate(views):
                self.append_self_kv(block_idx, plan.cache_tag, view.new_key, view.new_value, start)
                view.new_key = view.new_value = None
        self.commit_store(plan.cache_tag, start, num_frames, chunk_layout)

    def end_transaction(self) -> None:
        """Keep what the forward wrote (nothing is undone after this)."""
        self._transaction = None

    def rollback(self) -> None:
        """Restore the tag of the open transaction to what it held when the transaction began, and end it."""
        transaction, self._transaction = self._transaction, None
        if transaction is None:
            return
        for undo in reversed(transaction.undo):
            undo()
        tag = transaction.cache_tag
        self.ledger.tags.set(tag, transaction.state)
        for per_tag, restore in zip(self._self_kv, transaction.self_entries):
            if restore is None:
                per_tag.pop(tag, None)
            else:
                per_tag[tag] = restore()
        self.cross.restore(tag, transaction.cross)

    # ------------------------------------------------------------------ edits between forwards
    def truncate(self, cache_tag: str, end_frame: int) -> None:
        """Drop every frame ``>= end_frame`` of ``cache_tag`` (``end_frame`` must be a stored chunk boundary)."""
        dropped = self.ledger.truncate(cache_tag, end_frame)
        if dropped is not None:
            self._drop_all(cache_tag, *dropped)

    def copy_tag(self, source_tag: str, target_tag: str) -> None:
        """Give ``target_tag`` a copy of every entry of ``source_tag`` (fork a rollout from a shared prefix)."""
        if source_tag not in self._tags:
            raise ValueError(f"cache_tag {source_tag!r} holds nothing to copy; stored tags: {sorted(self._tags)}.")
        self.ledger.tags.copy_tag(source_tag, target_tag)
        for per_tag in self._self_kv:
            per_tag[target_tag] = per_tag[source_tag].copy()
        self.cross.copy_tag(source_tag, target_tag)

    def clear(self, cache_tag: str | None = None) -> None:
        """Free the entries of ``cache_tag`` (every tag when ``None``)."""
        if cache_tag is None:
            self._self_kv = [{} for _ in range(self.num_blocks)]
            self.cross = CrossKVCache(self.num_blocks)
            self.ledger.tags.remove()
            return
        self.ledger.tags.remove(cache_tag)
        self.cross.remove(cache_tag)
        for per_tag in self._self_kv:
            per_tag.pop(cache_tag, None)

    # ------------------------------------------------------------------ applying the ledger to the storages
    def _new_self_entry(self, state: TagState, max_frames: int | None) -> KVStorage:
        """A new, empty storage of one block and tag (:attr:`storage_class`, with the engine's codec)."""
        return self.storage_class(StorageLayout(**state.layout()), self._codec, self._initial_slots(max_frames))

    def _initial_slots(self, max_frames: int | None) -> int:
        """Slots a new storage allocates up front (storages that grow per write ignore it)."""
        return 0

    def _reserve(self, state: TagState, cache_tag: str, max_frames: int | None) -> None:
        """Preallocating engines grow their storages here."""

    def _write(
        self, entry: KVStorage, state: TagState, key: torch.Tensor, value: torch.Tensor, key_start: int, frames
    ) -> None:
        """Write frames ``[first, last)`` of ``key``/``value`` (whose first frame is ``key_start``) into their slots,
        keeping for the open transaction what an in-place write overwrites."""
        first, last = frames
        seqlen = state.frame_seqlen
        for frame, slot, count in self.ledger.slot_runs(first, last):
            self._keep_for_undo(entry, slot, slot + count, seqlen)
            src = slice((frame - key_start) * seqlen, (frame - key_start + count) * seqlen)
            entry.write(slot, key[:, src], value[:, src])

    def _drop(self, entry: KVStorage, first: int, last: int) -> None:
        """Frames ``[first, last)`` of one storage are gone: free their slots."""
        for start, stop in self.ledger.freed_slot_ranges(first, last):
            entry.evict(start, stop)

    def _drop_all(self, cache_tag: str, first: int, last: int) -> None:
        for per_tag in self._self_kv:
            self._drop(per_tag[cache_tag], first, last)

    def _evict(self, entry: KVStorage, first: int, last: int) -> None:
        """The unpinned frames of ``[first, last)`` (the sink rule's) leave one storage: free their slots."""
        for start, stop in self.ledger.evicted_slot_ranges(first, last):
            entry.evict(start, stop)

    def _evict_all(self, cache_tag: str, first: int, last: int) -> None:
        for per_tag in self._self_kv:
            self._evict(per_tag[cache_tag], first, last)

    def _frames_kv(self, entry: KVStorage, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held frames ``[first, last)`` of ``entry`` as ``(key, value)`` ``(B, (last - first) * S, H, D)``."""
        keys, values = entry.read(self.ledger.slot_ranges(((first, last),)))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def _fold_into_sink(self, cache_tag: str, pinned: tuple[int, int], evicted: tuple[int, int]) -> None:
        """EMA of the evicted frames into the pinned frames (the sink rule's fold), every block."""
        decay = self.ledger.sink.decay
        state = self.ledger.tags[cache_tag]
        for per_tag in self._self_kv:
            entry = per_tag[cache_tag]
            sink_key, sink_value = self._frames_kv(entry, *pinned)
            key, value = self._frames_kv(entry, *evicted)
            new_key, new_value = ema_update(sink_key, key, decay), ema_update(sink_value, value, decay)
            self._write(entry, state, new_key, new_value, pinned[0], pinned)

    def _keep_for_undo(self, entry: KVStorage, first_slot: int, last_slot: int, seqlen: int) -> None:
        """Before slots ``[first_slot, last_slot)`` of a storage written in place are overwritten in an open
        transaction, keep a copy of those that hold frames held when it began (each slot once) and record how to put
        it back. Storages never written in place are restored from their snapshot instead."""
        transaction = self._transaction
        if transaction is None or not entry.writes_in_place:
            return
        unsaved = transaction.extra["unsaved"].setdefault(id(entry), list(transaction.extra["held_slots"]))
        remaining = []
        for low, high in unsaved:
            first, last = max(low, first_slot), min(high, last_slot)
            if first >= last:
                remaining.append((low, high))
                continue
            transaction.undo.append(entry.saved(first, last))
            remaining += [r for r in ((low, first), (last, high)) if r[0] < r[1]]
        transaction.extra["unsaved"][id(entry)] = remaining

    def __repr__(self) -> str:
        tags = {tag: state.num_frames for tag, state in self._tags.items()}
        return f"{type(self).__name__}(blocks={self.num_blocks}, frames_by_tag={tags})"
