"""The plan of one call and the cache view each block's self-attention reads: one path for every storage.

An engine plans a call once per forward (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.plan_call`): which
slots it writes, which keys it reads in which order, and how it stores. Each block's self-attention then gets a
**cache view** from the engine (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.cache_view`) and calls
:meth:`attend` on it with the call's K/V; it never asks which storage it has:

* :class:`SlotView`: the storage's own buffers, read in place. The call's K/V are written into their slots
  (``write_index``) and attention reads the first valid slots, whose count is the first size of ``valid_length``
  ``(V, 0)``: a tensor shape that ``torch.compile`` treats as dynamic, so one graph serves every chunk.
* :class:`PrefixView`: the visible cached prefix, gathered in frame order right before the block runs
  (:meth:`PrefixView.load`, never traced) and dropped after it (:meth:`PrefixView.release`); attention reads
  ``[prefix | call]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo

from .window import AttentionWindow

__all__ = ["CallPlan", "PrefixView", "SlotPlan", "SlotView"]


@dataclass(eq=False)
class SlotPlan:
    """Where one call's K/V go in a storage read in place, and which slots it attends to.

    Attributes:
        write_index: ``(F*S,)`` int64 storage token index of every token of the call, in frame order.
        valid_length: ``(V, 0)`` empty tensor whose first size is the number of storage tokens the call attends to,
            the first ones (a shape, not a Python int: ``torch.compile`` sees a dynamic size).
        slot_frames: the latent frame each of those valid slots holds once the call's K/V are written, slot by slot
            (frame order until a window's ring wraps, then the sink followed by the ring's order).
        num_slots: slots of the storage (keys rotated at read time get one rotation per slot).
    """

    write_index: torch.Tensor
    valid_length: torch.Tensor
    slot_frames: tuple[int, ...] = ()
    num_slots: int = 0

    @property
    def valid_tokens(self) -> int:
        return self.valid_length.shape[0]


@dataclass(eq=False)
class CallPlan:
    """One call of one engine, planned once per forward and shared by every block, step and CFG branch.

    Attributes:
        cache_tag, start_frame, num_frames, first_chunk_frames, attention_window: the call.
        slots: the :class:`SlotPlan` when the storage is read in place, else ``None`` (the prefix is gathered).
    """

    cache_tag: str
    start_frame: int
    num_frames: int
    first_chunk_frames: int
    attention_window: AttentionWindow | None = None
    slots: SlotPlan | None = None

    @property
    def in_place(self) -> bool:
        """Whether the call's K/V are written into the storage by attention (then a store only records them)."""
        return self.slots is not None

    @property
    def slot_frames(self) -> tuple[int, ...] | None:
        """The frame of each key attention reads from the storage, in its order; ``None``: the gathered prefix (in
        frame order) followed by the call's frames."""
        return None if self.slots is None else self.slots.slot_frames

    @property
    def key_slots(self) -> int | None:
        """How many key positions attention reads (the storage's slots, of which the first valid ones are read), or
        ``None``: exactly the keys attended."""
        return None if self.slots is None else self.slots.num_slots


@dataclass(eq=False)
class SlotView:
    """A storage's buffers ``(B, C, H, D)`` read in place (see the module docstring)."""

    key: torch.Tensor
    value: torch.Tensor
    write_index: torch.Tensor
    valid_length: torch.Tensor

    def load(self) -> None:
        """Nothing to gather."""

    def release(self) -> None:
        """Nothing to drop."""

    store = False  # written in place: nothing to hand back

    def attend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the call's ``key``/``value`` ``(B, L, H, D)`` into their slots; the first valid slots."""
        self.key.index_copy_(1, self.write_index, key.to(self.key.dtype))
        self.value.index_copy_(1, self.write_index, value.to(self.value.dtype))
        valid = self.valid_length.shape[0]
        return self.key[:, :valid], self.value[:, :valid]


@dataclass(eq=False)
class PrefixView:
    """The visible cached prefix ``(B, P, H, D)`` in frame order (``None`` when nothing is visible), gathered by
    ``load_prefix`` right before the block runs, so that a forward holds one block's gathered copy at a time. With
    ``store=True`` :meth:`attend` hands the call's K/V back in ``new_key``/``new_value`` for the engine to store once
    the blocks have run."""

    load_prefix: Callable[[], tuple[torch.Tensor, torch.Tensor] | None]
    store: bool = False
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    new_key: torch.Tensor | None = None
    new_value: torch.Tensor | None = None

    @torch._dynamo.disable
    def load(self) -> None:
        """Gather the visible prefix (Python over the storage, never traced)."""
        prefix = self.load_prefix()
        self.key, self.value = (None, None) if prefix is None else prefix

    def release(self) -> None:
        """Drop the gathered prefix once the block has run (kept while gradients may run the block again)."""
        if not torch.is_grad_enabled():
            self.key = self.value = None

    def attend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[prefix | call]`` keys and values (and the call's handed back when storing)."""
        if self.store:
            # Contiguous: with fused projections `value` is a view that would keep the whole QKV output alive.
            self.new_key, self.new_value = key.detach().contiguous(), value.detach().contiguous()
        if self.key is None:
            return key, value
        return torch.cat([self.key, key], dim=1), torch.cat([self.value, value], dim=1)
