"""``WanCausalTransformer3DModel``: a diffusers Wan transformer that runs chunk by chunk on a KV cache."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.models._modeling_parallel import ContextParallelConfig
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel
from diffusers.utils import apply_lora_scale, logging
from torch import nn

from ..chunking import chunk_layout
from ..context import CausalBlockView, CausalContext
from ..kv_cache import AttentionWindow, BaseKVCacheEngine, CrossKVMode, KVCacheEngine
from ..kv_cache.masks import BlockMaskMemo
from ..parallel import (
    check_context_parallel_config,
    check_frame_tokens,
    context_parallel_config,
    gather_frames,
    shard_frames,
)
from ..processors import WanCausalAttnProcessor, WanCausalCrossAttnProcessor, apply_rotary_emb
from ..processors.attention import BlockAttentionInputs
from .attention_inputs import build_attention_inputs, query_rotations, store_attention_outputs
from .blocks import WanCausalTransformerBlock, causal_block_store_only, is_compiled_block
from .call_checks import check_transformer_inputs, same_timestep_values
from .rope import CausalRotaryTables

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

MASK_BACKEND_CHOICES = ("auto", "sdpa", "flex")


def timestep_sinusoid_fp64(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's ``[cos, sin]`` timestep embedding ``(N, dim)`` computed in float64, as the original Wan code does.

    Same formula as diffusers' ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)``, which works in float32
    (about 3e-5 off at t~1000 on the output of a tiny model).
    """
    dtype = torch.float32 if timesteps.device.type == "mps" else torch.float64
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=dtype, device=timesteps.device) / half)
    args = timesteps.to(dtype)[:, None] * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.nn.functional.pad(embedding, (0, 1))
    return embedding


@dataclass(eq=False)
class ForwardCall:
    """What :meth:`CausalWanMixin._begin_forward` decided for one forward (outside any compiled region).

    Attributes:
        ctx: the forward's :class:`CausalContext`.
        attention_inputs: per engine branch, one :class:`BlockAttentionInputs` per block.
        views: one :class:`CausalBlockView` per block index (``ctx.at_block(i)``), what blocks ``i`` of every branch
            hand their processors.
        rotary_emb: ``(1, F*S, 1, head_dim/2, 2)`` float32 rotations of the call's tokens (complex64 as real pairs).
        temb: ``(B, F, D)`` per-frame timestep embedding (the output head's modulation).
        timestep_proj: ``(B, F, 6, D)`` per-frame block modulation.
        grid: post-patch ``(F, H', W')``.
        embed_context: whether some cross-attention computes K/V (else the context embedding is skipped).
        conditioning: ``(encoder_hidden_states, encoder_hidden_states_image)`` as given.
    """

    ctx: CausalContext
    attention_inputs: dict[str, list[BlockAttentionInputs]]
    views: tuple[CausalBlockView, ...]
    rotary_emb: torch.Tensor
    temb: torch.Tensor
    timestep_proj: torch.Tensor
    grid: tuple[int, int, int]
    embed_context: bool
    conditioning: tuple


# The config fields a causal model adds to its Wan base (no parameters).
CAUSAL_CONFIG_KEYS = ("chunk_size", "independent_first_frame")


class CausalWanMixin:
    """The causal machinery shared by the causal Wan models (T2V/I2V and VACE); adds no parameters.

    A model class lists this mixin before its diffusers base, calls :meth:`_init_causal` at the end of ``__init__``
    and implements ``kv_cache_branches()`` (the blocks each engine branch owns) and ``_forward_blocks`` (the block
    loop of one call); :meth:`_causal_forward` does the rest of a forward: validation, per-frame timestep embedding,
    RoPE at ``start_frame``, the :class:`CausalContext`, committing or undoing the cache writes and the output head.
    """

    @staticmethod
    def _wan_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A causal ``__init__``'s arguments (its ``locals()`` on entry) as its Wan base's ``__init__`` takes them: all
        but the causal config fields (:data:`CAUSAL_CONFIG_KEYS`)."""
        return {k: v for k, v in arguments.items() if k not in ("self", "__class__", *CAUSAL_CONFIG_KEYS)}

    def _init_causal(
        self, chunk_size: int, patch_size: tuple[int, ...], attention_head_dim: int, rope_max_seq_len: int
    ) -> None:
        """Validate the causal config, re-class ``self.blocks``, install the processors and attach fresh engines."""
        if chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive number of latent frames, got {chunk_size}.")
        if patch_size[0] != 1:
            raise ValueError(
                f"Causal chunking works on latent frames and needs a temporal patch of 1, got {patch_size}."
            )
        # The blocks gain a per-frame forward; the causal block classes add no state, so the instances built by the
        # parent are re-classed in place (no second allocation of the weights).
        for block in self.blocks:
            block.__class__ = WanCausalTransformerBlock
        self.rotary_tables = CausalRotaryTables(attention_head_dim, patch_size, rope_max_seq_len)
        self.block_mask_backend = "auto"
        self.block_masks = BlockMaskMemo()
        self.rope_rebasing = False
        self._install_causal_processors()
        self.kv_cache_engines: dict[str, BaseKVCacheEngine] = {}
        self.set_kv_cache_engines({name: KVCacheEngine() for name in self.kv_cache_branches()})

    # ------------------------------------------------------------------ per-call constants
    @property
    def dtype(self) -> torch.dtype:
        """diffusers' ``ModelMixin.dtype``, memoised: it walks every module (for dtype hooks) and the pipelines ask for
        it once per forward. Recomputed after any ``.to()`` / ``.half()`` (``_apply``), ``enable_layerwise_casting``,
        or a change of the first parameter's dtype or device."""
        weight = self.patch_embedding.weight
        key = (weight.dtype, weight.device)
        cached = self.__dict__.get("_memo_dtype")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_memo_dtype"] = (key, super().dtype)
        return cached[1]

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_memo_dtype", None)
        return super()._apply(fn, *args, **kwargs)

    def enable_layerwise_casting(self, *args, **kwargs) -> None:
        self.__dict__.pop("_memo_dtype", None)
        return super().enable_layerwise_casting(*args, **kwargs)

    # ------------------------------------------------------------------ engines and processors
    def set_kv_cache_engines(self, engines: Mapping[str, BaseKVCacheEngine]) -> None:
        """Attach engines by branch name and register the attention modules each one owns (caches start empty)."""
        branches = self.kv_cache_branches()
        unknown = sorted(set(engines) - set(branches))
        missing = sorted(set(branches) - set(engines))
        if unknown or missing:
            raise ValueError(
                f"`engines` must name exactly the branches {sorted(branches)}; unknown: {unknown}, missing: {missing}."
            )
        for name, engine in engines.items():
            if not isinstance(engine, BaseKVCacheEngine):
                raise ValueError(f"Engine {name!r} must be a BaseKVCacheEngine, got {type(engine).__name__}.")
        modes = {name: engine.rope_positions for name, engine in engines.items()}
        if len(set(modes.values())) > 1:  # the blocks of every branch share one rotation of the call's queries
            raise ValueError(f"Every engine of a model must use the same `rope_positions`, got {modes}.")
        for name, engine in engines.items():
            engine.register_blocks(branches[name], self.block_masks)
        self.kv_cache_engines = dict(engines)

    def clear_caches(self) -> None:
        """Empty every engine (self and cross entries) and the memoized masks: the cache state of a new model."""
        for engine in self.kv_cache_engines.values():
            engine.clear()
        self.block_masks.clear()

    def kv_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of self-attention K/V held by all engines (the cache formula's quantity)."""
        return sum(engine.self_cache_bytes(cache_tag) for engine in self.kv_cache_engines.values())

    def _install_causal_processors(self) -> None:
        for module in self.modules():
            if isinstance(module, WanAttention):
                causal = WanCausalCrossAttnProcessor() if module.is_cross_attention else WanCausalAttnProcessor()
                # processors re-installed after `enable_parallelism` keep taking part in it
                causal._parallel_config = getattr(self, "_parallel_config", None)
                module.set_processor(causal)

    # ------------------------------------------------------------------ context parallelism
    def enable_parallelism(self, *, config, cp_plan=None) -> None:
        """diffusers' ``enable_parallelism``, checked for a KV-cached causal rollout first (Ulysses only).

        The causal model shards and gathers its own tokens (every latent frame split evenly across the ranks, see
        :mod:`fastgen_diffusers.parallel`), so its ``_cp_plan`` is empty and ``cp_plan`` must not be given. Raises
        ``ValueError`` before any set-up for ring attention, heads that do not divide by ``ulysses_degree``, or
        attention modules whose processors are not the causal ones.
        """
        cp_config = config if isinstance(config, ContextParallelConfig) else config.context_parallel_config
        if cp_config is not None:
            if self._cp_plan is None:
                raise NotImplementedError(f"{type(self).__name__} does not support context parallelism yet.")
            if cp_plan:
                raise ValueError(
                    f"{type(self).__name__} shards its own tokens under context parallelism (every latent frame "
                    "split across the ranks); pass no `cp_plan`."
                )
            check_context_parallel_config(cp_config, self.config.num_attention_heads)
            for name, module in self.named_modules():
                if isinstance(module, WanAttention) and not isinstance(
                    module.processor, (WanCausalAttnProcessor, WanCausalCrossAttnProcessor)
                ):
                    raise ValueError(
                        f"`enable_parallelism` was called before the causal attention processors were installed: "
                        f"{name} runs {type(module.processor).__name__}. Call `set_default_attn_processor()` (which "
                        "installs them) first; the causal processors do the Ulysses exchange around the KV cache."
                    )
        super().enable_parallelism(config=config, cp_plan=cp_plan)

    def _cache_heads(self) -> int:
        """Heads whose K/V this process caches: all of them, or ``heads / ulysses_degree`` under Ulysses."""
        cp_config = context_parallel_config(self)
        heads = self.config.num_attention_heads
        return heads if cp_config is None else heads // cp_config.ulysses_degree

    def _check_context_parallel_call(self, frame_seqlen: int) -> None:
        """Under context parallelism: the frame splits evenly and every processor takes part in the exchange."""
        cp_config = context_parallel_config(self)
        if cp_config is None:
            return
        check_frame_tokens(frame_seqlen, cp_config)
        for blocks in self.kv_cache_branches().values():
            for block in blocks:
                for attn in (block.attn1, block.attn2):
                    if context_parallel_config(attn.processor) is not cp_config:
                        raise RuntimeError(
                            f"{type(attn.processor).__name__} of a block does not take part in this model's context "
                            "parallelism (a processor set after `enable_parallelism`); re-install the causal "
                            "processors with `set_default_attn_processor()`."
                        )

    def set_default_attn_processor(self) -> None:
        """The default processors of a causal model are the causal ones."""
        self._install_causal_processors()

    def set_block_mask_backend(self, backend: str) -> None:
        """Backend of the block-causal mask of multi-chunk calls: ``"auto"`` (FlexAttention on CUDA, SDPA elsewhere),
        ``"sdpa"`` (exact boolean mask) or ``"flex"`` (FlexAttention ``BlockMask``; eager on CPU). The KV-cache
        attention bias follows it: an additive float mask on ``"sdpa"``, a ``score_mod`` on ``"flex"``."""
        if backend not in MASK_BACKEND_CHOICES:
            raise ValueError(f"`backend` must be one of {MASK_BACKEND_CHOICES}, got {backend!r}.")
        self.block_mask_backend = backend

    def enable_rope_rebasing(self, enabled: bool = True) -> None:
        """Let a rollout run past the RoPE table (``rope_max_seq_len`` latent frames, 1024 for Wan) by re-basing.

        Off by default: a call whose temporal positions would leave the table raises before anything runs. On, such a
        call first shifts the positions of its cache tag back so that it starts at position 0: every cached key is
        re-rotated by the shift on its temporal channels (RoPE rotations compose, as in llama.cpp's context shift)
        and later calls use ``frame - offset`` as their position. Every relative position stays what it was, so the
        numbers are those of an unbounded table up to the rounding of the re-rotated keys in the cache dtype (once
        per re-basing, so about once every ``rope_max_seq_len`` frames).

        The trade-off is the model's, not the arithmetic's: past ``rope_max_seq_len`` frames the relative temporal
        distances (between the current chunk and the sink frames, or every cached frame without a window) are larger
        than any the model was trained on, and quality may degrade with them. Use it with a sliding window
        (``window_frames``), which keeps the other distances within the window.
        """
        self.rope_rebasing = bool(enabled)

    def _keys_before_rope(self) -> bool:
        """Whether the engines store keys before RoPE (a ``rope_positions`` mode other than ``"absolute"``): then the
        engines' positions replace the absolute frames, and re-basing never applies."""
        return any(engine.keys_before_rope for engine in self.kv_cache_engines.values())

    def _rope_offset_for(self, cache_tag: str, start_frame: int, num_frames: int, height: int, width: int) -> int:
        """The RoPE offset of a call (positions are ``frame - offset``); raises if the call cannot be served.

        The tag's current offset, or ``start_frame`` when re-basing is enabled and the call would leave the table.
        """
        offset = self.kv_cache_engines["main"].rope_offset(cache_tag)
        position = start_frame - offset
        if self.rope_rebasing and (position < 0 or position + num_frames > self.rotary_tables.max_seq_len):
            offset = start_frame
        self.rotary_tables.check_range(start_frame - offset, num_frames, height, width)
        return offset

    def _rebase_rope(self, cache_tag: str, rope_offset: int, device: torch.device) -> None:
        """Move every engine's ``cache_tag`` to ``rope_offset``, re-rotating the cached keys."""
        for engine in self.kv_cache_engines.values():
            shift = engine.rope_offset(cache_tag) - rope_offset
            if shift:
                rotation = self.rotary_tables.temporal_shift(shift, device)
                engine.rebase_positions(
                    cache_tag, rope_offset, functools.partial(apply_rotary_emb, rotary_emb=rotation)
                )

    def _resolve_mask_backend(self, device: torch.device) -> str:
        if self.block_mask_backend != "auto":
            return self.block_mask_backend
        return "flex" if device.type == "cuda" else "sdpa"

    # ------------------------------------------------------------------ forward helpers
    def chunk_layout_for(self, num_frames: int, start_frame: int = 0) -> tuple[int, ...]:
        """Chunks a call of ``num_frames`` latent frames at ``start_frame`` is split into (the mask's partition)."""
        first_alone = self.config.independent_first_frame and start_frame == 0
        return chunk_layout(num_frames, self.config.chunk_size, first_alone)

    def _call_layout(
        self, num_frames: int, start_frame: int, chunk_layout: Sequence[int] | None = None
    ) -> tuple[int, ...]:
        """The chunks of a call: ``chunk_layout`` when the call gives one (checked), else :meth:`chunk_layout_for`."""
        if chunk_layout is None:
            return self.chunk_layout_for(num_frames, start_frame)
        layout = tuple(chunk_layout) if isinstance(chunk_layout, (tuple, list)) else None
        if (
            not layout
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layout)
            or sum(layout) != num_frames
        ):
            raise ValueError(
                f"`chunk_layout` must be a tuple of positive frame counts summing to the call's {num_frames} latent "
                f"frames (e.g. ({num_frames},): one chunk, no mask), or None, got {chunk_layout!r}."
            )
        return layout

    def _frame_timesteps(self, timestep: torch.Tensor, batch_size: int, num_frames: int) -> torch.Tensor:
        """``(B,)`` or ``(B, F)`` model-scale timesteps as ``(B, F)``."""
        if not isinstance(timestep, torch.Tensor):
            raise ValueError(f"`timestep` must be a tensor of shape (B,) or (B, F), got {type(timestep).__name__}.")
        if timestep.ndim == 1 and timestep.shape[0] == batch_size:
            return timestep[:, None].expand(batch_size, num_frames)
        if timestep.shape == (batch_size, num_frames):
            return timestep
        raise ValueError(
            f"`timestep` must have shape ({batch_size},) or ({batch_size}, {num_frames}) (batch, latent frames) for "
            f"`hidden_states` of batch {batch_size} with {num_frames} frames, got {tuple(timestep.shape)}."
        )

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of a call's K/V: autocast's, else the activations' (the patch embedding's weights, which
        layerwise casting and weight quantization leave in the compute dtype; never a storage dtype such as fp8)."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.patch_embedding.weight.dtype

    def _timestep_embedding(
        self,
        timestep: torch.Tensor,
        batch_size: int,
        num_frames: int,
        dtype: torch.dtype,
        values: torch.Tensor | None = None,
    ):
        """:meth:`_embed_timesteps` of ``timestep``, reused by the next call given the same timestep values (the
        conditional and unconditional forwards of a CFG step) when gradients are off.

        The memo holds the last result only, keyed by the timestep's content (``values``: the host copy the call
        check read, compared bit for bit on the host, so a tensor changed in place through ``.data`` or a NumPy view
        is a new timestep; no further device read), its device, the frame count, the dtype and the embedder's
        parameters (identity and version, so an optimizer step or a weight load invalidates it). Without ``values``
        nothing is memoised.
        """
        frame_timesteps = self._frame_timesteps(timestep, batch_size, num_frames)
        if torch.is_grad_enabled() or values is None:
            return self._embed_timesteps(frame_timesteps, dtype)
        embedder = self.condition_embedder
        params = (*embedder.time_embedder.parameters(), *embedder.time_proj.parameters())
        key = (timestep.device, batch_size, num_frames, dtype, tuple((id(p), p._version) for p in params))
        memo = self.__dict__.get("_memo_timestep")
        if memo is not None and memo[1] == key and same_timestep_values(memo[0], values):
            return memo[2]
        embeddings = self._embed_timesteps(frame_timesteps, dtype)
        self.__dict__["_memo_timestep"] = (values, key, embeddings)
        return embeddings

    def _embed_timesteps(self, frame_timesteps: torch.Tensor, dtype: torch.dtype):
        """Per-frame ``temb`` ``(B, F, D)`` and ``timestep_proj`` ``(B, F, 6, D)`` from a float64 sinusoid."""
        embedder = self.condition_embedder
        batch_size, num_frames = frame_timesteps.shape
        sinusoid = timestep_sinusoid_fp64(frame_timesteps.flatten(), self.config.freq_dim)
        time_dtype = next(iter(embedder.time_embedder.parameters())).dtype
        temb = embedder.time_embedder(sinusoid.to(time_dtype)).to(dtype)
        timestep_proj = embedder.time_proj(embedder.act_fn(temb))
        temb = temb.unflatten(0, (batch_size, num_frames))
        timestep_proj = timestep_proj.unflatten(0, (batch_size, num_frames)).unflatten(2, (6, -1))
        return temb, timestep_proj

    def _image_token_count(self, encoder_hidden_states_image: torch.Tensor | None) -> int:
        """Image tokens the embedder makes of ``encoder_hidden_states_image`` (FLF2V pairs two images per sample)."""
        if encoder_hidden_states_image is None:
            return 0
        image_embedder = self.condition_embedder.image_embedder
        if image_embedder is None:
            raise ValueError("`encoder_hidden_states_image` was given but this model has no image embedder.")
        pairs = 2 if image_embedder.pos_embed is not None else 1
        return encoder_hidden_states_image.shape[1] * pairs

    def _embed_context(
        self, encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None
    ) -> torch.Tensor:
        """The cross-attention context ``(B, L_img + L_text, D)``: embedded image tokens, then text tokens."""
        embedder = self.condition_embedder
        context = embedder.text_embedder(encoder_hidden_states)
        if encoder_hidden_states_image is not None:
            context = torch.cat([embedder.image_embedder(encoder_hidden_states_image), context], dim=1)
        return context

    def _prepare_context(
        self,
        *,
        batch_size: int,
        num_frames: int,
        frame_seqlen: int,
        start_frame: int,
        cache_tag: str,
        store_kv: bool,
        device: torch.device,
        conditioning: tuple[torch.Tensor | None, ...],
        text_len: int,
        image_len: int,
        attention_bias: float = 1.0,
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
    ) -> CausalContext:
        """Size the entries of ``cache_tag`` and decide each engine's cross K/V mode (after :meth:`_check_call`)."""
        dtype = self._compute_dtype(device)
        grad_enabled = torch.is_grad_enabled()
        cross_modes, matches = {}, {}  # engines filled from one source compare the conditioning once
        layout = self._call_layout(num_frames, start_frame, chunk_layout)
        for engine in self.kv_cache_engines.values():
            engine.ensure_capacity(
                cache_tag,
                batch_size=batch_size,
                frame_seqlen=frame_seqlen,
                num_heads=self._cache_heads(),
                head_dim=self.config.attention_head_dim,
                dtype=dtype,
                device=device,
                text_len=text_len,
                image_len=image_len,
                max_frames=start_frame + num_frames,
            )
            engine.begin_call(cache_tag, start_frame, layout[0], attention_window)
            cross_modes[id(engine)] = engine.cross_mode(
                cache_tag, conditioning, store_kv=store_kv, grad_enabled=grad_enabled, matches=matches
            )
        return CausalContext(
            cache_engines=self.kv_cache_engines,
            cache_tag=cache_tag,
            store_kv=store_kv,
            start_frame=start_frame,
            num_frames=num_frames,
            frame_seqlen=frame_seqlen,
            chunk_layout=layout,
            image_context_length=image_len,
            cross_modes=cross_modes,
            mask_backend=self._resolve_mask_backend(device),
            block_masks=self.block_masks,
            attention_bias=attention_bias,
            attention_window=attention_window,
        )

    def _check_call(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None,
        *,
        start_frame: int,
        cache_tag: str,
        store_kv: bool,
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
    ) -> tuple[int, int, int, torch.Tensor]:
        """Validate a call against the config and every engine; returns ``(post-patch F, H', W')`` and the host copy
        of the timestep values (:func:`read_timestep`). Writes nothing.

        Every input is checked (:func:`check_transformer_inputs`) before any engine operation, so a bad call leaves
        every cache as it was.
        """
        image_embedder = self.condition_embedder.image_embedder
        timestep_values = check_transformer_inputs(
            self.config,
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
            start_frame=start_frame,
            cache_tag=cache_tag,
            store_kv=store_kv,
            compute_dtype=lambda device: (
                None if torch.is_autocast_enabled(device.type) else self._compute_dtype(device)
            ),
            image_dim=None if image_embedder is None else self.config.image_dim,
        )
        _, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        if height % p_h or width % p_w:
            raise ValueError(f"Latent height/width ({height}, {width}) must be divisible by the patch ({p_h}, {p_w}).")
        post_h, post_w = height // p_h, width // p_w
        self._check_context_parallel_call(post_h * post_w)
        layout = self._call_layout(num_frames // p_t, start_frame, chunk_layout)
        if attention_window is not None and not isinstance(attention_window, AttentionWindow):
            raise ValueError(
                f"`attention_window` must be an AttentionWindow (the call's own window) or None, got "
                f"{type(attention_window).__name__}."
            )
        if not self._keys_before_rope():
            self._rope_offset_for(cache_tag, start_frame, num_frames // p_t, post_h, post_w)
        query_positions = {}
        for name, engine in self.kv_cache_engines.items():
            engine.check_call(
                cache_tag,
                start_frame=start_frame,
                batch_size=hidden_states.shape[0],
                frame_seqlen=post_h * post_w,
                num_heads=self._cache_heads(),
                head_dim=self.config.attention_head_dim,
                dtype=self._compute_dtype(hidden_states.device),
                device=hidden_states.device,
                chunk_layout=layout,
                attention_window=attention_window,
                store_kv=store_kv,
            )
            if engine.keys_before_rope:  # positions come from the engine's mode: check them against the table
                positions = engine.key_positions(
                    cache_tag, start_frame, num_frames // p_t, layout[0], attention_window=attention_window
                )
                try:
                    self.rotary_tables.check_positions(positions.keys, post_h, post_w)
                except ValueError as error:  # re-basing shifts keys stored after RoPE only
                    raise ValueError(
                        f"{error} Engines with rope_positions={engine.rope_positions!r} store keys before RoPE and "
                        "rotate them at these positions when read: `enable_rope_rebasing()` (absolute positions "
                        "only) does not shift them. Keep the video within the table, or use rope_positions='window' "
                        "(positions stay below the window)."
                    ) from None
                query_positions[name] = positions.queries
        if len(set(query_positions.values())) > 1:  # one rotation of the queries serves every branch's blocks
            raise ValueError(
                "The engines of this model give this call's queries different RoPE positions "
                f"(first frame at {dict((name, positions[0]) for name, positions in query_positions.items())}): "
                "with rope_positions='window' every engine needs the same `window_frames` and `sink_frames`."
            )
        return num_frames // p_t, post_h, post_w, timestep_values

    # ------------------------------------------------------------------ blocks
    def _run_blocks(
        self, blocks, hidden_states, context, timestep_proj, rotary_emb, block_inputs, views, store_only=False
    ):
        """Run ``blocks`` in order, ``blocks[i]`` with ``views[i]`` (its :class:`CausalBlockView`), gathering the
        prefix of ``block_inputs[i]`` (its :class:`BlockAttentionInputs`) before and dropping it after.

        ``store_only``: the last block only stores its K/V (:func:`causal_block_store_only`, no prefix gathered) and
        the returned hidden states are those of the block before it (nothing reads them). A compiled last block
        (``compile_repeated_blocks``) runs whole instead: the K/V it stores are then those of the compiled block that
        every full forward runs (compiled kernels may round differently from the eager store-only path), and the
        store pass reuses its graph."""
        if store_only and len(blocks) > 0 and not is_compiled_block(blocks[-1]):
            *blocks, last = blocks
            hidden_states = self._run_blocks(
                blocks, hidden_states, context, timestep_proj, rotary_emb, block_inputs, views
            )
            causal_block_store_only(last, hidden_states, context, timestep_proj, rotary_emb, views[len(blocks)])
            return hidden_states
        for block, attention_inputs, view in zip(blocks, block_inputs, views):
            hidden_states = self._run_block(
                block, attention_inputs, hidden_states, context, timestep_proj, rotary_emb, view
            )
        return hidden_states

    def _run_block(self, block, attention_inputs, *args):
        """``block(*args)``, checkpointed when training under gradient checkpointing, with the prefix of
        ``attention_inputs`` (its :class:`BlockAttentionInputs`) gathered before and dropped after."""
        attention_inputs.self_attn.load()
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            out = self._gradient_checkpointing_func(block, *args)
        else:
            out = block(*args)
        attention_inputs.self_attn.release()
        return out

    def _output_head(self, hidden_states, temb, batch_size, post_f, post_h, post_w) -> torch.Tensor:
        """Per-frame modulated output norm, projection and unpatchify to ``(B, C_out, F, H, W)``.

        Under context parallelism ``hidden_states`` holds this rank's tokens of every frame; the projection is
        all-gathered so that every rank returns the whole prediction.
        """
        p_t, p_h, p_w = self.config.patch_size
        shift, scale = (self.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        norm = self.norm_out(hidden_states.float()).unflatten(1, (post_f, -1))
        hidden_states = (norm * (1 + scale) + shift).flatten(1, 2).type_as(hidden_states)
        hidden_states = self.proj_out(hidden_states)
        cp_config = context_parallel_config(self)
        if cp_config is not None:
            hidden_states = gather_frames(hidden_states, post_f, cp_config)
        hidden_states = hidden_states.reshape(batch_size, post_f, post_h, post_w, p_t, p_h, p_w, -1)
        hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # ------------------------------------------------------------------ forward
    def _causal_forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None,
        *,
        start_frame: int,
        cache_tag: str,
        store_kv: bool,
        return_dict: bool,
        kv_cache_attention_bias: float = 1.0,
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
        store_only: bool = False,
        **block_inputs: Any,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """The forward of a causal model around its block loop; ``block_inputs`` go to ``_forward_blocks``.

        Three parts: :meth:`_begin_forward` (checks, engines, per-block attention inputs: Python, never compiled),
        :meth:`_compute_forward` (tensor code only: what ``torch.compile(transformer)`` captures) and
        :meth:`_end_forward` (stores and commit, never compiled).
        """
        if store_only and not store_kv:
            raise ValueError(
                "`store_only=True` needs `store_kv=True` (a forward that stores nothing computes nothing)."
            )
        call = self._begin_forward(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
            start_frame=start_frame,
            cache_tag=cache_tag,
            store_kv=store_kv,
            attention_bias=kv_cache_attention_bias,
            attention_window=attention_window,
            chunk_layout=chunk_layout,
        )
        try:
            output = self._compute_forward(
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_image,
                call,
                store_only=store_only,
                **block_inputs,
            )
        except BaseException:
            self._abort_forward(call)
            raise
        self._end_forward(call)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)

    @torch.compiler.disable
    def _begin_forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None,
        *,
        start_frame: int,
        cache_tag: str,
        store_kv: bool,
        attention_bias: float = 1.0,
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
    ) -> ForwardCall:
        """Check the call, open the engines' transaction and decide everything per call (masks, slots, modes, RoPE)."""
        batch_size = hidden_states.shape[0]
        post_f, post_h, post_w, timestep_values = self._check_call(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
            start_frame=start_frame,
            cache_tag=cache_tag,
            store_kv=store_kv,
            attention_window=attention_window,
            chunk_layout=chunk_layout,
        )
        device = hidden_states.device
        temb, timestep_proj = self._timestep_embedding(
            timestep, batch_size, post_f, encoder_hidden_states.dtype, timestep_values
        )
        keys_before_rope = self._keys_before_rope()
        rotary_emb = None
        if not keys_before_rope:
            rope_offset = self._rope_offset_for(cache_tag, start_frame, post_f, post_h, post_w)
            # real pairs (a view): compiled code rotates in real arithmetic, eager views them back as complex
            rotary_emb = self.rotary_tables(start_frame - rope_offset, post_f, post_h, post_w, device)
            rotary_emb = torch.view_as_real(rotary_emb)
        image_len = self._image_token_count(encoder_hidden_states_image)
        conditioning = (encoder_hidden_states, encoder_hidden_states_image)
        # The engine operations of this forward are one transaction: a failure anywhere restores every cache.
        engines = list(self.kv_cache_engines.values())
        for engine in engines:
            engine.begin_transaction(cache_tag)
        try:
            if not keys_before_rope:
                self._rebase_rope(cache_tag, rope_offset, device)
            ctx = self._prepare_context(
                batch_size=batch_size,
                num_frames=post_f,
                frame_seqlen=post_h * post_w,
                start_frame=start_frame,
                cache_tag=cache_tag,
                store_kv=store_kv,
                device=device,
                conditioning=conditioning,
                text_len=encoder_hidden_states.shape[1],
                image_len=image_len,
                attention_bias=float(attention_bias),
                attention_window=attention_window,
                chunk_layout=chunk_layout,
            )
            grid = (post_h, post_w)
            attention_inputs = build_attention_inputs(self.kv_cache_engines, ctx, self.rotary_tables, grid, device)
            ctx.block_inputs = attention_inputs
            views = tuple(ctx.at_block(i) for i in range(max(map(len, attention_inputs.values()), default=0)))
            if keys_before_rope:  # the queries at the positions the engines gave the call's frames
                rotary_emb = query_rotations(ctx, self.rotary_tables, grid, device)
        except BaseException:
            for engine in engines:
                engine.rollback()
            raise
        # Every engine reads its cached cross K/V: the context embedding would go unused.
        embed_context = not all(mode is CrossKVMode.READ for mode in ctx.cross_modes.values())
        return ForwardCall(
            ctx,
            attention_inputs,
            views,
            rotary_emb,
            temb,
            timestep_proj,
            (post_f, post_h, post_w),
            embed_context,
            conditioning,
        )

    def _compute_forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None,
        call: ForwardCall,
        store_only: bool = False,
        **block_inputs: Any,
    ) -> torch.Tensor | None:
        """Patch embedding, context embedding, the blocks and the output head: ``(B, C_out, F, H, W)``; ``None`` for
        a store-only forward (the last block only stores its K/V, no output head)."""
        batch_size = hidden_states.shape[0]
        post_f, post_h, post_w = call.grid
        # Traced whole (`torch.compile(transformer)`), a store-only forward runs whole and drops its prediction: its
        # graphs are then the full forward's, so that a store pass adds none. Compiled blocks run from this eager
        # Python: a compiled last block runs whole too (see `_run_blocks`), only the output head is skipped.
        skip_tail = store_only and not torch.compiler.is_compiling()
        hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()  # (B, F*S, D)
        cp_config = context_parallel_config(self)
        if cp_config is not None:  # Ulysses: this rank's S/P tokens of every frame; RoPE stays whole (processors)
            hidden_states = shard_frames(hidden_states, post_f, cp_config)
        temb, timestep_proj = call.temb, call.timestep_proj
        context = None
        if call.embed_context:
            context = self._embed_context(encoder_hidden_states, encoder_hidden_states_image)
        hidden_states = self._forward_blocks(
            hidden_states,
            context,
            timestep_proj,
            call.rotary_emb,
            call.ctx,
            call.attention_inputs,
            call.views,
            store_only=skip_tail,
            **block_inputs,
        )
        if skip_tail:
            return None
        output = self._output_head(hidden_states, temb, batch_size, post_f, post_h, post_w)
        return None if store_only else output

    @torch.compiler.disable
    def _end_forward(self, call: ForwardCall) -> None:
        """Store what the blocks handed back, commit, and close the engines' transaction."""
        engines = list(self.kv_cache_engines.values())
        try:
            store_attention_outputs(self.kv_cache_engines, call.ctx, call.conditioning, call.attention_inputs)
        except BaseException:
            for engine in engines:
                engine.rollback()
            raise
        for engine in engines:
            engine.end_transaction()

    @torch.compiler.disable
    def _abort_forward(self, call: ForwardCall) -> None:
        """Roll every engine back to what it held before the forward."""
        for engine in self.kv_cache_engines.values():
            engine.rollback()


class WanCausalTransformer3DModel(CausalWanMixin, WanTransformer3DModel):
    r"""Causal (block-causal, KV-cached) Wan transformer; same parameters as [`WanTransformer3DModel`].

    Plain Wan checkpoints load with bit-identical weights. The model owns its cache engines in
    ``kv_cache_engines`` (``{"main": KVCacheEngine()}``) and runs any contiguous run of latent frames: a token of
    frame ``f`` sees every token of its own chunk, earlier chunks of the call, and the cached K/V of frames
    ``< start_frame`` of the same cache tag.

    Args (in addition to [`WanTransformer3DModel`]'s):
        chunk_size (`int`, defaults to 3):
            Latent frames per causal chunk (Self-Forcing's ``num_frame_per_block``).
        independent_first_frame (`bool`, defaults to `False`):
            Whether the first chunk of a video is the first latent frame alone (image-conditioned students).
    """

    _no_split_modules = ["WanCausalTransformerBlock"]
    _repeated_blocks = ["WanCausalTransformerBlock"]
    # Context parallelism (Ulysses) is handled by the causal forward and processors, not by diffusers' hooks: the hooks
    # cut the flattened sequence into contiguous runs, which would split latent frames (per-frame modulation, frame-
    # ordered cache) across ranks. The model splits every frame instead; see fastgen_diffusers.parallel.
    _cp_plan = {}

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, ...] = (1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        chunk_size: int = 3,
        independent_first_frame: bool = False,
    ) -> None:
        super().__init__(**self._wan_arguments(locals()))
        self._init_causal(chunk_size, patch_size, attention_head_dim, rope_max_seq_len)

    def kv_cache_branches(self) -> dict[str, nn.ModuleList]:
        """The blocks each engine branch owns: ``{"main": self.blocks}``."""
        return {"main": self.blocks}

    def _forward_blocks(
        self,
        hidden_states,
        context,
        timestep_proj,
        rotary_emb,
        ctx: CausalContext,
        attention_inputs,
        views,
        store_only: bool = False,
    ):
        return self._run_blocks(
            self.blocks, hidden_states, context, timestep_proj, rotary_emb, attention_inputs["main"], views, store_only
        )

    # ------------------------------------------------------------------ forward
    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *,
        start_frame: int = 0,
        cache_tag: str = "pos",
        store_kv: bool = False,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        kv_cache_attention_bias: float = 1.0,
        # per-call attention layout (a rollout that attends under several windows: Rolling Forcing's)
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
        store_only: bool = False,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Flow prediction for the latent frames ``[start_frame, start_frame + F)`` given the cached prefix.

        Args:
            hidden_states: ``(B, C, F, H, W)`` latent frames of this call.
            timestep: ``(B,)`` or ``(B, F)`` model-scale timesteps in [0, 1000] (floats such as 937.5 are valid).
            encoder_hidden_states: ``(B, L, text_dim)`` text embeddings.
            encoder_hidden_states_image: ``(B, L_img, image_dim)`` CLIP image tokens (Wan2.1 I2V), optional.
            start_frame: absolute latent index of ``hidden_states[:, :, 0]`` (RoPE offset and cache position).
            cache_tag: cache namespace (``"pos"``, ``"neg"``, ...).
            store_kv: append this call's self K/V to the cache (replacing anything from ``start_frame`` on) and
                fill the cross K/V if they are empty.
            return_dict: return a ``Transformer2DModelOutput`` instead of a tuple.
            attention_kwargs: only ``scale`` (LoRA scale) is read.
            kv_cache_attention_bias: Krea's bias in ``[0.01, 1]``: on a denoising forward (``store_kv=False``) the
                logits of the cached keys other than the anchor (the video's first frame) and the query's own chunk
                get ``log(bias)`` added (:meth:`CausalContext.biased_key_frames`), with or without a window, in
                single- and multi-chunk calls: an additive float mask on the SDPA mask backend, a ``score_mod`` on
                FlexAttention (:meth:`set_block_mask_backend`); 1 (default): no mask at all.
            attention_window: the window this call attends under (an [`AttentionWindow`]: frames and sink) instead of
                each engine's own; it must see only frames the engines hold (their window is then the holding window,
                e.g. sink + recent frames for calls that attend under different windows), and the call evicts nothing
                (stores still evict by the engines' windows). ``None`` (default): the engines' windows.
            chunk_layout: frame counts of the call's causal chunks (summing to F), instead of the config's rule
                (``chunk_size`` chunks, the first absorbing the remainder): ``(F,)`` makes the call one chunk whose
                frames all see each other (no mask). ``None`` (default): the config's rule.
            store_only: with ``store_kv=True``, store exactly what the full forward stores and compute nothing else
                (a cache pass whose prediction nothing reads): the last block computes only its K/V (and the cross
                K/V it fills), the output head does not run, and the prediction is ``None`` (traced whole by
                ``torch.compile(transformer)``, the forward runs whole and drops it: no graph of its own).

        Returns:
            ``(B, C_out, F, H, W)`` flow prediction, like ``WanTransformer3DModel`` (``None`` with ``store_only``).
        """
        return self._causal_forward(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
            start_frame=start_frame,
            cache_tag=cache_tag,
            store_kv=store_kv,
            return_dict=return_dict,
            kv_cache_attention_bias=kv_cache_attention_bias,
            attention_window=attention_window,
            chunk_layout=chunk_layout,
            store_only=store_only,
        )
