"""Block-causal attention masks over ``[cached prefix | tokens of this call]``.

A query token of chunk ``c`` (chunks laid out by :func:`fastgen_diffusers.chunking.chunk_layout`) sees every cached
prefix token and every token of this call up to the end of its own chunk. Under a sliding window and sink
(windowed engines), it also sees only the sink frames and the most recent frames of the window (``*_window_mask``).
"""

from __future__ import annotations

import torch


def query_chunk_ends(chunk_layout: tuple[int, ...], frame_seqlen: int, prefix_tokens: int, device) -> torch.Tensor:
    """``(L,)`` key index (exclusive) where each query token's visible keys end."""
    ends = []
    end = prefix_tokens
    for frames in chunk_layout:
        end += frames * frame_seqlen
        ends.append(torch.full((frames * frame_seqlen,), end, dtype=torch.int64))
    return torch.cat(ends).to(device)


def build_sdpa_block_causal_mask(
    chunk_layout: tuple[int, ...], frame_seqlen: int, prefix_tokens: int, device
) -> torch.Tensor:
    """Boolean ``(1, 1, L, prefix + L)`` mask (True = attend) for ``F.scaled_dot_product_attention``."""
    num_tokens = sum(chunk_layout) * frame_seqlen
    ends = query_chunk_ends(chunk_layout, frame_seqlen, prefix_tokens, device)
    key_index = torch.arange(prefix_tokens + num_tokens, device=device)
    return (key_index[None, :] < ends[:, None])[None, None]


def build_flex_block_causal_mask(chunk_layout: tuple[int, ...], frame_seqlen: int, prefix_tokens: int, device):
    """FlexAttention ``BlockMask`` with the same pattern as :func:`build_sdpa_block_causal_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    num_tokens = sum(chunk_layout) * frame_seqlen
    ends = query_chunk_ends(chunk_layout, frame_seqlen, prefix_tokens, device)

    def mask_mod(batch, head, q_idx, kv_idx):
        return kv_idx < ends[q_idx]

    return create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=num_tokens, KV_LEN=prefix_tokens + num_tokens, device=device, _compile=False
    )


def window_key_frames(
    sink_end: int, recent_start: int, start_frame: int, num_frames: int, frame_seqlen: int, device
) -> torch.Tensor:
    """``(prefix + L,)`` absolute latent frame of every key of ``[sink | recent | this call]``, the key layout of a
    windowed engine (cached frames ``[0, sink_end)`` and ``[recent_start, start_frame)``, in frame order)."""
    frames = torch.cat(
        [
            torch.arange(sink_end),
            torch.arange(recent_start, start_frame),
            torch.arange(start_frame, start_frame + num_frames),
        ]
    )
    return frames.repeat_interleave(frame_seqlen).to(device)


def window_query_bounds(
    chunk_layout: tuple[int, ...], frame_seqlen: int, start_frame: int, window_frames: int, sink_frames: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ends, recent_starts)``, each ``(L,)``: a query of chunk ``[s, e)`` sees key frame ``k`` iff ``k < e`` and
    (``k < sink_frames`` or ``k >= e - (window_frames - sink_frames)``)."""
    ends = []
    end = start_frame
    for frames in chunk_layout:
        end += frames
        ends.append(torch.full((frames * frame_seqlen,), end, dtype=torch.int64))
    ends = torch.cat(ends).to(device)
    return ends, ends - (window_frames - sink_frames)


def build_sdpa_window_mask(
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    start_frame: int,
    sink_end: int,
    recent_start: int,
    window_frames: int,
    sink_frames: int,
    device,
) -> torch.Tensor:
    """Boolean ``(1, 1, L, prefix + L)`` block-causal mask under a sliding window and sink, True = attend.

    Keys are laid out as :func:`window_key_frames`; queries as in :func:`build_sdpa_block_causal_mask`.
    """
    num_frames = sum(chunk_layout)
    key_frames = window_key_frames(sink_end, recent_start, start_frame, num_frames, frame_seqlen, device)[None, :]
    ends, recent = window_query_bounds(chunk_layout, frame_seqlen, start_frame, window_frames, sink_frames, device)
    visible = (key_frames < ends[:, None]) & ((key_frames < sink_frames) | (key_frames >= recent[:, None]))
    return visible[None, None]


def build_flex_window_mask(
    chunk_layout: tuple[int, ...],
    frame_seqlen: int,
    start_frame: int,
    sink_end: int,
    recent_start: int,
    window_frames: int,
    sink_frames: int,
    device,
):
    """FlexAttention ``BlockMask`` with the same pattern as :func:`build_sdpa_window_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    num_frames = sum(chunk_layout)
    key_frames = window_key_frames(sink_end, recent_start, start_frame, num_frames, frame_seqlen, device)
    ends, recent = window_query_bounds(chunk_layout, frame_seqlen, start_frame, window_frames, sink_frames, device)

    def mask_mod(batch, head, q_idx, kv_idx):
        frame = key_frames[kv_idx]
        return (frame < ends[q_idx]) & ((frame < sink_frames) | (frame >= recent[q_idx]))

    return create_block_mask(
        mask_mod,
        B=None,
        H=None,
        Q_LEN=num_frames * frame_seqlen,
        KV_LEN=key_frames.shape[0],
        device=device,
        _compile=False,
    )
