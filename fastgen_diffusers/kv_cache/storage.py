"""Self-attention K/V storage: the tensors of one block and tag behind one narrow interface.

An engine keeps its bookkeeping (which frames a tag holds, which slot holds which frame, what a call reads, the
transaction) apart from the tensors, as llama.cpp keeps its cells apart from its K/V buffers. A storage holds the
K/V of latent frames of ``S`` tokens at integer **slots** and knows nothing else: no frames, no window, no sink, no
positions. Every storage implements the same operations:

========================  ================================================================================
``reserve(slots)``        make room for slots ``[0, slots)`` (a preallocated storage grows; others: nothing)
``write(slot, k, v)``     hold ``k``/``v`` ``(B, n*S, H, D)`` (compute dtype) at slots ``[slot, slot + n)``
``read(ranges)``          K and V pieces of the ascending, disjoint slot ranges, decoded to the compute dtype
``view()``                ``(key, value)`` tensors attention may write into and read in place, or ``None``
``evict(first, last)``    slots ``[first, last)`` hold nothing any more (their memory may be freed)
``truncate(end)``         slots ``>= end`` hold nothing any more
``map_keys(fn)``          replace every held key ``k`` by ``fn(k)`` (RoPE re-basing)
``copy()``                an independent storage with the same contents (a fork)
``clear()``               hold nothing
``nbytes``, ``held_bytes``  bytes allocated, and bytes of the K/V of a number of held slots (scales included)
``snapshot()``            a function giving the storage back as it is now (for a transaction's rollback)
``saved(first, last)``    for storages written in place: an undo of a write to slots ``[first, last)``
========================  ================================================================================

Two layouts implement it: :class:`SlotStorage` (preallocated buffers written in place; the engine maps frames to
slots, a ring under a window) and :class:`ChunkListStorage` (a list of runs of contiguous slots, one tensor each; the
engine's slot is the frame). Each takes a :class:`FrameCodec`: :data:`PLAIN` keeps the compute dtype,
:class:`QuantizedCodec` stores 8-bit data with one float32 scale per (sample, frame, head)
(:mod:`~fastgen_diffusers.kv_cache.quantize`): the 8-bit store is either layout with that codec, and every
storage passes one shared contract test (``tests/test_kv_storage.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch._dynamo

from .accounting import expected_scale_bytes, expected_self_cache_bytes, tensor_bytes
from .quantize import QuantizedFrames, quantize_frames, stored_tensors

__all__ = [
    "PLAIN",
    "ChunkListStorage",
    "FrameCodec",
    "KVStorage",
    "QuantizedCodec",
    "SlotCopy",
    "SlotStorage",
    "StorageLayout",
]

Stored = torch.Tensor | QuantizedFrames


@dataclass(frozen=True)
class StorageLayout:
    """The shape of what a storage holds: ``(batch_size, slots * frame_seqlen, num_heads, head_dim)`` K and V,
    computed in ``dtype`` on ``device``."""

    batch_size: int
    frame_seqlen: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def shape(self, slots: int) -> tuple[int, int, int, int]:
        return (self.batch_size, slots * self.frame_seqlen, self.num_heads, self.head_dim)


class FrameCodec:
    """How a storage keeps K/V: :meth:`encode` what is written, :meth:`decode` what is read. The plain codec keeps
    the compute dtype (attention may then read the storage in place)."""

    storage_dtype: torch.dtype | None = None  # None: the compute dtype

    def encode(self, tensor: torch.Tensor, layout: StorageLayout) -> Stored:
        return tensor

    def decode(self, stored: Stored, layout: StorageLayout) -> torch.Tensor:
        return stored

    def zeros(self, layout: StorageLayout, slots: int) -> Stored:
        return torch.zeros(layout.shape(slots), dtype=layout.dtype, device=layout.device)


PLAIN = FrameCodec()


class QuantizedCodec(FrameCodec):
    """8-bit storage (``torch.int8`` or ``torch.float8_e4m3fn``) with one float32 scale per (sample, frame, head)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.storage_dtype = dtype

    def encode(self, tensor: torch.Tensor, layout: StorageLayout) -> QuantizedFrames:
        return quantize_frames(tensor, layout.frame_seqlen, self.storage_dtype)

    def decode(self, stored: Stored, layout: StorageLayout) -> torch.Tensor:
        return stored.dequantize(layout.dtype)

    def zeros(self, layout: StorageLayout, slots: int) -> QuantizedFrames:
        return QuantizedFrames.zeros(layout.shape(slots), layout.frame_seqlen, self.storage_dtype, layout.device)


def codec_for(kv_cache_dtype: torch.dtype | None) -> FrameCodec:
    return PLAIN if kv_cache_dtype is None else QuantizedCodec(kv_cache_dtype)


@dataclass
class SlotCopy:
    """Tokens ``tokens`` of two buffers as they were before an in-place write; calling it writes them back."""

    key: Stored
    value: Stored
    tokens: slice
    kept_key: Stored
    kept_value: Stored

    def __call__(self) -> None:
        self.key[:, self.tokens] = self.kept_key
        self.value[:, self.tokens] = self.kept_value

    @property
    def nbytes(self) -> int:
        return tensor_bytes((*stored_tensors(self.kept_key), *stored_tensors(self.kept_value)))


class KVStorage:
    """The self-attention K/V of one block and tag (see the module docstring for the operations).

    Attributes:
        fixed_slots: whether slots are preallocated and reused (the engine maps frames to a ring of slots under a
            window), or a slot is a frame that is freed when evicted.
        writes_in_place: whether a write overwrites tensors an earlier snapshot still refers to (a transaction then
            keeps a copy of the slots first, :meth:`saved`).
    """

    fixed_slots: ClassVar[bool] = False
    writes_in_place: ClassVar[bool] = False

    def __init__(self, layout: StorageLayout, codec: FrameCodec = PLAIN, slots: int = 0) -> None:
        self.layout = layout
        self.codec = codec

    @property
    def num_slots(self) -> int:
        """Slots the storage spans: its capacity, or the end of its last held slot."""
        raise NotImplementedError

    def _tokens(self, first: int, last: int) -> slice:
        return slice(first * self.layout.frame_seqlen, last * self.layout.frame_seqlen)

    def reserve(self, slots: int, most: int | None = None) -> None:
        """Make room for slots ``[0, slots)``; a storage that grows may take up to ``most`` slots at once."""

    def write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, ranges: Sequence[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        raise NotImplementedError

    def view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K/V tensors attention may write a call's K/V into and read in place (its first valid slots), or
        ``None``: this storage is read through :meth:`read` (a list of runs, or 8-bit data)."""
        return None

    def evict(self, first: int, last: int) -> None:
        raise NotImplementedError

    def truncate(self, end: int) -> None:
        raise NotImplementedError

    def map_keys(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def copy(self) -> KVStorage:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors allocated."""
        return tensor_bytes(self.tensors())

    def held_bytes(self, held_slots: int) -> int:
        """Bytes of the K/V of ``held_slots`` held slots: what a storage that frees what it drops has allocated."""
        return self.nbytes

    def snapshot(self) -> Callable[[], KVStorage]:
        """A function that gives back this storage as it is now (with :meth:`saved` undoing in-place writes)."""
        kept = self.copy()
        return lambda: kept

    def saved(self, first: int, last: int) -> Callable[[], None] | None:
        """An undo of a write to slots ``[first, last)`` (``None``: the storage never writes in place)."""
        return None


class SlotStorage(KVStorage):
    """Preallocated K/V buffers ``(B, capacity * S, H, D)`` written in place (:class:`QuantizedFrames` under an
    8-bit codec); growing copies what they hold into buffers at least twice the size."""

    fixed_slots = True
    writes_in_place = True

    def __init__(self, layout: StorageLayout, codec: FrameCodec = PLAIN, slots: int = 1) -> None:
        super().__init__(layout, codec)
        self.key = _static_address(codec.zeros(layout, slots))
        self.value = _static_address(codec.zeros(layout, slots))

    @property
    def num_slots(self) -> int:
        """Slots allocated (the capacity)."""
        return self.key.shape[1] // self.layout.frame_seqlen

    def held_bytes(self, held_slots: int) -> int:
        """The cache formula over ``held_slots`` slots (never the capacity, which :attr:`nbytes` counts): K and V
        elements in the storage dtype, plus one float32 scale per (sample, slot, head) each under an 8-bit codec."""
        layout = self.layout
        quantized = isinstance(self.key, QuantizedFrames)
        data = self.key.data if quantized else self.key
        tokens = held_slots * layout.frame_seqlen
        held = expected_self_cache_bytes(1, layout.batch_size, layout.num_heads, tokens, layout.head_dim, data.dtype)
        if quantized:
            held += expected_scale_bytes(1, layout.batch_size, layout.num_heads, held_slots)
        return held

    def reserve(self, slots: int, most: int | None = None) -> None:
        """Grow to at least twice the capacity (at most ``most`` slots, at least ``slots``) when ``slots`` do not
        fit: a logarithmic number of copies over a rollout."""
        capacity = self.num_slots
        if slots <= capacity:
            return
        grown = max(slots, 2 * capacity if most is None else min(2 * capacity, most))
        self.key = self._grown(self.key, grown)
        self.value = self._grown(self.value, grown)

    def _grown(self, buffer: Stored, slots: int) -> Stored:
        grown = buffer.new_zeros(self.layout.shape(slots))
        grown[:, : buffer.shape[1]] = buffer
        return _static_address(grown)

    def write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        tokens = slice(slot * self.layout.frame_seqlen, slot * self.layout.frame_seqlen + key.shape[1])
        self.key[:, tokens] = self.codec.encode(key, self.layout)
        self.value[:, tokens] = self.codec.encode(value, self.layout)

    def read(self, ranges):
        keys, values = [], []
        for first, last in ranges:
            if first < last:
                tokens = self._tokens(first, last)
                keys.append(self.codec.decode(self.key[:, tokens], self.layout))
                values.append(self.codec.decode(self.value[:, tokens], self.layout))
        return keys, values

    def view(self):
        if self.codec.storage_dtype is not None:
            return None  # 8-bit data: read through `read`, which decodes
        return self.key, self.value

    def evict(self, first: int, last: int) -> None:
        """Nothing to free: a slot is overwritten by the next frame the engine puts there."""

    def truncate(self, end: int) -> None:
        """Nothing to free (see :meth:`evict`)."""

    def map_keys(self, fn):
        self.key[:, :] = self.codec.encode(fn(self.codec.decode(self.key, self.layout)), self.layout)

    def copy(self) -> SlotStorage:
        new = type(self).__new__(type(self))
        new.layout, new.codec = self.layout, self.codec
        new.key, new.value = self.key.clone(), self.value.clone()  # written in place: a fork needs its own
        return new

    def clear(self) -> None:
        self.key = _static_address(self.codec.zeros(self.layout, self.num_slots))
        self.value = _static_address(self.codec.zeros(self.layout, self.num_slots))

    def tensors(self) -> list[torch.Tensor]:
        return [*stored_tensors(self.key), *stored_tensors(self.value)]

    def snapshot(self) -> Callable[[], SlotStorage]:
        key, value = self.key, self.value  # in-place writes are undone by `saved`; grown buffers are dropped

        def restore() -> SlotStorage:
            self.key, self.value = key, value
            return self

        return restore

    def saved(self, first: int, last: int) -> SlotCopy:
        tokens = self._tokens(first, last)
        key, value = self.key, self.value
        return SlotCopy(key, value, tokens, key[:, tokens].clone(), value[:, tokens].clone())


class ChunkListStorage(KVStorage):
    """Runs of contiguous slots: ``keys[i]``/``values[i]`` ``(B, n*S, H, D)`` hold the slots that start at
    ``starts[i]`` (ascending; :class:`QuantizedFrames` under an 8-bit codec). A write keeps the tensor it is given
    (no copy) unless it is a view of a larger tensor; a run losing part of its slots keeps a copy of the rest (a view
    would pin what was dropped). Never written in place, so a copy shares the run tensors."""

    def __init__(self, layout: StorageLayout, codec: FrameCodec = PLAIN, slots: int = 0) -> None:
        super().__init__(layout, codec)
        self.keys: list[Stored] = []
        self.values: list[Stored] = []
        self.starts: list[int] = []

    def runs(self):
        """``(start, end, key, value)`` of every stored run."""
        seqlen = self.layout.frame_seqlen
        for start, key, value in zip(self.starts, self.keys, self.values):
            yield start, start + key.shape[1] // seqlen, key, value

    def replace(self, runs: list[tuple[int, Stored, Stored]]) -> None:
        self.starts = [start for start, _, _ in runs]
        self.keys = [key for _, key, _ in runs]
        self.values = [value for _, _, value in runs]

    def _kept(self, first: int, last: int) -> list[tuple[int, Stored, Stored]]:
        """The runs with slots ``[first, last)`` dropped (parts of a run kept as copies)."""
        runs = []
        for run_start, run_end, key, value in self.runs():
            if run_end <= first or run_start >= last:
                runs.append((run_start, key, value))
                continue
            for low, high in ((run_start, min(run_end, first)), (max(run_start, last), run_end)):
                if low < high:
                    tokens = self._tokens(low - run_start, high - run_start)
                    runs.append((low, key[:, tokens].clone(), value[:, tokens].clone()))
        return runs

    def write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        last = slot + key.shape[1] // self.layout.frame_seqlen
        key, value = (self._own(self.codec.encode(t, self.layout)) for t in (key, value))
        runs = self._kept(slot, last) if self.starts and (self.starts[-1] >= slot or self.num_slots > slot) else None
        if runs is None:  # the common case: an append after every held slot
            self.starts.append(slot)
            self.keys.append(key)
            self.values.append(value)
            return
        runs.append((slot, key, value))
        runs.sort(key=lambda run: run[0])
        self.replace(runs)

    @property
    def num_slots(self) -> int:
        return self.starts[-1] + self.keys[-1].shape[1] // self.layout.frame_seqlen if self.starts else 0

    @staticmethod
    def _own(stored: Stored) -> Stored:
        """``stored``, or a copy when it is a view of a larger tensor (kept as it is, it would pin that tensor)."""
        if isinstance(stored, torch.Tensor):
            if stored.untyped_storage().nbytes() > stored.numel() * stored.element_size():
                return stored.clone()
            return stored
        return stored  # quantized data are always new tensors

    def read(self, ranges):
        keys, values = [], []
        for run_start, run_end, key, value in self.runs():
            for low, high in ranges:
                first, last = max(low, run_start), min(high, run_end)
                if first >= last:
                    continue
                piece_key, piece_value = key, value
                if (first, last) != (run_start, run_end):
                    tokens = self._tokens(first - run_start, last - run_start)
                    piece_key, piece_value = key[:, tokens], value[:, tokens]
                keys.append(self.codec.decode(piece_key, self.layout))
                values.append(self.codec.decode(piece_value, self.layout))
        return keys, values

    def evict(self, first: int, last: int) -> None:
        if first < last and self.starts:
            self.replace(self._kept(first, last))

    def truncate(self, end: int) -> None:
        if self.starts and self.num_slots > end:
            self.replace(self._kept(end, self.num_slots))

    def map_keys(self, fn):
        self.keys = [self.codec.encode(fn(self.codec.decode(key, self.layout)), self.layout) for key in self.keys]

    def copy(self) -> ChunkListStorage:
        new = type(self).__new__(type(self))
        new.layout, new.codec = self.layout, self.codec
        new.keys, new.values, new.starts = list(self.keys), list(self.values), list(self.starts)
        return new

    def clear(self) -> None:
        self.keys, self.values, self.starts = [], [], []

    def tensors(self) -> list[torch.Tensor]:
        return [t for stored in (*self.keys, *self.values) for t in stored_tensors(stored)]


def _static_address(buffer: Stored) -> Stored:
    """Tell CUDA graph trees (``torch.compile(mode="reduce-overhead")``) that ``buffer`` keeps its address, so that the
    compiled attention's in-place writes into it are captured instead of disabling the graph. Unguarded: one graph
    serves the buffers of every block. No effect in eager."""
    if isinstance(buffer, torch.Tensor) and buffer.is_cuda:
        torch._dynamo.mark_static_address(buffer, guard=False)
    return buffer
