"""``AttentionWindow`` lives in :mod:`fastgen_diffusers.settings.window` (torch-free, shared by the settings values,
engines, masks and pipelines); re-exported here for the engines' imports."""

from ..settings.window import AttentionWindow, check_ema_chunks, check_ema_eviction

__all__ = ["AttentionWindow", "check_ema_chunks", "check_ema_eviction"]
