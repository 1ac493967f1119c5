"""Block-causal attention masks over ``[visible cached prefix | tokens of this call]``, memoised.

One rule, one ``mask_mod``: a query of the chunk ending at frame ``e`` sees the key of frame ``k`` iff
``window.sees(k, e)`` (:meth:`AttentionWindow.sees`: ``k < e``, and inside the window and sink when there is one).
Chunks are laid out by :func:`fastgen_diffusers.chunking.chunk_layout`; keys are in frame order, as engines return
the prefix of a multi-chunk call. The SDPA boolean mask is that ``mask_mod`` materialised by torch's ``create_mask``,
the FlexAttention ``BlockMask`` is the same ``mask_mod`` given to ``create_block_mask``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


class BlockMaskMemo:
    """Masks already built, keyed by everything their pattern depends on.

    The pattern of a call depends on its start frame only through what its prefix holds and, near the start of the
    video, through which of its own frames are sink frames; calls that agree on those share one mask.
    """

    def __init__(self) -> None:
        self._masks: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def keys(self) -> list[tuple]:
        """``(backend, device, window, chunk_layout, frame_seqlen, sink_end, recent_frames, own_sink_frames)``."""
        return list(self._masks)

    def clear(self) -> None:
        self._masks = {}

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
        if backend not in MASK_BACKENDS:
            raise ValueError(f"`backend` must be one of {MASK_BACKENDS}, got {backend!r}.")
        device = torch.device(device)
        sink_end, recent_start = window.visible(start_frame, chunk_layout[0])
        key = (
            backend,
            device,
            window,
            tuple(chunk_layout),
            frame_seqlen,
            sink_end,
            start_frame - recent_start,
            min(start_frame, window.sink),
        )
        mask = self._masks.get(key)
        if mask is None:
            build = build_flex_mask if backend == "flex" else build_sdpa_mask
            mask = self._masks[key] = build(window, start_frame, chunk_layout, frame_seqlen, device)
        return mask
