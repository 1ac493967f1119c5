"""The cross-attention cache: K/V of the conditioning per block and tag, and the conditioning that filled them.

Cross K/V are filled by the first ``store_kv`` call of a tag, read by later no-grad calls whose conditioning has the
same content, and recomputed (never read) when gradients are enabled or the conditioning differs. Reuse is decided
by content, never by tensor identity or version counter: a tensor changed in place without a version bump (through
``.data``, a NumPy view, ``inference_mode``) must not get the old prompt's K/V.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .accounting import tensor_bytes


class CrossKVMode(str, enum.Enum):
    """What a cross-attention processor does with its cache entry in one forward."""

    READ = "read"  # use the cached K/V, run no K/V projections
    FILL = "fill"  # compute K/V, use them, and store them in the entry
    COMPUTE = "compute"  # compute K/V and use them; the entry is left as it is


@dataclass
class CrossKVEntry:
    """Cross-attention K/V of one block and tag: text ``(B, L_text, H, D)``, optional image ``(B, L_img, H, D)``.

    Entries are replaced, never written in place (a snapshot may keep the old one).
    """

    key: torch.Tensor
    value: torch.Tensor
    key_img: torch.Tensor | None = None
    value_img: torch.Tensor | None = None
    is_init: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_img, self.value_img) if t is not None]


class ConditioningKey:
    """The content of the conditioning tensors one cross K/V entry was computed from (a private copy of each).

    :meth:`matches` compares the bits exactly (``torch.equal`` of integer views: one read of each tensor, and on an
    accelerator one synchronisation per call), so an in-place change that bypasses the version counter is seen.
    """

    def __init__(self, *tensors: torch.Tensor | None):
        self._copies = [None if t is None else t.detach().clone() for t in tensors]

    def matches(self, *tensors: torch.Tensor | None) -> bool:
        if len(tensors) != len(self._copies):
            return False
        for tensor, copy in zip(tensors, self._copies):
            if tensor is None or copy is None:
                if tensor is not copy:
                    return False
                continue
            if tensor.shape != copy.shape or tensor.dtype != copy.dtype or tensor.device != copy.device:
                return False
            if not torch.equal(_bits(tensor.detach()), _bits(copy)):
                return False
        return True


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size: bitwise equality (a NaN equals itself, and integer
    comparison is faster than floating-point comparison on CPU)."""
    if tensor.is_complex() or tensor.dtype == torch.bool:
        return tensor
    return tensor.view(_SAME_SIZE_INTS[tensor.element_size()])


class CrossKVCache:
    """Cross K/V entries ``[block_idx][cache_tag]`` and, per tag, the :class:`ConditioningKey` that filled them."""

    def __init__(self, num_blocks: int = 0) -> None:
        self.entries: list[dict[str, CrossKVEntry]] = [{} for _ in range(num_blocks)]
        self.sources: dict[str, ConditioningKey] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CrossKVCache) and (self.entries, self.sources) == (other.entries, other.sources)

    def mode(
        self,
        cache_tag: str,
        conditioning: tuple[torch.Tensor | None, ...],
        *,
        store_kv: bool,
        grad_enabled: bool,
        matches: dict | None = None,
    ) -> CrossKVMode:
        """Decide, once per forward, whether cross-attention reads, fills or just computes its K/V.

        ``matches`` (``id(source) -> bool``) lets engines that share a source compare the conditioning once.
        """
        source = self.sources.get(cache_tag)
        if source is None:
            same_source = False
        elif matches is None:
            same_source = source.matches(*conditioning)
        else:
            if id(source) not in matches:
                matches[id(source)] = source.matches(*conditioning)
            same_source = matches[id(source)]
        if same_source and not grad_enabled:
            return CrossKVMode.READ
        if store_kv and not same_source:
            return CrossKVMode.FILL
        return CrossKVMode.COMPUTE

    def ensure(self, cache_tag: str, shape: tuple[int, int, int], dtype, device, text_len: int, image_len: int):
        """Give every block a zero entry for ``cache_tag`` unless it has one of these lengths (``shape`` is
        ``(B, H, D)``); a new entry forgets the tag's source."""

        def zeros(length: int) -> torch.Tensor:
            return torch.zeros((shape[0], length, *shape[1:]), dtype=dtype, device=device)

        for per_tag in self.entries:
            entry = per_tag.get(cache_tag)
            image = 0 if entry is None or entry.key_img is None else entry.key_img.shape[1]
            if entry is None or entry.key.shape[1] != text_len or image != image_len:
                per_tag[cache_tag] = CrossKVEntry(
                    zeros(text_len),
                    zeros(text_len),
                    zeros(image_len) if image_len else None,
                    zeros(image_len) if image_len else None,
                )
                self.sources.pop(cache_tag, None)

    def get(self, block_idx: int, cache_tag: str) -> CrossKVEntry:
        entry = self.entries[block_idx][cache_tag]
        if not entry.is_init:
            raise RuntimeError(
                f"Cross K/V of block {block_idx}, cache_tag {cache_tag!r} were read before being filled."
            )
        return entry

    def set(self, block_idx: int, cache_tag: str, key, value, key_img=None, value_img=None) -> None:
        self.entries[block_idx][cache_tag] = CrossKVEntry(key, value, key_img, value_img, is_init=True)

    def mark_filled(self, cache_tag: str, source: ConditioningKey) -> None:
        self.sources[cache_tag] = source

    def invalidate(self, tags) -> None:
        """Forget the K/V of ``tags``; the next ``store_kv`` call of each refills them."""
        for tag in tags:
            self.sources.pop(tag, None)
            for per_tag in self.entries:
                entry = per_tag.get(tag)
                if entry is not None:
                    per_tag[tag] = CrossKVEntry(
                        *(
                            None if t is None else torch.zeros_like(t)
                            for t in (entry.key, entry.value, entry.key_img, entry.value_img)
                        )
                    )

    def snapshot(self, cache_tag: str) -> tuple:
        return [per_tag.get(cache_tag) for per_tag in self.entries], self.sources.get(cache_tag)

    def restore(self, cache_tag: str, snapshot: tuple) -> None:
        entries, source = snapshot
        for per_tag, entry in zip(self.entries, entries):
            if entry is None:
                per_tag.pop(cache_tag, None)
            else:
                per_tag[cache_tag] = entry
        if source is None:
            self.sources.pop(cache_tag, None)
        else:
            self.sources[cache_tag] = source

    def copy_tag(self, source_tag: str, target_tag: str) -> None:
        for per_tag in self.entries:
            per_tag[target_tag] = per_tag[source_tag]
        if source_tag in self.sources:
            self.sources[target_tag] = self.sources[source_tag]
        else:
            self.sources.pop(target_tag, None)

    def remove(self, cache_tag: str | None = None) -> None:
        if cache_tag is None:
            self.entries = [{} for _ in self.entries]
            self.sources = {}
            return
        self.sources.pop(cache_tag, None)
        for per_tag in self.entries:
            per_tag.pop(cache_tag, None)

    def nbytes(self, cache_tag: str | None = None) -> int:
        return tensor_bytes(
            t
            for per_tag in self.entries
            for tag, entry in per_tag.items()
            if cache_tag is None or tag == cache_tag
            for t in entry.tensors()
        )
