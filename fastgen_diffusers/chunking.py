"""How a run of latent frames is split into causal chunks.

One rule serves every caller (the transformer's block-causal mask, the rollout pipelines, training code):
the first chunk absorbs the remainder, or is a single frame when ``independent_first_frame`` is set.
"""

from __future__ import annotations


def chunk_layout(num_frames: int, chunk_size: int, independent_first_frame: bool = False) -> tuple[int, ...]:
    """Frame counts of the chunks that ``num_frames`` latent frames are split into.

    Examples: ``chunk_layout(21, 3) == (3,) * 7``, ``chunk_layout(8, 3) == (5, 3)``,
    ``chunk_layout(2, 3) == (2,)``, ``chunk_layout(7, 3, independent_first_frame=True) == (1, 3, 3)``.
    """
    if num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive number of latent frames, got {num_frames}.")
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive number of latent frames, got {chunk_size}.")
    if independent_first_frame:
        rest = num_frames - 1
        return (1,) + (chunk_layout(rest, chunk_size) if rest else ())
    num_chunks, remainder = divmod(num_frames, chunk_size)
    if num_chunks == 0:
        return (num_frames,)
    return (chunk_size + remainder,) + (chunk_size,) * (num_chunks - 1)


def chunk_bounds(layout: tuple[int, ...], start_frame: int = 0) -> list[tuple[int, int]]:
    """Absolute ``[start, end)`` latent-frame ranges of the chunks of ``layout`` placed at ``start_frame``."""
    bounds = []
    start = start_frame
    for size in layout:
        bounds.append((start, start + size))
        start += size
    return bounds
