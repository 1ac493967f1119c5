"""``WanCausalVACETransformer3DModel``: a diffusers Wan VACE transformer that runs chunk by chunk on two KV caches.

The VACE layers (``vace_blocks``) turn the control latents of a call into one *hint* per layer, added to the main
stream after the main blocks listed in ``config.vace_layers``. Their self-attention over control tokens is causal like
the main blocks', so the model keeps two engine branches: ``"main"`` owns ``blocks[i]`` and ``"vace"`` owns
``vace_blocks[i]``, each with block indices local to the branch. The attention processors are the T2V ones; they find
their branch through :meth:`CausalContext.resolve_registered_engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel
from diffusers.utils import apply_lora_scale
from torch import nn

from ..context import CausalContext
from ..kv_cache import AttentionWindow
from .blocks import WanCausalVACETransformerBlock
from .transformer_wan_causal import CausalWanMixin


class VACEHintCache:
    """Lossy reuse of the VACE hints of a chunk across its denoising steps (P1 of ``seeds/003``); off by default.

    The hints of a chunk depend on the noisy latents and the timestep of the step, so reusing them is an
    approximation: it skips every VACE layer on reused steps. Hints are recomputed whenever ``step`` is a multiple of
    ``refresh_interval`` (``refresh_interval=1`` is exact) and on every ``store_kv`` call, which must write the VACE
    branch's K/V. Entries are keyed by ``(cache_tag, start_frame, num_frames)``; the control input of a key must not
    change while the cache holds it (call :meth:`clear` at the start of every rollout).

    Args:
        refresh_interval: recompute the hints every ``refresh_interval`` denoising steps of a chunk.
        allow_lossy: must be ``True``: the outputs differ from the exact path.
    """

    def __init__(self, refresh_interval: int, *, allow_lossy: bool = False) -> None:
        if not allow_lossy:
            raise ValueError(
                "Reusing VACE hints across denoising steps is lossy (outputs differ from the exact path); pass "
                "`allow_lossy=True` to enable it."
            )
        if not isinstance(refresh_interval, int) or refresh_interval < 1:
            raise ValueError(f"`refresh_interval` must be a positive int, got {refresh_interval!r}.")
        self.refresh_interval = refresh_interval
        self.step = 0
        self.num_computed = 0
        self.num_reused = 0
        self._hints: dict[tuple[str, int, int], list[torch.Tensor]] = {}

    def set_step(self, step: int) -> None:
        """Denoising step index within the current chunk (0 for its first step)."""
        self.step = step

    def lookup(self, key: tuple[str, int, int]) -> list[torch.Tensor] | None:
        """Hints to reuse for ``key`` at the current step, or ``None`` when they must be recomputed."""
        if self.step % self.refresh_interval == 0:
            return None
        hints = self._hints.get(key)
        if hints is not None:
            self.num_reused += 1
        return hints

    def store(self, key: tuple[str, int, int], hints: list[torch.Tensor]) -> None:
        self._hints[key] = [hint.detach() for hint in hints]
        self.num_computed += 1

    def clear(self) -> None:
        """Forget every hint (and reset the step and the counters)."""
        self._hints = {}
        self.step = self.num_computed = self.num_reused = 0


class WanCausalVACETransformer3DModel(CausalWanMixin, WanVACETransformer3DModel):
    r"""Causal (block-causal, KV-cached) Wan VACE transformer; same parameters as [`WanVACETransformer3DModel`].

    Plain Wan VACE checkpoints load with bit-identical weights. ``kv_cache_engines`` is
    ``{"main": KVCacheEngine(), "vace": KVCacheEngine()}``. Frames, chunks, cache tags and the cache rules are those
    of [`WanCausalTransformer3DModel`]; the control latents are given for the frames of each call, and the VACE
    layers' self-attention over them sees the cached control K/V of earlier frames in the ``"vace"`` branch.

    Args (in addition to [`WanVACETransformer3DModel`]'s):
        chunk_size (`int`, defaults to 3):
            Latent frames per causal chunk.
        independent_first_frame (`bool`, defaults to `False`):
            Whether the first chunk of a video is the first latent frame alone.
    """

    _no_split_modules = ["WanCausalTransformerBlock", "WanCausalVACETransformerBlock"]
    _repeated_blocks = ["WanCausalTransformerBlock", "WanCausalVACETransformerBlock"]
    _cp_plan = None  # the causal forward builds its own RoPE; context parallelism needs a causal plan

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
        vace_layers: Sequence[int] = (0, 5, 10, 15, 20, 25, 30, 35),
        vace_in_channels: int = 96,
        chunk_size: int = 3,
        independent_first_frame: bool = False,
    ) -> None:
        super().__init__(**self._wan_arguments(locals()))
        if len(set(vace_layers)) != len(vace_layers):
            raise ValueError(f"`vace_layers` must not repeat a layer, got {list(vace_layers)}.")
        for block in self.vace_blocks:
            block.__class__ = WanCausalVACETransformerBlock
        self._init_causal(chunk_size, patch_size, attention_head_dim, rope_max_seq_len)

    def kv_cache_branches(self) -> dict[str, nn.ModuleList]:
        """The blocks each engine branch owns: ``{"main": self.blocks, "vace": self.vace_blocks}``."""
        return {"main": self.blocks, "vace": self.vace_blocks}

    # ------------------------------------------------------------------ control input
    def _check_control(self, hidden_states: torch.Tensor, control_hidden_states: torch.Tensor | None) -> None:
        """``control_hidden_states`` must be ``(B, vace_in_channels, F, H, W)`` for the frames of ``hidden_states``."""
        if not isinstance(control_hidden_states, torch.Tensor):
            raise ValueError(
                "`control_hidden_states` (B, vace_in_channels, F, H, W) is required: the control latents of the "
                "frames of this call."
            )
        expected = (hidden_states.shape[0], self.config.vace_in_channels, *hidden_states.shape[2:])
        if tuple(control_hidden_states.shape) != expected:
            raise ValueError(
                f"`control_hidden_states` must have shape {expected} (batch, vace_in_channels and the frames, height "
                f"and width of `hidden_states`), got {tuple(control_hidden_states.shape)}."
            )

    def _control_scales(self, scale: float | Sequence[float] | torch.Tensor | None) -> torch.Tensor:
        """Per-VACE-layer scales as a float tensor ``(len(vace_layers),)`` (ones when ``scale`` is ``None``)."""
        num_layers = len(self.config.vace_layers)
        if scale is None:
            return torch.ones(num_layers)
        if isinstance(scale, (int, float)):
            return torch.full((num_layers,), float(scale))
        scales = torch.as_tensor(scale, dtype=torch.float32).flatten()
        if scales.numel() != num_layers:
            raise ValueError(
                f"`control_hidden_states_scale` must hold one value per VACE layer ({num_layers}), got "
                f"{scales.numel()}."
            )
        return scales

    def _vace_hints(
        self, hidden_states, context, control_hidden_states, timestep_proj, rotary_emb, block_inputs, views
    ):
        """One hint ``(B, F*S, D)`` per VACE layer, from ``control_hidden_states`` ``(B, 96, F, H, W)``."""
        control = self.vace_patch_embedding(control_hidden_states).flatten(2).transpose(1, 2)  # (B, F*S, D)
        hints = []
        for block, inputs, view in zip(self.vace_blocks, block_inputs, views):
            hint, control = self._run_block(
                block, inputs, hidden_states, context, control, timestep_proj, rotary_emb, view
            )
            hints.append(hint)
        return hints

    def _forward_blocks(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        timestep_proj: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        ctx: CausalContext,
        attention_inputs: dict,
        views: tuple,
        *,
        control_hidden_states: torch.Tensor,
        control_scales: torch.Tensor,
        vace_hint_cache: VACEHintCache | None,
        store_only: bool = False,
    ) -> torch.Tensor:
        """VACE layers first (or reused hints), then the main blocks with ``hint * scale`` after each VACE layer."""
        reuse = vace_hint_cache is not None and not ctx.store_kv
        key = (ctx.cache_tag, ctx.start_frame, ctx.num_frames) if reuse else None
        hints = vace_hint_cache.lookup(key) if reuse else None
        if hints is None:
            hints = self._vace_hints(
                hidden_states,
                context,
                control_hidden_states,
                timestep_proj,
                rotary_emb,
                attention_inputs["vace"],
                views,
            )
            if reuse:
                vace_hint_cache.store(key, hints)
        main_inputs = attention_inputs["main"]
        start = 0
        for layer, hint, scale in zip(sorted(self.config.vace_layers), hints, control_scales):
            hidden_states = self._run_blocks(
                self.blocks[start : layer + 1],
                hidden_states,
                context,
                timestep_proj,
                rotary_emb,
                main_inputs[start : layer + 1],
                views[start : layer + 1],
            )
            hidden_states = hidden_states + hint * scale.to(hint)
            start = layer + 1
        return self._run_blocks(
            self.blocks[start:],
            hidden_states,
            context,
            timestep_proj,
            rotary_emb,
            main_inputs[start:],
            views[start:],
            store_only,
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
        control_hidden_states: torch.Tensor | None = None,
        control_hidden_states_scale: float | Sequence[float] | torch.Tensor | None = None,
        start_frame: int = 0,
        cache_tag: str = "pos",
        store_kv: bool = False,
        vace_hint_cache: VACEHintCache | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        # the causal model's per-call attention options (KV-cache attention bias, per-call window and chunk layout)
        kv_cache_attention_bias: float = 1.0,
        attention_window: AttentionWindow | None = None,
        chunk_layout: Sequence[int] | None = None,
        store_only: bool = False,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Flow prediction for the latent frames ``[start_frame, start_frame + F)`` given the cached prefix.

        Args:
            hidden_states: ``(B, C, F, H, W)`` latent frames of this call.
            timestep: ``(B,)`` or ``(B, F)`` model-scale timesteps in [0, 1000].
            encoder_hidden_states: ``(B, L, text_dim)`` text embeddings.
            encoder_hidden_states_image: ``(B, L_img, image_dim)`` CLIP image tokens, optional.
            control_hidden_states: ``(B, vace_in_channels, F, H, W)`` control latents of the same frames (required).
            control_hidden_states_scale: per-VACE-layer scale: a float, or ``len(vace_layers)`` values (default 1).
            start_frame: absolute latent index of ``hidden_states[:, :, 0]`` (RoPE offset and cache position).
            cache_tag: cache namespace (``"pos"``, ``"neg"``, ...), shared by both branches.
            store_kv: append this call's self K/V of both branches to the caches and fill empty cross K/V.
            vace_hint_cache: a :class:`VACEHintCache` for the lossy reuse of hints in ``store_kv=False`` calls;
                ``None`` (default) recomputes the hints in every call (exact).
            return_dict: return a ``Transformer2DModelOutput`` instead of a tuple.
            attention_kwargs: only ``scale`` (LoRA scale) is read.
            kv_cache_attention_bias, attention_window, chunk_layout: as [`WanCausalTransformer3DModel.forward`], for
                the self-attention of both branches.
            store_only: as [`WanCausalTransformer3DModel.forward`]: the VACE layers run whole (their hints feed the
                main blocks), the last main block only stores its K/V; returns ``None``.

        Returns:
            ``(B, C_out, F, H, W)`` flow prediction, like ``WanVACETransformer3DModel`` (``None`` with
            ``store_only``).
        """
        self._check_control(hidden_states, control_hidden_states)
        control_scales = self._control_scales(control_hidden_states_scale)
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
            control_hidden_states=control_hidden_states,
            control_scales=control_scales,
            vace_hint_cache=vace_hint_cache,
        )
