"""``CacheSettings``: what the KV cache keeps and how its keys are positioned (the engines' settings of a call).

The rules of the engine options, each stated once here (the engines' constructors ask the same functions):

* the window and sink: :class:`~fastgen_diffusers.settings.window.AttentionWindow`;
* key positions (:func:`check_key_positions`): ``"window"`` and ``"anchor"`` need a window; the EMA sink
  (``sink_update="ema"``) needs sink frames and keys stored before RoPE; ``sink_decay`` is in ``(0, 1)``;
* ``sink_decay`` is the EMA's: it is refused without ``sink_update="ema"`` (:class:`CacheSettings`);
* storage dtype (:func:`check_storage_dtype`): 8-bit names, and no 8-bit cache under the EMA sink;
* the attention bias on cached frames is in ``[0.01, 1]``;
* the EMA eviction rule, which depends on the chunks: :meth:`CacheSettings.check_chunks` (stated in
  :func:`~fastgen_diffusers.settings.window.check_ema_eviction`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .base import SettingsValue, merge_values, setting
from .window import AttentionWindow, check_ema_chunks

ENGINE_KINDS = ("static", "vanilla")
KV_CACHE_DTYPE_NAMES = ("float8_e4m3fn", "int8")
SINK_UPDATES = ("fixed", "ema")
DEFAULT_SINK_DECAY = 0.999
ATTENTION_BIAS_RANGE = (0.01, 1.0)


class KeyPositions(NamedTuple):
    """What a positions mode asks of the window and the stored keys."""

    needs_window: bool
    keys_before_rope: bool
    # every position stays below the window size: a stream of any length stays inside the RoPE table
    bounded: bool = False


# The positions modes of the cached keys (the engines' rotations: kv_cache/positions.py).
KEY_POSITIONS = {
    "absolute": KeyPositions(needs_window=False, keys_before_rope=False),
    "window": KeyPositions(needs_window=True, keys_before_rope=True, bounded=True),
    "anchor": KeyPositions(needs_window=True, keys_before_rope=True),
}


def check_key_positions(
    window: AttentionWindow,
    rope_positions: Any,
    sink_update: Any,
    sink_decay: Any,
    *,
    window_name: str = "attention_window",
    sink_name: str = "sink_frames",
) -> None:
    """Raise ``ValueError`` for a positions mode or sink update that cannot work with ``window``.

    * ``rope_positions`` must be one of :data:`KEY_POSITIONS`; ``"window"`` and ``"anchor"`` need a sliding window
      (positions are slots of it, or the sink moved next to it);
    * ``sink_update`` must be ``"fixed"`` or ``"ema"``; ``"ema"`` needs sink frames and keys stored before RoPE (an
      average of keys rotated for different frames mixes their positions), so ``rope_positions`` other than
      ``"absolute"``;
    * ``sink_decay`` must be a number in ``(0, 1)``.
    """
    if not isinstance(rope_positions, str) or rope_positions not in KEY_POSITIONS:
        raise ValueError(f"`rope_positions` must be one of {tuple(KEY_POSITIONS)}, got {rope_positions!r}.")
    mode = KEY_POSITIONS[rope_positions]
    if mode.needs_window and not window.bounded:
        raise ValueError(
            f"`rope_positions={rope_positions!r}` positions keys within the sliding window and its sink: set "
            f"`{window_name}` as well (or use rope_positions='absolute')."
        )
    if not isinstance(sink_update, str) or sink_update not in SINK_UPDATES:
        raise ValueError(f"`sink_update` must be one of {SINK_UPDATES}, got {sink_update!r}.")
    if isinstance(sink_decay, bool) or not isinstance(sink_decay, (int, float)) or not 0 < sink_decay < 1:
        raise ValueError(f"`sink_decay` must be a number in (0, 1) (exclusive), got {sink_decay!r}.")
    if sink_update == "ema":
        if not window.sink:
            raise ValueError(
                f"`sink_update='ema'` averages evicted frames into the sink: set `{sink_name}` > 0 (and "
                f"`{window_name}`), or use sink_update='fixed'."
            )
        if not mode.keys_before_rope:
            unrotated = tuple(name for name, entry in KEY_POSITIONS.items() if entry.keys_before_rope)
            raise ValueError(
                "`sink_update='ema'` averages the keys of frames at different positions, which needs keys stored "
                f"before RoPE: use rope_positions in {unrotated}, not 'absolute' (or sink_update='fixed')."
            )


def check_rope_table(
    num_latent_frames: int,
    rope_table: int,
    rope_positions: str | None = None,
    *,
    positions_bounded: bool = False,
    rope_rebasing: bool = False,
) -> None:
    """Raise ``ValueError`` when a rollout of ``num_latent_frames`` runs past the transformer's RoPE table of
    ``rope_table`` frames (``rope_max_seq_len``) with positions that do not stay inside it: a positions mode whose
    positions stay within the window (``"window"``) serves a video of any length, as does a policy that keeps positions
    below a few chunks (``positions_bounded``) or a transformer that re-bases its positions (``rope_rebasing``)."""
    mode = KEY_POSITIONS.get(rope_positions or "absolute")
    bounded = mode is not None and mode.bounded
    if num_latent_frames > rope_table and not (rope_rebasing or bounded or positions_bounded):
        raise ValueError(
            f"{num_latent_frames} latent frames run past the transformer's RoPE table of {rope_table} frames "
            "(`rope_max_seq_len`); ask for fewer `num_frames`, or call `pipe.transformer.enable_rope_rebasing()` "
            "(with an `attention_window`), or use `rope_positions='window'` (positions within the window) for longer "
            "videos."
        )


def storage_dtype_name(kv_cache_dtype: Any) -> str | None:
    """The 8-bit storage dtype's name (``"int8"``, ``"float8_e4m3fn"``), given by name or as a dtype (any object
    whose ``str`` is ``torch.<name>``); ``None`` for none. ``ValueError`` for anything else."""
    if kv_cache_dtype is None:
        return None
    accepted = f"None or one of {KV_CACHE_DTYPE_NAMES} (a torch dtype or its name)"
    if isinstance(kv_cache_dtype, str):
        name = kv_cache_dtype.removeprefix("torch.")
    elif type(kv_cache_dtype).__name__ == "dtype":
        name = str(kv_cache_dtype).removeprefix("torch.")
    else:
        raise ValueError(f"`kv_cache_dtype` must be {accepted}, got {kv_cache_dtype!r}.")
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"`kv_cache_dtype` must be {accepted}, got {kv_cache_dtype!r}.")
    return name


def check_storage_dtype(kv_cache_dtype: Any, sink_update: str = "fixed") -> str | None:
    """The storage dtype's name (:func:`storage_dtype_name`), or a ``ValueError``: an 8-bit cache with
    ``sink_update="ema"``, whose updates of ``(1 - sink_decay)`` of a difference (0.001 for Reward Forcing) are far
    below the 8-bit resolution of the stored sink (1/254 of its range): re-quantized, the sink would not follow."""
    name = storage_dtype_name(kv_cache_dtype)
    if name is not None and sink_update == "ema":
        raise ValueError(
            f"`sink_update='ema'` cannot be combined with an 8-bit `kv_cache_dtype` ({kv_cache_dtype!r}): each EMA "
            "step moves the stored sink by less than its 8-bit resolution. Use kv_cache_dtype=None or "
            "sink_update='fixed'."
        )
    return name


def check_recache_keeps_sink(sink_update: str | None, recaches: bool) -> None:
    """Raise ``ValueError`` (before any work) for a recache (``recaches``: ``recache=True`` with a prompt switch)
    under ``sink_update="ema"``: the EMA sink holds every frame that left the window, folded in, which re-running the
    held chunks cannot rebuild (re-running the sink's chunk would drop them, and the re-run chunks would be folded in
    later in place of the ones the stream made); a switch to the same prompt would change the video."""
    if recaches and sink_update == "ema":
        raise ValueError(
            "`recache=True` cannot run under `sink_update='ema'`: the EMA sink holds the frames that left the window, "
            "folded in, which a recache of the held chunks cannot rebuild. Accepted: recache=False (the new prompt "
            "still conditions every later chunk) or sink_update='fixed'."
        )


def merge_cache(stored: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any]:
    """``call``'s cache values over ``stored``'s, field by field (a call keeping its own engines,
    ``kv_cache_engine=None``, takes none of the stored ones), with one rule for the sink: a call naming its own
    ``sink_update`` takes its own ``sink_decay`` only (the stored decay belongs to the stored sink rule)."""
    if call.get("kv_cache_engine", "static") is None:
        return dict(call)
    stored = dict(stored)
    if call.get("sink_update") is not None:
        stored["sink_decay"] = None
    return merge_values(CacheSettings, stored, call)


@dataclass(frozen=True)
class CacheSettings(SettingsValue):
    """The KV cache of a call. ``None`` fields are unset: a stored value (or the default) stands."""

    merge_rule = staticmethod(merge_cache)  # a call's own sink rule takes its own decay; kv_cache_engine=None its own

    kv_cache_engine: str | None = setting(
        "static",
        "'static' (buffers allocated once, written in place), 'vanilla' (a list of chunk tensors) or None (keep the "
        "engines set on the transformer).",
        stored=False,
    )
    attention_window: int | None = setting(
        None,
        "Sliding attention window in latent frames, the sink and the chunk included (Self-Forcing's "
        "local_attn_size); under the rolling policy the frames one forward attends to (21).",
    )
    sink_frames: int | None = setting(None, "First latent frames kept inside the window for ever (sink_size).")
    rope_positions: str | None = setting(
        None,
        "Temporal RoPE positions of the cached keys: 'absolute' (default) or 'window' (Reward Forcing: slots of the "
        "window, so a stream never leaves the RoPE table; needs a window).",
    )
    sink_update: str | None = setting(
        None,
        "'fixed' (default: the sink keeps its first K/V) or 'ema' (Reward Forcing: evicted frames are averaged into "
        "the sink; needs sink frames, rope positions 'window' and chunks of the sink's size).",
    )
    sink_decay: float | None = setting(None, f"Decay of the EMA sink in (0, 1) ({DEFAULT_SINK_DECAY} by default).")
    kv_cache_dtype: str | None = setting(
        None, "8-bit storage of the cached K/V: 'int8' or 'float8_e4m3fn' (default: the compute dtype)."
    )
    kv_cache_attention_bias: float | None = setting(
        None,
        "Attention weight on cached frames in [0.01, 1] (Krea: 0.3): log(bias) is added to the logits of the cached "
        "keys except the first frame's; 1 (default) adds no mask.",
    )

    def __post_init__(self) -> None:
        engine = self.kv_cache_engine
        if engine is not None and (not isinstance(engine, str) or engine not in ENGINE_KINDS):
            raise ValueError(f"`kv_cache_engine` must be one of {ENGINE_KINDS} or None, got {engine!r}.")
        window = AttentionWindow.from_arguments(self.attention_window, self.sink)
        if engine is None and window.bounded:
            raise ValueError("`attention_window`/`sink_frames` need a `kv_cache_engine` ('static' or 'vanilla').")
        if engine is None and (self.positions, self.update) != ("absolute", "fixed"):
            raise ValueError(
                "`rope_positions`/`sink_update`/`sink_decay` configure the engines a `kv_cache_engine` ('static' or "
                "'vanilla') builds; with kv_cache_engine=None set them on your own engines."
            )
        check_key_positions(window, self.positions, self.update, self.decay)
        if self.sink_decay is not None and self.update != "ema":
            raise ValueError(
                f"`sink_decay={self.sink_decay!r}` is the decay of the EMA sink: it needs `sink_update='ema'` "
                f"(got sink_update={self.update!r}). Accepted without it: sink_decay=None."
            )
        dtype = check_storage_dtype(self.kv_cache_dtype, self.update)
        object.__setattr__(self, "kv_cache_dtype", dtype)
        if dtype is not None and engine is None:
            raise ValueError("`kv_cache_dtype` needs a `kv_cache_engine` ('static' or 'vanilla').")
        bias = self.kv_cache_attention_bias
        if bias is not None:
            low, high = ATTENTION_BIAS_RANGE
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= float(bias) <= high:
                raise ValueError(f"`kv_cache_attention_bias` must be a number in [{low}, {high:g}], got {bias!r}.")

    # ------------------------------------------------------------------ resolved values
    @property
    def sink(self) -> int:
        return 0 if self.sink_frames is None else self.sink_frames

    @property
    def positions(self) -> str:
        return "absolute" if self.rope_positions is None else self.rope_positions

    @property
    def update(self) -> str:
        return "fixed" if self.sink_update is None else self.sink_update

    @property
    def decay(self) -> float:
        return DEFAULT_SINK_DECAY if self.sink_decay is None else float(self.sink_decay)

    @property
    def window(self) -> AttentionWindow:
        return AttentionWindow(self.attention_window, self.sink)

    def engine_options(self) -> dict[str, Any]:
        """The engines' keyword arguments (``make_engines``) of these settings."""
        return {
            "window_frames": self.attention_window,
            "sink_frames": self.sink,
            "rope_positions": self.positions,
            "sink_update": self.update,
            "sink_decay": self.decay,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    # ------------------------------------------------------------------ rules that need the chunks
    def check_chunks(self, chunk_bounds: Sequence[tuple[int, int]]) -> None:
        """Raise ``ValueError`` when a chunk of ``chunk_bounds`` does not fit the window, or an eviction does not suit
        the EMA sink (before any work)."""
        window = self.window
        window.check_chunks(chunk_bounds)
        if self.update == "ema":
            check_ema_chunks(window, chunk_bounds)

    def check_chunk_size(self, chunk_size: int, independent_first_frame: bool = False) -> None:
        """:meth:`check_chunks` for every rollout of chunks of ``chunk_size`` frames (a stored setting: checked for
        rollouts long enough to slide the window several times)."""
        frames = (self.attention_window or 0) + 4 * max(chunk_size, self.sink) + 1
        first = 1 if independent_first_frame else chunk_size
        bounds, start = [(0, first)], first
        while start < frames:
            bounds.append((start, start + chunk_size))
            start += chunk_size
        self.check_chunks(bounds)
