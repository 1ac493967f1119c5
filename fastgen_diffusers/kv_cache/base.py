"""Shared storage, registration and rules of a KV-cache engine (one branch of a causal model).

An engine serves one branch of attention modules (``"main"``: ``transformer.blocks``, ``"vace"``:
``transformer.vace_blocks``). Its entries are addressed by a block index local to the branch and a cache tag:

==================  ==========================================  ==========================================
attribute           indexed by                                  holds
==================  ==========================================  ==========================================
``_self_kv``        ``[block_idx][cache_tag]``                  the self-attention entry (engine-specific)
``_cross_kv``       ``[block_idx][cache_tag]``                  a :class:`CrossKVEntry`
``_module_to_block````id(attn_module)``                         block index of a registered module
``_block_masks``    ``(device, num_frames, frame_seqlen,``      memoized block-causal masks
                    ``chunk_layout, mask_kind)``
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
    return 2 * num_layers * batch_size * num_heads * num_tokens * head_dim * torch.empty((), dtype=dtype).element_size()


class BaseKVCacheEngine:
    """Storage and rules shared by every engine; subclasses decide how self-attention K/V are laid out.

    Subclasses implement :meth:`_new_self_entry`, :meth:`get_self_prefix`, :meth:`append_self_kv`,
    :meth:`_truncate_self_entry`, :meth:`_copy_self_entry` and :meth:`_self_entry_tensors`, and may override
    :meth:`self_attention_kv` to avoid building ``[prefix | current]`` by concatenation.
    """

    def __init__(self) -> None:
        self._self_kv: list[dict[str, Any]] = []
        self._cross_kv: list[dict[str, CrossKVEntry]] = []
        self._module_to_block: dict[int, int] = {}
        self._registered_blocks: list[tuple[nn.Module, ...]] = []
        self._block_masks: dict[tuple, Any] = {}
        self._tags: dict[str, TagState] = {}

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
        # Registration is keyed by ``id(module)``; a deep copy of the model copies the modules too (through the same
        # memo), so the copied engine re-keys on the copied modules and resolves its own model's attention.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
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
    ) -> None:
        """Raise ``ValueError`` if a call cannot be served by what ``cache_tag`` holds. Writes nothing."""
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
        self._check_evicted(state, cache_tag, start_frame)
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

    def _check_evicted(self, state: TagState, cache_tag: str, start_frame: int) -> None:
        """Windowed engines raise when ``start_frame`` needs frames they no longer keep."""

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

    def get_self_prefix(self, block_idx: int, cache_tag: str, start_frame: int):
        """Cached ``(key, value)``, each ``(B, prefix_tokens, H, D)``, visible to a call at ``start_frame``.

        ``None`` when nothing is visible.
        """
        raise NotImplementedError

    def append_self_kv(
        self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor, start_frame: int
    ) -> None:
        """Store ``key``/``value`` ``(B, F*S, H, D)`` as frames ``[start_frame, start_frame + F)``; drop later frames."""
        raise NotImplementedError

    def _truncate_self_entry(self, entry: Any, state: TagState, end_frame: int) -> None:
        raise NotImplementedError

    def _copy_self_entry(self, entry: Any) -> Any:
        raise NotImplementedError

    def _self_entry_tensors(self, entry: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    def visible_prefix_frames(self, cache_tag: str, start_frame: int, num_frames: int) -> int:
        """How many cached frames a call of ``num_frames`` frames at ``start_frame`` attends to."""
        return start_frame

    def self_attention_kv(
        self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor, start_frame: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, prefix + L, H, D)`` to attend to: ``[visible cached prefix | this call]``."""
        prefix = self.get_self_prefix(block_idx, cache_tag, start_frame)
        if prefix is None:
            return key, value
        prefix_key, prefix_value = prefix
        return torch.cat([prefix_key, key], dim=1), torch.cat([prefix_value, value], dim=1)

    def commit_store(self, cache_tag: str, start_frame: int, num_frames: int) -> None:
        """Record, once every block has appended, that frames ``[start_frame, start_frame + num_frames)`` are stored."""
        state = self._tags[cache_tag]
        state.chunk_starts = [s for s in state.chunk_starts if s < start_frame] + [start_frame]
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
            raise RuntimeError(f"Cross K/V of block {block_idx}, cache_tag {cache_tag!r} were read before being filled.")
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

    def mark_cross_filled(self, cache_tag: str, conditioning: tuple[torch.Tensor | None, ...]) -> None:
        self._tags[cache_tag].cross_source = ConditioningKey(*conditioning)

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

    # ------------------------------------------------------------------ masks
    def block_mask(
        self,
        device: torch.device,
        num_frames: int,
        frame_seqlen: int,
        chunk_layout: tuple[int, ...],
        mask_kind: tuple,
        build: Callable[[], Any],
    ) -> Any:
        """Memoized mask; ``mask_kind`` names the backend and everything else the mask depends on."""
        key = (torch.device(device), num_frames, frame_seqlen, chunk_layout, mask_kind)
        mask = self._block_masks.get(key)
        if mask is None:
            mask = self._block_masks[key] = build()
        return mask

    # ------------------------------------------------------------------ memory and lifetime
    def self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes held by self-attention K/V (all tags when ``cache_tag`` is ``None``)."""
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
        """Free the entries of ``cache_tag`` (every tag and the memoized masks when ``None``)."""
        if cache_tag is None:
            self._self_kv = [{} for _ in range(self.num_blocks)]
            self._cross_kv = [{} for _ in range(self.num_blocks)]
            self._block_masks = {}
            self._tags = {}
            return
        self._tags.pop(cache_tag, None)
        for per_tag in (*self._self_kv, *self._cross_kv):
            per_tag.pop(cache_tag, None)

    def __repr__(self) -> str:
        tags = {tag: state.num_frames for tag, state in self._tags.items()}
        return f"{type(self).__name__}(blocks={self.num_blocks}, frames_by_tag={tags})"
