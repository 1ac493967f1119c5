"""Remembers which conditioning filled a cross-attention cache, so a stale prompt is never reused silently."""

from __future__ import annotations

import weakref

import torch


class ConditioningKey:
    """Identity (and, failing that, value) of the conditioning tensors one cross K/V entry was computed from.

    ``matches`` is O(1) when called again with the very same, unmodified tensor objects, and falls back to an exact
    value comparison against a private copy otherwise (a tensor freed and reallocated at the same address never
    fools it).
    """

    def __init__(self, *tensors: torch.Tensor | None):
        self._refs = [None if t is None else weakref.ref(t) for t in tensors]
        # Inference tensors track no version: for them only the value comparison below is trusted.
        self._versions = [None if t is None or t.is_inference() else t._version for t in tensors]
        self._copies = [None if t is None else t.detach().clone() for t in tensors]

    def matches(self, *tensors: torch.Tensor | None) -> bool:
        if len(tensors) != len(self._copies):
            return False
        for tensor, ref, version, copy in zip(tensors, self._refs, self._versions, self._copies):
            if tensor is None or copy is None:
                if tensor is not copy:
                    return False
                continue
            if version is not None and ref() is tensor and not tensor.is_inference() and tensor._version == version:
                continue
            if tensor.shape != copy.shape or tensor.dtype != copy.dtype or tensor.device != copy.device:
                return False
            if not torch.equal(tensor.detach(), copy):
                return False
        return True
