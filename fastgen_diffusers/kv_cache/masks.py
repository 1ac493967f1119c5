"""Block-causal attention masks and per-key attention biases over ``[visible cached prefix | tokens of this call]``,
memoised.

One rule, one ``mask_mod``: a query of the chunk ending at frame ``e`` sees the key of frame ``k`` iff ``k < e`` and,
under a window, ``k`` is pinned or among the window's ``room`` most recent frames (:meth:`SinkRule.sees
<fastgen_diffusers.kv_cache.sink.SinkRule.sees>`). The keys and whether each is pinned come from the ledger's plan of
the call (:class:`~fastgen_diffusers.kv_cache.ledger.KeyPlan`: the frames read, in order); this module never
recomputes them. Chunks are laid out by :func:`fastgen_diffusers.chunking.chunk_layout`. The SDPA boolean mask is
that ``mask_mod`` materialised by torch's ``create_mask``, the FlexAttention ``BlockMask`` is the same ``mask_mod``
given to ``create_block_mask``.

An additive attention bias (:class:`AttentionBias`) is built here from per-key-frame flags that the caller decides
(:meth:`fastgen_diffusers.context.CausalContext.self_attention_masks` says which keys are biased); this module only
lays the flags out over tokens, in the order the keys are read. For SDPA the bias is folded into one float mask (the
boolean mask's False turned into ``-inf``, plus the bias), for FlexAttention it stays a factored tensor that the
processor adds in a ``score_mod``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch._dynamo

from .ledger import KeyPlan, plan_keys, visible_prefix
from .sink import SinkRule
from .window import AttentionWindow

MASK_BACKENDS = ("sdpa", "flex")


def window_key_plan(window: AttentionWindow, start_frame: int, chunk_layout: tuple[int, ...]) -> KeyPlan:
    """The :class:`KeyPlan` of a call reading everything ``window`` shows (its sink as a fixed sink rule): the plan
    of a cache that holds every frame, for callers without an engine."""
    pins = SinkRule(window.sink)
    _, recent_start = window.visible(start_frame, chunk_layout[0])
    prefix = visible_prefix(window, pins, start_frame, recent_start)
    return plan_keys(pins, start_frame, sum(chunk_layout), prefix)


def key_offsets(keys: KeyPlan, frame_seqlen: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix + L,)`` offset from the call's start of every key token (-1 for a pinned frame of the prefix, seen
    by every query) and whether it is pinned."""
    offsets = torch.tensor([-1 if offset is None else offset for offset in keys.pattern()], dtype=torch.int64)
    pinned = torch.tensor(keys.pinned, dtype=torch.bool)
    return offsets.repeat_interleave(frame_seqlen).to(device), pinned.repeat_interleave(frame_seqlen).to(device)


def query_chunk_ends(chunk_layout: tuple[int, ...], frame_seqlen: int, device) -> torch.Tensor:
    """``(L,)`` end (exclusive, as an offset from the call's start) of the chunk of every query token of this call."""
    ends, end = [], 0
    for frames in chunk_layout:
        end += frames
        ends.append(torch.full((frames * frame_seqlen,), end, dtype=torch.int64))
    return torch.cat(ends).to(device)


def block_causal_mask_mod(
    window: AttentionWindow,
    start_frame: int,
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    device,
    keys: KeyPlan | None = None,
) -> tuple[Callable, int, int]:
    """``(mask_mod, Q_LEN, KV_LEN)`` of a call at ``start_frame`` split into ``chunk_layout`` reading the keys of
    ``keys`` (the ledger's plan; ``None``: :func:`window_key_plan`)."""
    keys = window_key_plan(window, start_frame, chunk_layout) if keys is None else keys
    offsets, pinned = key_offsets(keys, frame_seqlen, device)
    ends = query_chunk_ends(chunk_layout, frame_seqlen, device)
    room = window.room

    def mask_mod(batch, head, q_idx, kv_idx):
        key, end = offsets[kv_idx], ends[q_idx]
        if room is None:
            return key < end
        return (key < end) & (pinned[kv_idx] | (key >= end - room))

    return mask_mod, ends.shape[0], offsets.shape[0]


def build_sdpa_mask(
    window: AttentionWindow,
    start_frame: int,
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    device,
    keys: KeyPlan | None = None,
) -> torch.Tensor:
    """Boolean ``(1, 1, L, prefix + L)`` mask (True = attend) for ``F.scaled_dot_product_attention``."""
    from torch.nn.attention.flex_attention import create_mask

    mask_mod, q_len, kv_len = block_causal_mask_mod(window, start_frame, chunk_layout, frame_seqlen, device, keys)
    return create_mask(mask_mod, 1, 1, q_len, kv_len, device=device)


def build_flex_mask(
    window: AttentionWindow,
    start_frame: int,
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    device,
    keys: KeyPlan | None = None,
):
    """FlexAttention ``BlockMask`` of the same ``mask_mod`` as :func:`build_sdpa_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, q_len, kv_len = block_causal_mask_mod(window, start_frame, chunk_layout, frame_seqlen, device, keys)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device, _compile=False)


@dataclass(eq=False)
class AttentionBias:
    """An additive bias on the scaled attention logits, in factored form: query token ``q`` and key token ``k`` get
    ``rows[query_row[q], k]`` (``query_row`` ``None``: ``rows[0, k]`` for every query).

    Attributes:
        rows: ``(R, Lk)`` float32, one row per group of queries (the chunks of a call), keys in the order attended.
        query_row: ``(Lq,)`` int64 row of each query token, or ``None`` when there is one row.
    """

    rows: torch.Tensor
    query_row: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """``(1, 1, Lq or 1, Lk)`` float32: the bias as an additive SDPA mask."""
        rows = self.rows if self.query_row is None else self.rows[self.query_row]
        return rows[None, None]


def build_attention_bias(
    biased: Sequence[Sequence[bool]],
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    log_bias: float,
    device,
) -> AttentionBias:
    """The :class:`AttentionBias` adding ``log_bias`` to the keys flagged in ``biased`` and 0 elsewhere.

    Args:
        biased: one row per query group (one row: every query alike; else one per chunk of ``chunk_layout``), each a
            flag per key *frame* in the order the keys are read.
        chunk_layout: frame counts of the call's chunks (the queries of chunk ``i`` use row ``i``).
        frame_seqlen: tokens per frame (keys and queries).
        log_bias: the value added to the flagged keys' logits.
    """
    flags = torch.tensor(biased, dtype=torch.bool).repeat_interleave(frame_seqlen, dim=1)
    rows = torch.where(flags, log_bias, 0.0).to(torch.float32)
    query_row = None
    if len(biased) > 1:
        sizes = torch.tensor(chunk_layout) * frame_seqlen
        query_row = torch.arange(len(chunk_layout)).repeat_interleave(sizes).to(device)
    bias = AttentionBias(rows.to(device), query_row)
    # the key count changes with the cached prefix (and, on a static engine's fixed buffers, until a window's ring
    # is full): a dynamic size, so that compiled attention does not specialise on it
    torch._dynamo.maybe_mark_dynamic(bias.rows, 1)
    return bias


class BlockMaskMemo:
    """Masks already built, keyed by everything their pattern depends on.

    The pattern of a call depends on its start frame only through the keys the ledger plans (:class:`KeyPlan`): how
    many pinned and recent frames its prefix holds, each key's offset from the call's start (a pinned frame of the
    prefix is seen wherever it is) and which keys are pinned (a pinned frame of the call itself stays seen by its
    later chunks past the window's room); calls that agree on those share one mask.
    """

    max_masks = 64  # masks kept (least recently used dropped), as for the biases
    max_biases = 64  # attention biases kept (least recently used dropped): a long rollout without a window sees
    # a new key layout every chunk, a windowed one cycles through a few

    def __init__(self) -> None:
        self._masks: OrderedDict[tuple, Any] = OrderedDict()
        self._biases: OrderedDict[tuple, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def keys(self) -> list[tuple]:
        """``(backend, device, window, chunk_layout, frame_seqlen, pinned_frames, recent_frames, (pattern,
        pinned))``: the prefix's pinned and unpinned key frames, :meth:`KeyPlan.pattern` and :attr:`KeyPlan.pinned`
        (least recently used first)."""
        return list(self._masks)

    def clear(self) -> None:
        self._masks.clear()
        self._biases = OrderedDict()

    def view(self) -> Mapping[tuple, Any]:
        """The masks built so far by key (see :meth:`keys`): a live, read-only mapping."""
        return MappingProxyType(self._masks)

    @property
    def num_biases(self) -> int:
        """Attention biases held (see :meth:`bias`)."""
        return len(self._biases)

    def get(
        self,
        backend: str,
        window: AttentionWindow,
        start_frame: int,
        chunk_layout: tuple[int, ...],
        frame_seqlen: int,
        device,
        keys: KeyPlan | None = None,
    ) -> Any:
        """The mask of a multi-chunk call (``backend``: ``"sdpa"`` or ``"flex"``) reading the keys of ``keys`` (the
        ledger's plan; ``None``: :func:`window_key_plan`), built on first use."""
        keys = window_key_plan(window, start_frame, tuple(chunk_layout)) if keys is None else keys
        key = self._mask_key(backend, window, chunk_layout, frame_seqlen, device, keys)
        mask = self._masks.get(key)
        if mask is None:
            build = build_flex_mask if backend == "flex" else build_sdpa_mask
            mask = self._masks[key] = build(window, start_frame, chunk_layout, frame_seqlen, device, keys)
            while len(self._masks) > self.max_masks:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return mask

    @staticmethod
    def _mask_key(backend, window, chunk_layout, frame_seqlen, device, keys: KeyPlan) -> tuple:
        if backend not in MASK_BACKENDS:
            raise ValueError(f"`backend` must be one of {MASK_BACKENDS}, got {backend!r}.")
        return (
            backend,
            torch.device(device),
            window,
            tuple(chunk_layout),
            frame_seqlen,
            keys.prefix_pinned,
            keys.prefix_recent,
            (keys.pattern(), tuple(keys.pinned)),  # the mask reads whether each key, the call's own too, is pinned
        )

    def bias(
        self,
        backend: str,
        window: AttentionWindow,
        start_frame: int,
        chunk_layout: tuple[int, ...],
        frame_seqlen: int,
        device,
        biased: tuple[tuple[bool, ...], ...],
        log_bias: float,
        keys: KeyPlan | None = None,
    ) -> tuple[Any, AttentionBias | None]:
        """``(mask, bias)`` of a biased call, built on first use (see :func:`build_attention_bias` for ``biased``).

        ``"sdpa"``: ``(float mask, None)``, the additive ``(1, 1, 1, Lk)`` bias of a single-chunk call, or for a
        multi-chunk call the ``(1, 1, L, Lk)`` sum of the bias and the block-causal mask (``-inf`` where it is False).
        ``"flex"``: ``(BlockMask or None, AttentionBias)``, the bias for a ``score_mod``.
        """
        multi_chunk = len(chunk_layout) > 1
        if multi_chunk:
            keys = window_key_plan(window, start_frame, tuple(chunk_layout)) if keys is None else keys
            mask = self.get(backend, window, start_frame, chunk_layout, frame_seqlen, device, keys)
            pattern = self._mask_key(backend, window, chunk_layout, frame_seqlen, device, keys)
        else:
            if backend not in MASK_BACKENDS:
                raise ValueError(f"`backend` must be one of {MASK_BACKENDS}, got {backend!r}.")
            mask, pattern = None, (backend, torch.device(device), frame_seqlen)
        key = (pattern, biased, log_bias)
        built = self._biases.get(key)
        if built is None:
            bias = build_attention_bias(biased, chunk_layout, frame_seqlen, log_bias, device)
            if backend == "sdpa":
                dense = bias.dense()
                dense = dense if mask is None else torch.where(mask, dense, float("-inf"))
                torch._dynamo.maybe_mark_dynamic(dense, 3)
                built = (dense, None)
            else:
                built = (mask, bias)
            self._biases[key] = built
            while len(self._biases) > self.max_biases:
                self._biases.popitem(last=False)
        else:
            self._biases.move_to_end(key)
        return built
