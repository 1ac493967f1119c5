"""8-bit storage of cached self-attention K/V (``kv_cache_dtype``): 1 byte per element plus float32 scales.

A stored K or V ``(B, F*S, H, D)`` (``F`` frames of ``S`` tokens) becomes :class:`QuantizedFrames`: the elements in
``torch.int8`` or ``torch.float8_e4m3fn`` and one float32 scale per (batch sample, frame, head), ``(B, F, H)``:

* ``scale = amax / qmax`` over the frame's ``S x D`` elements of that head (``qmax`` 127 for int8, 448 for
  float8_e4m3fn; an all-zero frame gets scale 1);
* int8: ``q = round(x / scale)``; float8_e4m3fn: ``q = (x / scale)`` cast (round to nearest);
* read: ``x ~ q * scale`` in float32, cast to the compute dtype.

Scales are per frame so that a frame's bytes never depend on other frames (a chunk can be re-stored, evicted or
copied frame by frame), per head because heads differ in range, and per batch sample so that a video's numbers never
depend on the other videos of its batch. They cost ``4 / (S * D)`` bytes per element (0.002% for Wan2.1-1.3B at
480x832).

Storages quantize and dequantize only through their codec
(:class:`~fastgen_diffusers.kv_cache.storage.QuantizedCodec`); everything else handles :class:`QuantizedFrames` like
a tensor of tokens (slice by whole frames, copy into, clone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..settings.cache import storage_dtype_name


def resolve_kv_cache_dtype(kv_cache_dtype: Any) -> torch.dtype | None:
    """The storage dtype asked for: ``None`` (off: K/V stay in the compute dtype), ``torch.int8`` or
    ``torch.float8_e4m3fn``, given as a dtype or by name (parsed by
    :func:`~fastgen_diffusers.settings.cache.storage_dtype_name`). Anything else is a ``ValueError``."""
    dtype_name = storage_dtype_name(kv_cache_dtype)
    if dtype_name is None:
        return None
    dtype = getattr(torch, dtype_name, None)
    if dtype is None:
        raise ValueError(
            f"`kv_cache_dtype={kv_cache_dtype!r}` needs a torch with {dtype_name} (torch {torch.__version__} has "
            "none); use 'int8'."
        )
    return dtype


def _qmax(dtype: torch.dtype) -> float:
    return 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)


@dataclass(eq=False)
class QuantizedFrames:
    """``(B, F*S, H, D)`` K or V stored in 8 bits: ``data`` (int8 or float8_e4m3fn) and ``scale`` ``(B, F, H)``
    float32, one per sample, frame and head.

    Indexed like the token dimension of a tensor, in whole frames only: ``q[:, a:b]`` is a view of tokens ``[a, b)``
    (data and scales), ``q[:, a:b] = other`` copies another :class:`QuantizedFrames` into them.
    """

    data: torch.Tensor
    scale: torch.Tensor
    frame_seqlen: int

    @classmethod
    def zeros(
        cls, shape: tuple[int, ...], frame_seqlen: int, dtype: torch.dtype, device: torch.device
    ) -> QuantizedFrames:
        """Zeros (scale 1) of ``shape`` ``(B, F*S, H, D)`` stored as ``dtype``."""
        batch, tokens, heads, _ = shape
        data = torch.zeros(shape, dtype=dtype, device=device)
        return cls(data, torch.ones(batch, tokens // frame_seqlen, heads, device=device), frame_seqlen)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def new_zeros(self, shape: tuple[int, ...]) -> QuantizedFrames:
        return QuantizedFrames.zeros(shape, self.frame_seqlen, self.data.dtype, self.data.device)

    def _frames(self, index: Any) -> slice:
        """Frame slice of a ``[:, token_slice]`` index (token bounds must be whole frames)."""
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)):
            raise IndexError(f"QuantizedFrames takes [:, token_slice] indices, got {index!r}.")
        start, stop, step = index[1].indices(self.data.shape[1])
        if step != 1 or start % self.frame_seqlen or stop % self.frame_seqlen:
            raise IndexError(f"QuantizedFrames slices whole frames of {self.frame_seqlen} tokens, got {index[1]}.")
        return slice(start // self.frame_seqlen, stop // self.frame_seqlen)

    def __getitem__(self, index: Any) -> QuantizedFrames:
        return QuantizedFrames(self.data[index], self.scale[:, self._frames(index)], self.frame_seqlen)

    def __setitem__(self, index: Any, other: QuantizedFrames) -> None:
        if not isinstance(other, QuantizedFrames):
            raise TypeError("Only QuantizedFrames can be written into QuantizedFrames (quantize first).")
        self.data[index] = other.data
        self.scale[:, self._frames(index)] = other.scale

    def clone(self) -> QuantizedFrames:
        return QuantizedFrames(self.data.clone(), self.scale.clone(), self.frame_seqlen)

    def detach(self) -> QuantizedFrames:
        return self  # never part of a graph

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The stored K or V ``(B, F*S, H, D)`` in ``dtype`` (computed in float32)."""
        frames = self.data.float().unflatten(1, (-1, self.frame_seqlen))  # (B, F, S, H, D)
        return (frames * self.scale[:, :, None, :, None]).flatten(1, 2).to(dtype)


def quantize_frames(tensor: torch.Tensor, frame_seqlen: int, dtype: torch.dtype) -> QuantizedFrames:
    """Quantize ``tensor`` ``(B, F*S, H, D)`` to ``dtype`` with one scale per (sample, frame, head)."""
    qmax = _qmax(dtype)
    frames = tensor.detach().float().unflatten(1, (-1, frame_seqlen))  # (B, F, S, H, D)
    scale = frames.abs().amax(dim=(2, 4)) / qmax  # (B, F, H)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (frames / scale[:, :, None, :, None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return QuantizedFrames(scaled.to(dtype).flatten(1, 2), scale, frame_seqlen)


def stored_tensors(stored: torch.Tensor | QuantizedFrames) -> tuple[torch.Tensor, ...]:
    """The tensors that hold a stored K or V (data and scales of an 8-bit one)."""
    return stored.tensors() if isinstance(stored, QuantizedFrames) else (stored,)
