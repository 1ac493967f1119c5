"""Causal attention processors for Wan self- and cross-attention.

The processors are stateless and never name a branch: each asks the :class:`CausalContext` of the forward which
engine registered the module it runs for, and uses that engine's entry for its block and the forward's cache tag.
The causal blocks pass the context explicitly (``causal_context=...``) because diffusers' Wan blocks forward no
extra arguments to processors.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections
from diffusers.utils import logging

from ..context import CausalContext
from ..kv_cache import CrossKVMode
from ..parallel import context_parallel_config, heads_to_sequence, sequence_to_heads

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name


def _require_context(causal_context: CausalContext | None, processor: object) -> CausalContext:
    if causal_context is None:
        raise RuntimeError(
            f"{type(processor).__name__} needs a `causal_context`; it runs inside WanCausalTransformer3DModel's "
            "causal blocks, which pass it. Use `set_default_attn_processor()` to go back to stock Wan attention."
        )
    return causal_context


def rms_norm_fp32(norm: torch.nn.RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """``norm(hidden_states)`` computed in float32 (as the students were trained), cast back to the input dtype."""
    weight = None if norm.weight is None else norm.weight.float()
    return F.rms_norm(hidden_states.float(), norm.normalized_shape, weight, norm.eps).type_as(hidden_states)


def apply_rotary_emb(hidden_states: torch.Tensor, rotary_emb: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved channel pairs of ``hidden_states`` ``(B, L, H, D)`` by ``rotary_emb``.

    ``rotary_emb`` is ``(1, L, 1, D/2)`` complex64: pair ``(x[2i], x[2i+1])`` is multiplied, as the complex number
    ``x[2i] + j x[2i+1]``, by element ``i`` (one complex product: the math of diffusers' Wan RoPE, in float32).
    """
    pairs = torch.view_as_complex(hidden_states.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotary_emb).flatten(-2).type_as(hidden_states)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Default dynamic-shape handling: sequence lengths change with the frames of a call and the cached prefix, so a
    # static-shape compile would recompile for every new length and fall back to eager at the recompile limit.
    return torch.compile(flex_attention)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> torch.Tensor:
    """Attention of ``(B, Lq, H, D)`` queries over ``(B, Lk, H, D)`` keys under a block-causal mask.

    ``mask`` is a boolean ``(1, 1, Lq, Lk)`` tensor (SDPA) or a FlexAttention ``BlockMask``. The masked path never
    goes through a backend that could drop the mask.
    """
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if isinstance(mask, torch.Tensor):
        logger.debug("block-causal attention: SDPA with a boolean mask %s", tuple(mask.shape))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        flex = _compiled_flex_attention() if query.is_cuda else flex_attention
        logger.debug("block-causal attention: FlexAttention BlockMask (%s)", "compiled" if query.is_cuda else "eager")
        out = flex(query, key, value, block_mask=mask)
    return out.transpose(1, 2)


class WanCausalAttnProcessor:
    """Causal self-attention: RoPE-rotated K/V of this call attend after the cached prefix of the same branch and tag.

    Inside a call that spans several chunks the attention is block-causal; with ``store_kv`` the call's K/V
    (after ``norm_k`` and RoPE) are appended to the cache.

    Under Ulysses context parallelism (``_parallel_config`` set by ``enable_parallelism``) ``hidden_states`` holds this
    rank's tokens of every frame: after the q/k/v projections and norms one all-to-all each turns them into the whole
    call for this rank's heads, so RoPE, the rank's cache (the prefix of its heads) and the attention are the
    single-process ones; one more all-to-all returns the output (see :mod:`fastgen_diffusers.parallel`).
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        *,
        causal_context: CausalContext | None = None,
    ) -> torch.Tensor:
        ctx = _require_context(causal_context, self)
        engine = ctx.resolve_registered_engine(attn)
        block_idx = engine.block_index(attn)

        query, key, value = _get_qkv_projections(attn, hidden_states, None)  # (B, L, H*D)
        query = rms_norm_fp32(attn.norm_q, query).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        key = rms_norm_fp32(attn.norm_k, key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        cp_config = context_parallel_config(self)
        if cp_config is not None:  # (B, F*S/P, H, D) -> (B, F*S, H/P, D): the whole call for this rank's heads
            query, key, value = (sequence_to_heads(t, ctx.num_frames, cp_config) for t in (query, key, value))
        query = apply_rotary_emb(query, rotary_emb)
        key = apply_rotary_emb(key, rotary_emb)

        full_key, full_value = engine.self_attention_kv(
            block_idx, ctx.cache_tag, key, value, ctx.start_frame, first_chunk_frames=ctx.chunk_layout[0]
        )
        mask = ctx.self_attention_mask(engine, query.device)
        if mask is None:
            hidden_states = dispatch_attention_fn(query, full_key, full_value, backend=self._attention_backend)
        else:
            hidden_states = masked_attention(query, full_key, full_value, mask)
        if ctx.store_kv and not ctx.committed:
            # Contiguous: with fused projections `value` is a view that would keep the whole QKV output alive.
            key, value = key.detach().contiguous(), value.detach().contiguous()
            engine.append_self_kv(block_idx, ctx.cache_tag, key, value, ctx.start_frame)
        if cp_config is not None:
            hidden_states = heads_to_sequence(hidden_states, ctx.num_frames, cp_config)

        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class WanCausalCrossAttnProcessor:
    """Cross-attention to the text (and, for Wan2.1 I2V, image) context with cached K/V.

    The context is ``[image tokens | text tokens]``; the split comes from the real image token count carried by the
    context (never from a hard-coded text length). In :attr:`CrossKVMode.READ` the K/V projections do not run.

    Under context parallelism the rank's query tokens attend to the whole context with every head, with no exchange
    (as diffusers' ``WanAttnProcessor``): every rank computes and caches the same cross K/V.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        *,
        causal_context: CausalContext | None = None,
    ) -> torch.Tensor:
        ctx = _require_context(causal_context, self)
        engine = ctx.resolve_registered_engine(attn)
        block_idx = engine.block_index(attn)
        mode = ctx.cross_mode(engine)

        query = rms_norm_fp32(attn.norm_q, attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        if mode is CrossKVMode.READ:
            entry = engine.get_cross_kv(block_idx, ctx.cache_tag)
            key, value, key_img, value_img = entry.key, entry.value, entry.key_img, entry.value_img
        else:
            key, value, key_img, value_img = self._project_context(attn, encoder_hidden_states, ctx)
            if mode is CrossKVMode.FILL and not ctx.committed:
                kept = [None if t is None else t.detach().contiguous() for t in (key, value, key_img, value_img)]
                engine.set_cross_kv(block_idx, ctx.cache_tag, *kept)

        hidden_states = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if key_img is not None:
            hidden_states_img = dispatch_attention_fn(query, key_img, value_img, backend=self._attention_backend)
            hidden_states = hidden_states + hidden_states_img.flatten(2, 3).type_as(query)

        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)

    @staticmethod
    def _project_context(attn, encoder_hidden_states: torch.Tensor, ctx: CausalContext):
        """Text K/V ``(B, L_text, H, D)`` and, when image tokens lead the context, image K/V ``(B, L_img, H, D)``."""
        image_len = ctx.image_context_length
        text = encoder_hidden_states[:, image_len:]
        if attn.fused_projections:
            key, value = attn.to_kv(text).chunk(2, dim=-1)
        else:
            key, value = attn.to_k(text), attn.to_v(text)
        key = rms_norm_fp32(attn.norm_k, key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if image_len == 0:
            return key, value, None, None
        if attn.add_k_proj is None:
            raise ValueError(
                f"The context has {image_len} image tokens but this model has no image K/V projections "
                "(`added_kv_proj_dim` is None)."
            )
        key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states[:, :image_len])
        key_img = rms_norm_fp32(attn.norm_added_k, key_img).unflatten(2, (attn.heads, -1))
        value_img = value_img.unflatten(2, (attn.heads, -1))
        return key, value, key_img, value_img
