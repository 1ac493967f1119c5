"""Block-causal attention masks and per-key attention biases over ``[visible cached prefix | tokens of this call]``,
memoised.

One rule, one ``mask_mod``: a query of the chunk ending at frame ``e`` sees the key of frame ``k`` iff
``window.sees(k, e)`` (:meth:`AttentionWindow.sees`: ``k < e``, and inside the window and sink when there is one).
Chunks are laid out by :func:`fastgen_diffusers.chunking.chunk_layout`; keys are in frame order, as engines return
the prefix of a multi-chunk call. The SDPA boolean mask is that ``mask_mod`` materialised by torch's ``create_mask``,
the FlexAttention ``BlockMask`` is the same ``mask_mod`` given to ``create_block_mask``.

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

from .window import AttentionWindow

MASK_BACKENDS = ("sdpa", "flex")


def key_frames(
    window: AttentionWindow, start_frame: int, chunk_layout: tuple[int, ...], frame_seqlen: int, device
) -> torch.Tensor:
    """``(prefix + L,)`` absolute latent frame of every key of ``[sink | recent | this call]`` (frame order)."""
    sink_end, recent_start = window.visible(start_frame, chunk_layout[0])
    frames = torch.cat(
        [
            torch.arange(sink_end),
            torch.arange(recent_start, start_frame),
            torch.arange(start_frame, start_frame + sum(chunk_layout)),
        ]
    )
    return frames.repeat_interleave(frame_seqlen).to(device)


def query_chunk_ends(start_frame: int, chunk_layout: tuple[int, ...], frame_seqlen: int, device) -> torch.Tensor:
    """``(L,)`` end frame (exclusive) of the chunk of every query token of this call."""
    ends, end = [], start_frame
    for frames in chunk_layout:
        end += frames
        ends.append(torch.full((frames * frame_seqlen,), end, dtype=torch.int64))
    return torch.cat(ends).to(device)


def block_causal_mask_mod(
    window: AttentionWindow, start_frame: int, chunk_layout: tuple[int, ...], frame_seqlen: int, device
) -> tuple[Callable, int, int]:
    """``(mask_mod, Q_LEN, KV_LEN)`` of a call at ``start_frame`` split into ``chunk_layout``."""
    keys = key_frames(window, start_frame, chunk_layout, frame_seqlen, device)
    ends = query_chunk_ends(start_frame, chunk_layout, frame_seqlen, device)

    def mask_mod(batch, head, q_idx, kv_idx):
        return window.sees(keys[kv_idx], ends[q_idx])

    return mask_mod, ends.shape[0], keys.shape[0]


def build_sdpa_mask(
    window: AttentionWindow, start_frame: int, chunk_layout: tuple[int, ...], frame_seqlen: int, device
) -> torch.Tensor:
    """Boolean ``(1, 1, L, prefix + L)`` mask (True = attend) for ``F.scaled_dot_product_attention``."""
    from torch.nn.attention.flex_attention import create_mask

    mask_mod, q_len, kv_len = block_causal_mask_mod(window, start_frame, chunk_layout, frame_seqlen, device)
    return create_mask(mask_mod, 1, 1, q_len, kv_len, device=device)


def build_flex_mask(
    window: AttentionWindow, start_frame: int, chunk_layout: tuple[int, ...], frame_seqlen: int, device
):
    """FlexAttention ``BlockMask`` of the same ``mask_mod`` as :func:`build_sdpa_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, q_len, kv_len = block_causal_mask_mod(window, start_frame, chunk_layout, frame_seqlen, device)
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

    The pattern of a call depends on its start frame only through what its prefix holds and, near the start of the
    video, through which of its own frames are sink frames; calls that agree on those share one mask.
    """

    max_biases = 64  # attention biases kept (least recently used dropped): a long rollout without a window sees
    # a new key layout every chunk, a windowed one cycles through a few

    def __init__(self) -> None:
        self._masks: dict[tuple, Any] = {}
        self._biases: OrderedDict[tuple, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def keys(self) -> list[tuple]:
        """``(backend, device, window, chunk_layout, frame_seqlen, sink_end, recent_frames, own_sink_frames)``."""
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
    ) -> Any:
        """The mask of a multi-chunk call (``backend``: ``"sdpa"`` or ``"flex"``), built on first use."""
        key = self._mask_key(backend, window, start_frame, chunk_layout, frame_seqlen, device)
        mask = self._masks.get(key)
        if mask is None:
            build = build_flex_mask if backend == "flex" else build_sdpa_mask
            mask = self._masks[key] = build(window, start_frame, chunk_layout, frame_seqlen, device)
        return mask

    @staticmethod
    def _mask_key(backend, window, start_frame, chunk_layout, frame_seqlen, device) -> tuple:
        if backend not in MASK_BACKENDS:
            raise ValueError(f"`backend` must be one of {MASK_BACKENDS}, got {backend!r}.")
        sink_end, recent_start = window.visible(start_frame, chunk_layout[0])
        return (
            backend,
            torch.device(device),
            window,
            tuple(chunk_layout),
            frame_seqlen,
            sink_end,
            start_frame - recent_start,
            min(start_frame, window.sink),
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
    ) -> tuple[Any, AttentionBias | None]:
        """``(mask, bias)`` of a biased call, built on first use (see :func:`build_attention_bias` for ``biased``).

        ``"sdpa"``: ``(float mask, None)``, the additive ``(1, 1, 1, Lk)`` bias of a single-chunk call, or for a
        multi-chunk call the ``(1, 1, L, Lk)`` sum of the bias and the block-causal mask (``-inf`` where it is False).
        ``"flex"``: ``(BlockMask or None, AttentionBias)``, the bias for a ``score_mod``.
        """
        multi_chunk = len(chunk_layout) > 1
        mask = self.get(backend, window, start_frame, chunk_layout, frame_seqlen, device) if multi_chunk else None
        pattern = self._mask_key(backend, window, start_frame, chunk_layout, frame_seqlen, device)
        key = (pattern if multi_chunk else (backend, torch.device(device), frame_seqlen), biased, log_bias)
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
