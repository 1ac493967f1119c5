"""Shared storage, registration and rules of a KV-cache engine (one branch of a causal model).

An engine serves one branch of attention modules (``"main"``: ``transformer.blocks``, ``"vace"``:
``transformer.vace_blocks``). Its entries are addressed by a block index local to the branch and a cache tag:

==================  ==========================================  ==========================================
attribute           indexed by                                  holds
==================  ==========================================  ==========================================
``_self_kv``        ``[block_idx][cache_tag]``                  the self-attention entry (engine-specific)
``_cross_kv``       ``[block_idx][cache_tag]``                  a :class:`CrossKVEntry`
``_module_to_block````id(attn_module)``                         block index of a registered module
``_tags``           ``cache_tag``                               a :class:`TagState` (shape, dtype, frames)
==================  ==========================================  ==========================================

Self-attention keys are stored after ``norm_k`` and RoPE, values as projected, both ``(B, tokens, H, D)`` and
detached. The rules every engine keeps (checked by :meth:`BaseKVCacheEngine.check_call` before anything is
written):

* a tag's entries all have one batch size, dtype, device, head layout and frame token count;
* a call may start at frame 0, at the end of what is stored, or at the start of a stored chunk; a later start is
  a hole and an error (never a read of zeros);
* a ``store_kv`` call writes frames ``[start_frame, start_frame + F)`` and drops anything stored after them, so
  re-running a stored chunk replaces it;
* cross-attention K/V are filled by the first ``store_kv`` call of a tag, read by later no-grad calls with the same
  conditioning, and recomputed (never read) when gradients are enabled or the conditioning differs.

Sliding window and sink (``window_frames``, ``sink_frames``): the engine's :class:`AttentionWindow` (``self.window``)
states the rule once; the engine evicts what it says is out of every later window, per frame and the same in every
engine: a call evicts the non-sink frames before its first chunk's window, a store keeps the sink and the frames
from :meth:`AttentionWindow.recent_start` on. Keys are stored after RoPE, so positions stay absolute. A call that
needs an evicted frame is an error.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .conditioning import ConditioningKey
from .window import AttentionWindow


class CrossKVMode(str, enum.Enum):
    """What a cross-attention processor does with its cache entry in one forward."""

    READ = "read"  # use the cached K/V, run no K/V projections
    FILL = "fill"  # compute K/V, use them, and store them in the entry
    COMPUTE = "compute"  # compute K/V and use them; the entry is left as it is


@dataclass
class CrossKVEntry:
    """Cross-attention K/V of one block and tag: text ``(B, L_text, H, D)``, optional image ``(B, L_img, H, D)``."""

    key: torch.Tensor
    value: torch.Tensor
    key_img: torch.Tensor | None = None
    value_img: torch.Tensor | None = None
    is_init: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_img, self.value_img) if t is not None]


@dataclass
class TagState:
    """Layout and stored frames of one cache tag, shared by all blocks of an engine."""

    batch_size: int
    frame_seqlen: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    chunk_starts: list[int] = field(default_factory=list)  # start frame of every stored chunk, ascending
    num_frames: int = 0  # frames stored so far ("ever stored" for windowed engines)
    evicted_before: int = 0  # windowed engines: the non-sink frames before it are no longer held
    rope_offset: int = 0  # cached keys are rotated for temporal positions ``frame - rope_offset`` (RoPE re-basing)
    cross_source: ConditioningKey | None = None

    def layout(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "frame_seqlen": self.frame_seqlen,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "device": self.device,
        }


def expected_self_cache_bytes(
    num_layers: int, batch_size: int, num_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The cache formula: 2 (K and V) x layers x batch x heads x cached tokens x head_dim x bytes per element."""
    return (
        2 * num_layers * batch_size * num_heads * num_tokens * head_dim * torch.empty((), dtype=dtype).element_size()
    )


class BaseKVCacheEngine:
    """Storage and rules shared by every engine; subclasses decide how self-attention K/V are laid out.

    Subclasses implement :meth:`_new_self_entry`, :meth:`_self_prefix_pieces`, :meth:`append_self_kv`,
    :meth:`_truncate_self_entry`, :meth:`_evict_self_entry`, :meth:`_rotate_self_entry`, :meth:`_copy_self_entry`
    and :meth:`_self_entry_tensors`, and may override :meth:`self_attention_kv` to avoid building
    ``[prefix | current]`` by concatenation.

    Args:
        window_frames: attend to at most this many latent frames per chunk (its own frames and the sink included);
            ``None`` keeps and attends to every frame.
        sink_frames: the first frames of the video, kept and attended to for ever (needs ``window_frames``).
    """

    def __init__(self, *, window_frames: int | None = None, sink_frames: int = 0) -> None:
        self.window = AttentionWindow.from_arguments(window_frames, sink_frames, frames_name="window_frames")
        self._self_kv: list[dict[str, Any]] = []
        self._cross_kv: list[dict[str, CrossKVEntry]] = []
        self._module_to_block: dict[int, int] = {}
        self._registered_blocks: list[tuple[nn.Module, ...]] = []
        self._tags: dict[str, TagState] = {}

    @property
    def window_frames(self) -> int | None:
        return self.window.frames

    @property
    def sink_frames(self) -> int:
        return self.window.sink

    # ------------------------------------------------------------------ registration
    def register_blocks(self, blocks: Sequence[nn.Module]) -> None:
        """Register the ``attn1``/``attn2`` modules of ``blocks``; ``blocks[i]`` becomes block index ``i``.

        Registering again replaces the previous registration and empties the cache.
        """
        self._registered_blocks = [(block.attn1, block.attn2) for block in blocks]
        self._rebuild_module_index()
        self.clear()

    def _rebuild_module_index(self) -> None:
        self._module_to_block = {
            id(module): block_idx for block_idx, modules in enumerate(self._registered_blocks) for module in modules
        }

    @property
    def num_blocks(self) -> int:
        return len(self._registered_blocks)

    def owns(self, attn: nn.Module) -> bool:
        return id(attn) in self._module_to_block

    def block_index(self, attn: nn.Module) -> int:
        """Branch-local block index of a registered attention module."""
        try:
            return self._module_to_block[id(attn)]
        except KeyError:
            raise RuntimeError(
                f"{type(attn).__name__} at {id(attn):#x} is not registered with this {type(self).__name__} "
                f"({self.num_blocks} blocks registered)."
            ) from None

    def __deepcopy__(self, memo: dict) -> BaseKVCacheEngine:
        # Registration is keyed by ``id(module)``. A deep copy of the model copies its modules first (``_modules`` is
        # before ``kv_cache_engines`` in its state), so the copied engine re-keys on the copied modules and
        # resolves its own model's attention; a copy of the engine alone keeps pointing at the same modules.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name == "_registered_blocks":
                value = [tuple(memo.get(id(module), module) for module in modules) for modules in value]
                setattr(new, name, value)
            else:
                setattr(new, name, copy.deepcopy(value, memo))
        new._rebuild_module_index()
        return new

    # ------------------------------------------------------------------ tag validation
    def tag_state(self, cache_tag: str) -> TagState | None:
        return self._tags.get(cache_tag)

    def num_stored_frames(self, cache_tag: str) -> int:
        state = self._tags.get(cache_tag)
        return 0 if state is None else state.num_frames

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
    ) -> None:
        """Raise ``ValueError`` if a call cannot be served by what ``cache_tag`` holds. Writes nothing.

        ``chunk_layout`` is the call's split into chunks (frame counts); windowed engines check that each chunk fits
        the window and that the frames its first chunk attends to are still held.
        """
        self.window.check_layout(start_frame, chunk_layout)
        state = self._tags.get(cache_tag)
        stored = 0 if state is None else state.num_frames
        if start_frame < 0:
            raise ValueError(f"`start_frame` must be >= 0, got {start_frame}.")
        if start_frame > stored:
            raise ValueError(
                f"`start_frame={start_frame}` leaves a hole: cache_tag {cache_tag!r} holds frames [0, {stored}) only. "
                f"Run (with store_kv=True) the frames before it first, or start at a frame <= {stored}."
            )
        if state is None:
            return
        if start_frame not in state.chunk_starts and start_frame != stored:
            raise ValueError(
                f"`start_frame={start_frame}` is inside a stored chunk of cache_tag {cache_tag!r}; calls must start "
                f"at a chunk boundary the cache can serve: one of {sorted(set(state.chunk_starts + [stored]))}."
            )
        self.window.check_held(start_frame, chunk_layout[0], state.evicted_before, f"cache_tag {cache_tag!r}")
        given = {
            "batch_size": batch_size,
            "frame_seqlen": frame_seqlen,
            "num_heads": num_heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "device": torch.device(device),
        }
        for name, expected in state.layout().items():
            if given[name] != expected:
                hint = " (a different resolution)" if name == "frame_seqlen" else ""
                raise ValueError(
                    f"cache_tag {cache_tag!r} holds entries with {name}={expected}, but this call has "
                    f"{name}={given[name]}{hint}. Call `clear_caches()` (or use another cache_tag) before changing it."
                )

    def visible_window(self, start_frame: int, first_chunk_frames: int) -> tuple[int, int]:
        """``(sink_end, recent_start)``: the cached frames a call's first chunk attends to are ``[0, sink_end)`` and
        ``[recent_start, start_frame)`` (:meth:`AttentionWindow.visible`)."""
        return self.window.visible(start_frame, first_chunk_frames)

    def held_frames(self, cache_tag: str) -> int:
        """Frames of ``cache_tag`` whose K/V the engine holds (the sink and the frames not evicted)."""
        state = self._tags.get(cache_tag)
        return 0 if state is None else self.window.held_frames(state.num_frames, state.evicted_before)

    def begin_call(self, cache_tag: str, start_frame: int, first_chunk_frames: int) -> None:
        """Evict (windowed engines) the non-sink frames before the window of a call about to run.

        Called once per forward, after :meth:`ensure_capacity` and before the blocks run, so that every block of the
        branch evicts the same frames.
        """
        state = self._tags.get(cache_tag)
        if not self.window.bounded or state is None:
            return
        _, recent_start = self.window.visible(start_frame, first_chunk_frames)
        if recent_start <= max(self.window.sink, state.evicted_before):
            return
        state.evicted_before = recent_start
        for block_idx in range(self.num_blocks):
            self._evict_self_entry(self._self_kv[block_idx][cache_tag], state, recent_start)

    def _store_window(self, state: TagState, start_frame: int, end_frame: int) -> list[tuple[int, int]]:
        """Frame ranges of a store of ``[start_frame, end_frame)`` that the engine keeps; records what it evicts.

        Idempotent, so that every block's :meth:`append_self_kv` may call it.
        """
        if self.window.bounded:
            # frames >= start_frame are replaced by this store; the window then evicts what precedes recent_start
            recent_start = self.window.recent_start(end_frame)
            state.evicted_before = max(min(state.evicted_before, start_frame), recent_start)
        return self.window.kept_ranges(start_frame, end_frame)

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
        """Create the entries of ``cache_tag`` for every block if they do not exist yet.

        Self entries start empty; cross entries start as zero K/V with ``is_init=False``. ``max_frames`` is the
        number of frames the rollout will store at most (engines that preallocate use it).
        """
        state = self._tags.get(cache_tag)
        if state is None:
            state = TagState(batch_size, frame_seqlen, num_heads, head_dim, dtype, torch.device(device))
            self._tags[cache_tag] = state
            for block_idx in range(self.num_blocks):
                self._self_kv[block_idx][cache_tag] = self._new_self_entry(state, max_frames)
        for block_idx in range(self.num_blocks):
            entry = self._cross_kv[block_idx].get(cache_tag)
            if entry is None or entry.key.shape[1] != text_len or self._image_len(entry) != image_len:
                self._cross_kv[block_idx][cache_tag] = self._zero_cross_entry(state, text_len, image_len)
                state.cross_source = None
        self._reserve(state, cache_tag, max_frames)

    def _reserve(self, state: TagState, cache_tag: str, max_frames: int | None) -> None:
        """Preallocating engines grow their buffers here."""

    @staticmethod
    def _image_len(entry: CrossKVEntry) -> int:
        return 0 if entry.key_img is None else entry.key_img.shape[1]

    @staticmethod
    def _zero_cross_entry(state: TagState, text_len: int, image_len: int) -> CrossKVEntry:
        def zeros(length: int) -> torch.Tensor:
            shape = (state.batch_size, length, state.num_heads, state.head_dim)
            return torch.zeros(shape, dtype=state.dtype, device=state.device)

        return CrossKVEntry(
            key=zeros(text_len),
            value=zeros(text_len),
            key_img=zeros(image_len) if image_len else None,
            value_img=zeros(image_len) if image_len else None,
        )

    # ------------------------------------------------------------------ self-attention entries
    def _new_self_entry(self, state: TagState, max_frames: int | None) -> Any:
        raise NotImplementedError

    def _self_prefix_pieces(
        self, block_idx: int, cache_tag: str, start_frame: int, first_chunk_frames: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the visible cached K and V, each ``(B, tokens, H, D)``, in frame order (:meth:`visible_window`)."""
        raise NotImplementedError

    def get_self_prefix(self, block_idx: int, cache_tag: str, start_frame: int, first_chunk_frames: int = 1):
        """Cached ``(key, value)``, each ``(B, prefix_tokens, H, D)`` in frame order, visible to a call at
        ``start_frame`` whose first chunk has ``first_chunk_frames`` frames (the window shrinks as it grows).

        ``None`` when nothing is visible.
        """
        keys, values = self._self_prefix_pieces(block_idx, cache_tag, start_frame, first_chunk_frames)
        if not keys:
            return None
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def append_self_kv(
        self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor, start_frame: int
    ) -> None:
        """Store ``key``/``value`` ``(B, F*S, H, D)`` as frames ``[start_frame, start_frame + F)``; drop later ones."""
        raise NotImplementedError

    def _truncate_self_entry(self, entry: Any, state: TagState, end_frame: int) -> None:
        raise NotImplementedError

    def _evict_self_entry(self, entry: Any, state: TagState, before: int) -> None:
        """Drop the non-sink frames ``< before`` (windowed engines)."""
        raise NotImplementedError

    def _rotate_self_entry(self, entry: Any, state: TagState, rotate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every cached key ``k`` ``(B, tokens, H, D)`` by ``rotate(k)`` (RoPE re-basing)."""
        raise NotImplementedError

    def _copy_self_entry(self, entry: Any) -> Any:
        raise NotImplementedError

    def _self_entry_tensors(self, entry: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    def visible_prefix_frames(self, cache_tag: str, start_frame: int, first_chunk_frames: int) -> int:
        """How many cached frames a call at ``start_frame`` whose first chunk has ``first_chunk_frames`` frames
        attends to (every frame before it, or the window and sink)."""
        return self.window.visible_frames(start_frame, first_chunk_frames)

    def self_attention_kv(
        self,
        block_idx: int,
        cache_tag: str,
        key: torch.Tensor,
        value: torch.Tensor,
        start_frame: int,
        first_chunk_frames: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, prefix + L, H, D)`` to attend to: ``[visible cached prefix | this call]``.

        ``key``/``value`` are this call's ``(B, L, H, D)``; ``first_chunk_frames`` is the frame count of the call's
        first chunk (``None``: the call is one chunk). The prefix is in frame order, as the block masks expect.
        """
        if first_chunk_frames is None:
            first_chunk_frames = key.shape[1] // self._tags[cache_tag].frame_seqlen
        keys, values = self._self_prefix_pieces(block_idx, cache_tag, start_frame, first_chunk_frames)
        if not keys:
            return key, value
        return torch.cat([*keys, key], dim=1), torch.cat([*values, value], dim=1)

    def commit_store(
        self, cache_tag: str, start_frame: int, num_frames: int, chunk_layout: Sequence[int] | None = None
    ) -> None:
        """Record, once every block has appended, that frames ``[start_frame, start_frame + num_frames)`` exist, as
        the chunks ``chunk_layout`` (frame counts; one chunk when ``None``), each a boundary a later call may use."""
        state = self._tags[cache_tag]
        starts = [start_frame]
        for frames in (chunk_layout or (num_frames,))[:-1]:
            starts.append(starts[-1] + frames)
        state.chunk_starts = [s for s in state.chunk_starts if s < start_frame] + starts
        state.num_frames = start_frame + num_frames

    def truncate(self, cache_tag: str, end_frame: int) -> None:
        """Drop every frame ``>= end_frame`` of ``cache_tag`` (``end_frame`` must be a stored chunk boundary)."""
        state = self._tags.get(cache_tag)
        if state is None:
            return
        if end_frame >= state.num_frames:
            return
        if end_frame not in state.chunk_starts:
            raise ValueError(
                f"Cannot truncate cache_tag {cache_tag!r} at frame {end_frame}: stored chunks start at "
                f"{state.chunk_starts}."
            )
        for block_idx in range(self.num_blocks):
            self._truncate_self_entry(self._self_kv[block_idx][cache_tag], state, end_frame)
        state.chunk_starts = [s for s in state.chunk_starts if s < end_frame]
        state.num_frames = end_frame
        state.evicted_before = min(state.evicted_before, end_frame)

    def abort_store(self, cache_tag: str, start_frame: int, *, cross_filled: bool) -> None:
        """Undo a ``store_kv`` forward that failed midway: drop frames ``>= start_frame`` from every block (some
        blocks may already hold the new chunk) and forget cross K/V that the call was filling."""
        state = self._tags.get(cache_tag)
        if state is None:
            return
        for block_idx in range(self.num_blocks):
            self._truncate_self_entry(self._self_kv[block_idx][cache_tag], state, start_frame)
        state.chunk_starts = [s for s in state.chunk_starts if s < start_frame]
        state.num_frames = min(state.num_frames, start_frame)
        state.evicted_before = min(state.evicted_before, state.num_frames)
        if cross_filled:
            self.invalidate_cross(cache_tag)

    def rewind(self, cache_tag: str, num_frames: int) -> None:
        """Drop the newest ``num_frames`` frames of ``cache_tag`` (a whole number of stored chunks)."""
        stored = self.num_stored_frames(cache_tag)
        if not 0 <= num_frames <= stored:
            raise ValueError(f"Cannot rewind {num_frames} frames: cache_tag {cache_tag!r} holds {stored} frames.")
        self.truncate(cache_tag, stored - num_frames)

    def copy_tag(self, source_tag: str, target_tag: str) -> None:
        """Give ``target_tag`` a copy of every entry of ``source_tag`` (fork a rollout from a shared prefix)."""
        if source_tag not in self._tags:
            raise ValueError(f"cache_tag {source_tag!r} holds nothing to copy; stored tags: {sorted(self._tags)}.")
        self._tags[target_tag] = copy.copy(self._tags[source_tag])
        self._tags[target_tag].chunk_starts = list(self._tags[source_tag].chunk_starts)
        for block_idx in range(self.num_blocks):
            self._self_kv[block_idx][target_tag] = self._copy_self_entry(self._self_kv[block_idx][source_tag])
            self._cross_kv[block_idx][target_tag] = copy.copy(self._cross_kv[block_idx][source_tag])

    # ------------------------------------------------------------------ RoPE re-basing
    def rope_offset(self, cache_tag: str) -> int:
        """Temporal RoPE positions of ``cache_tag`` are ``frame - rope_offset`` (0 until re-based)."""
        state = self._tags.get(cache_tag)
        return 0 if state is None else state.rope_offset

    def rebase_positions(
        self, cache_tag: str, rope_offset: int, rotate: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Record the new ``rope_offset`` of ``cache_tag`` and re-rotate every cached key with ``rotate``.

        ``rotate`` maps ``(B, tokens, H, D)`` keys rotated for positions ``frame - old_offset`` to keys rotated for
        ``frame - rope_offset`` (a rotation by the difference on the temporal channels: RoPE rotations compose).
        """
        state = self._tags.get(cache_tag)
        if state is None:
            raise ValueError(f"cache_tag {cache_tag!r} holds nothing to re-base; stored tags: {sorted(self._tags)}.")
        for block_idx in range(self.num_blocks):
            self._rotate_self_entry(self._self_kv[block_idx][cache_tag], state, rotate)
        state.rope_offset = rope_offset

    # ------------------------------------------------------------------ cross-attention entries
    def cross_mode(
        self,
        cache_tag: str,
        conditioning: tuple[torch.Tensor | None, ...],
        *,
        store_kv: bool,
        grad_enabled: bool,
    ) -> CrossKVMode:
        """Decide, once per forward, whether cross-attention reads, fills or just computes its K/V."""
        state = self._tags.get(cache_tag)
        filled = state is not None and state.cross_source is not None
        same_source = filled and state.cross_source.matches(*conditioning)
        if filled and same_source and not grad_enabled:
            return CrossKVMode.READ
        if store_kv and not (filled and same_source):
            return CrossKVMode.FILL
        return CrossKVMode.COMPUTE

    def get_cross_kv(self, block_idx: int, cache_tag: str) -> CrossKVEntry:
        entry = self._cross_kv[block_idx][cache_tag]
        if not entry.is_init:
            raise RuntimeError(
                f"Cross K/V of block {block_idx}, cache_tag {cache_tag!r} were read before being filled."
            )
        return entry

    def set_cross_kv(
        self,
        block_idx: int,
        cache_tag: str,
        key: torch.Tensor,
        value: torch.Tensor,
        key_img: torch.Tensor | None = None,
        value_img: torch.Tensor | None = None,
    ) -> None:
        self._cross_kv[block_idx][cache_tag] = CrossKVEntry(key, value, key_img, value_img, is_init=True)

    def mark_cross_filled(self, cache_tag: str, source: ConditioningKey) -> None:
        """Record which conditioning filled the cross K/V of ``cache_tag`` (one key may serve several engines)."""
        self._tags[cache_tag].cross_source = source

    def invalidate_cross(self, cache_tag: str | None = None) -> None:
        """Forget the cross K/V of ``cache_tag`` (every tag when ``None``); the next ``store_kv`` call refills them."""
        tags = list(self._tags) if cache_tag is None else [cache_tag]
        for tag in tags:
            state = self._tags.get(tag)
            if state is None:
                continue
            state.cross_source = None
            for block_idx in range(self.num_blocks):
                entry = self._cross_kv[block_idx][tag]
                self._cross_kv[block_idx][tag] = CrossKVEntry(
                    torch.zeros_like(entry.key),
                    torch.zeros_like(entry.value),
                    None if entry.key_img is None else torch.zeros_like(entry.key_img),
                    None if entry.value_img is None else torch.zeros_like(entry.value_img),
                )

    # ------------------------------------------------------------------ memory and lifetime
    def self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the self-attention K/V held (all tags when ``cache_tag`` is ``None``): the cache formula
        (:func:`expected_self_cache_bytes`) over the :meth:`held_frames` tokens."""
        return self.allocated_self_cache_bytes(cache_tag)

    def allocated_self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the self-attention tensors the engine has allocated (preallocating engines: their capacity)."""
        return sum(
            t.numel() * t.element_size()
            for per_tag in self._self_kv
            for tag, entry in per_tag.items()
            if cache_tag is None or tag == cache_tag
            for t in self._self_entry_tensors(entry)
        )

    def cross_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes held by cross-attention K/V (all tags when ``cache_tag`` is ``None``)."""
        return sum(
            t.numel() * t.element_size()
            for per_tag in self._cross_kv
            for tag, entry in per_tag.items()
            if cache_tag is None or tag == cache_tag
            for t in entry.tensors()
        )

    def cache_bytes(self, cache_tag: str | None = None) -> int:
        return self.self_cache_bytes(cache_tag) + self.cross_cache_bytes(cache_tag)

    def clear(self, cache_tag: str | None = None) -> None:
        """Free the entries of ``cache_tag`` (every tag when ``None``)."""
        if cache_tag is None:
            self._self_kv = [{} for _ in range(self.num_blocks)]
            self._cross_kv = [{} for _ in range(self.num_blocks)]
            self._tags = {}
            return
        self._tags.pop(cache_tag, None)
        for per_tag in (*self._self_kv, *self._cross_kv):
            per_tag.pop(cache_tag, None)

    def __repr__(self) -> str:
        tags = {tag: state.num_frames for tag, state in self._tags.items()}
        return f"{type(self).__name__}(blocks={self.num_blocks}, frames_by_tag={tags})"
