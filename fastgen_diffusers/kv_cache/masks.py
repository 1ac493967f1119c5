"""Block-causal attention masks over ``[cached prefix | tokens of this call]``.

A query token of chunk ``c`` (chunks laid out by :func:`fastgen_diffusers.chunking.chunk_layout`) sees every cached
prefix token and every token of this call up to the end of its own chunk.
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
    """Boolean ``(1, 1, L, prefix + L)`` mask, True = attend, for ``torch.nn.functional.scaled_dot_product_attention``."""
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
