"""Causal attention processors for Wan self- and cross-attention.

The processors are stateless and never name a branch or a cache rule. Each one resolves the engine that owns the module
it runs for (:meth:`~fastgen_diffusers.context.CausalContext.resolve_registered_engine`, the routing rule) and reads
what the model prepared for that engine's block in this forward (:class:`BlockAttentionInputs`: tensors and a few
flags), through the block's :class:`~fastgen_diffusers.context.CausalBlockView` (``causal_context=...``; diffusers'
Wan blocks forward no extra arguments to processors). The model decides those inputs once per forward, outside any
compiled region, and does the bookkeeping after the blocks have run; the lookup keys on the branch's engine, never on
the module, so a block's forward holds no data-pointer comparisons, no ``.item()`` and no cache bookkeeping, and one
``fullgraph=True`` graph serves every block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections
from diffusers.utils import logging

from ..context import CausalBlockView
from ..kv_cache import CrossKVMode
from ..kv_cache.masks import AttentionBias
from ..parallel import context_parallel_config, heads_to_sequence, sequence_to_heads

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name


@dataclass(eq=False)
class SelfAttentionInputs:
    """What one block's self-attention attends to besides this call's K/V, decided before the block runs.

    ``cache``: the engine's view of the block's cache for this call
    (:meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.cache_view`). The processor hands it the call's K/V and
    attends to the keys and values it returns (:meth:`~fastgen_diffusers.kv_cache.plan.SlotView.attend`), whatever
    the storage: the storage's own buffers read in place (the call's K/V written into their slots, the first valid
    slots read, a size ``torch.compile`` treats as dynamic), or ``[gathered prefix | call]``, the prefix gathered
    right before the block runs ([`load`]) and dropped after it ([`release`]). A view that stores hands the call's
    K/V back for the engine to store once the blocks have run.

    ``mask``: a boolean or additive float ``(1, 1, Lq or 1, Lk)`` tensor for SDPA, or a FlexAttention ``BlockMask``,
    over all the keys attended in the order the view returns them. ``bias``: an :class:`AttentionBias` the processor
    adds to the scaled logits in a FlexAttention ``score_mod`` (with ``mask`` as the ``BlockMask`` when there is one).
    The model decides both (which keys, which values); the processor adds what it is given. Both ``None``: no mask.

    ``key_rotary``: ``None`` (keys are held after RoPE: this call's keys are rotated like its queries, by the block's
    ``rotary_emb``, before they are attended or stored), or ``(1, Lk, 1, D/2, 2)`` float32 rotations of every key the
    view can return, for keys held **before** RoPE (its first ``Lk`` rows are used). The cached keys and this call's
    keys are then rotated at read time and stored un-rotated; the queries keep the block's ``rotary_emb``.

    ``static``, ``key_cache``, ``value_cache``, ``write_index`` and ``valid_length`` are read-only views of ``cache``
    kept for external code.
    """

    cache: Any = None
    mask: Any = None
    bias: AttentionBias | None = None
    key_rotary: torch.Tensor | None = None

    def load(self) -> None:
        """Gather what the cache view reads (a prefix; nothing for a storage read in place)."""
        self.cache.load()

    def release(self) -> None:
        """Drop what :meth:`load` gathered once the block has run."""
        self.cache.release()

    @property
    def static(self) -> bool:
        return getattr(self.cache, "write_index", None) is not None

    @property
    def key_cache(self) -> torch.Tensor | None:
        return self.cache.key

    @property
    def value_cache(self) -> torch.Tensor | None:
        return self.cache.value

    @property
    def write_index(self) -> torch.Tensor | None:
        return getattr(self.cache, "write_index", None)

    @property
    def valid_length(self) -> torch.Tensor | None:
        return getattr(self.cache, "valid_length", None)


@dataclass(eq=False)
class CrossAttentionInputs:
    """One block's cross-attention in one forward: the mode and, in :attr:`CrossKVMode.READ`, the cached K/V.

    In :attr:`CrossKVMode.FILL` the processor hands the K/V it computed back in ``filled`` (text K, V, image K, V) for
    the model to store once the blocks have run.
    """

    mode: CrossKVMode = CrossKVMode.COMPUTE
    image_context_length: int = 0
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    key_img: torch.Tensor | None = None
    value_img: torch.Tensor | None = None
    filled: tuple | None = None


@dataclass(eq=False)
class BlockAttentionInputs:
    """Everything one causal block's processors need in one forward (built by the model, outside compiled code).

    Attributes:
        self_attn: :class:`SelfAttentionInputs` of the block's ``attn1``.
        cross_attn: :class:`CrossAttentionInputs` of the block's ``attn2``.
        num_frames: latent frames of the call (the Ulysses exchange splits tokens per frame).
    """

    self_attn: SelfAttentionInputs
    cross_attn: CrossAttentionInputs
    num_frames: int = 1


def _block_inputs(causal_context: CausalBlockView | None, attn, processor: object) -> BlockAttentionInputs:
    """The inputs of ``attn``'s block, from the engine that registered ``attn`` (the routing rule)."""
    if not isinstance(causal_context, CausalBlockView):
        raise RuntimeError(
            f"{type(processor).__name__} needs a `causal_context`; it runs inside WanCausalTransformer3DModel's "
            "causal blocks, which pass it. Use `set_default_attn_processor()` to go back to stock Wan attention."
        )
    engine = causal_context.resolve_registered_engine(attn)
    return causal_context.prepared_inputs(engine, attn)


def rms_norm_fp32(norm: torch.nn.RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """``norm(hidden_states)`` computed in float32 (as the students were trained), cast back to the input dtype."""
    weight = None if norm.weight is None else norm.weight.float()
    return F.rms_norm(hidden_states.float(), norm.normalized_shape, weight, norm.eps).type_as(hidden_states)


def apply_rotary_emb(hidden_states: torch.Tensor, rotary_emb: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved channel pairs of ``hidden_states`` ``(B, L, H, D)`` by ``rotary_emb``.

    ``rotary_emb`` is ``(1, L, 1, D/2)`` complex64, or the same as real pairs ``(1, L, 1, D/2, 2)`` float32
    (``torch.view_as_real``): pair ``(x[2i], x[2i+1])`` is multiplied, as the complex number ``x[2i] + j x[2i+1]``,
    by element ``i`` (one complex product: the math of diffusers' Wan RoPE, in float32). Eager runs the complex
    product; under ``torch.compile`` the same product is written in real arithmetic, which inductor fuses (it
    generates no code for complex operators).
    """
    if torch.compiler.is_compiling():
        rotation = rotary_emb if not rotary_emb.is_complex() else torch.view_as_real(rotary_emb)
        pairs = hidden_states.float().unflatten(-1, (-1, 2))
        real, imag = pairs[..., 0], pairs[..., 1]
        cos, sin = rotation[..., 0], rotation[..., 1]
        rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
        return rotated.flatten(-2).type_as(hidden_states)
    if not rotary_emb.is_complex():
        rotary_emb = torch.view_as_complex(rotary_emb)
    pairs = torch.view_as_complex(hidden_states.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotary_emb).flatten(-2).type_as(hidden_states)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Default dynamic-shape handling: sequence lengths change with the frames of a call and the cached prefix, so a
    # static-shape compile would recompile for every new length and fall back to eager at the recompile limit.
    return torch.compile(flex_attention)


def _bias_score_mod(bias: AttentionBias) -> Callable:
    """The FlexAttention ``score_mod`` adding ``bias`` to the scaled logits (built where it runs, so that a compiled
    block traces it with the bias tensors as inputs)."""
    rows, query_row = bias.rows, bias.query_row
    if query_row is None:

        def score_mod(score, batch, head, q_idx, kv_idx):
            return score + rows[0, kv_idx].to(score.dtype)

    else:

        def score_mod(score, batch, head, q_idx, kv_idx):
            return score + rows[query_row[q_idx], kv_idx].to(score.dtype)

    return score_mod


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, bias: AttentionBias | None = None
) -> torch.Tensor:
    """Attention of ``(B, Lq, H, D)`` queries over ``(B, Lk, H, D)`` keys under a mask and/or an additive bias.

    ``mask`` is a ``(1, 1, Lq or 1, Lk)`` tensor (SDPA: boolean, True = attend, or additive float), a FlexAttention
    ``BlockMask`` or ``None``; ``bias`` (:class:`AttentionBias`) runs FlexAttention with a ``score_mod`` adding it
    (and ``mask`` as its ``BlockMask``). The masked path never goes through a backend that could drop the mask.
    """
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if bias is None and isinstance(mask, torch.Tensor):
        mask = mask if mask.dtype == torch.bool else mask.to(query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        # Inside a compiled region flex_attention is compiled with it; eager, CUDA runs a compiled kernel.
        compiled = query.is_cuda and not torch.compiler.is_compiling()
        flex = _compiled_flex_attention() if compiled else flex_attention
        score_mod = None if bias is None else _bias_score_mod(bias)
        if torch.compiler.is_compiling() and not query.is_cuda:
            # inductor's CPU flex template reads a 4-d layout and fails on views of the rotated q/k (torch 2.13)
            query, key, value = (t.clone(memory_format=torch.contiguous_format) for t in (query, key, value))
        out = flex(query, key, value, score_mod=score_mod, block_mask=mask)
    return out.transpose(1, 2)


class WanCausalAttnProcessor:
    """Causal self-attention: RoPE-rotated K/V of this call attend after the cached prefix of the same branch and tag.

    Inside a call that spans several chunks the attention is block-causal. What the cache holds and where this
    call's K/V go come from the block's :class:`SelfAttentionInputs` (keys are kept after ``norm_k`` and RoPE, or
    before RoPE and rotated where attended when it carries ``key_rotary``).

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
        causal_context: CausalBlockView | None = None,
    ) -> torch.Tensor:
        block_inputs = _block_inputs(causal_context, attn, self)
        inputs = block_inputs.self_attn

        query, key, value = _get_qkv_projections(attn, hidden_states, None)  # (B, L, H*D)
        query = rms_norm_fp32(attn.norm_q, query).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        cp_config = context_parallel_config(self)
        if cp_config is not None:  # (B, F*S/P, H, D) -> (B, F*S, H/P, D): the whole call for this rank's heads
            query = sequence_to_heads(query, block_inputs.num_frames, cp_config)
        query = apply_rotary_emb(query, rotary_emb)
        key, value = _self_key_value(attn, key, value, rotary_emb, block_inputs, cp_config)

        full_key, full_value = inputs.cache.attend(key, value)
        if inputs.key_rotary is not None:  # keys held before RoPE: rotate every key read
            full_key = apply_rotary_emb(full_key, inputs.key_rotary[:, : full_key.shape[1]])
        if inputs.mask is None and inputs.bias is None:
            hidden_states = dispatch_attention_fn(query, full_key, full_value, backend=self._attention_backend)
        else:
            full_key, full_value = full_key.to(query.dtype), full_value.to(query.dtype)
            hidden_states = masked_attention(query, full_key, full_value, inputs.mask, inputs.bias)
        if cp_config is not None:
            hidden_states = heads_to_sequence(hidden_states, block_inputs.num_frames, cp_config)

        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)

    def store_only(
        self, attn, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, *, causal_context: CausalBlockView
    ) -> None:
        """The K/V half of :meth:`__call__`, for a forward whose attention output nothing reads (the last block of a
        store-only forward): this call's K/V, projected, normalized and rotated as ``__call__`` does, handed to the
        cache view as ``__call__`` hands them (written into their slots, or handed back to be stored); no query, no
        prefix gathered, no attention."""
        block_inputs = _block_inputs(causal_context, attn, self)
        if attn.fused_projections:
            _, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            key, value = attn.to_k(hidden_states), attn.to_v(hidden_states)
        key, value = _self_key_value(attn, key, value, rotary_emb, block_inputs, context_parallel_config(self))
        block_inputs.self_attn.cache.attend(key, value)


def _self_key_value(attn, key, value, rotary_emb, block_inputs, cp_config) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's projected ``(B, L, H*D)`` K/V as the cache view takes them (the K/V half of
    :meth:`WanCausalAttnProcessor.__call__`, shared with its ``store_only``): the key normalized, both split into
    heads, under context parallelism the whole call for this rank's heads, the key rotated when keys are held after
    RoPE (else held un-rotated, rotated where attended)."""
    key = rms_norm_fp32(attn.norm_k, key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if cp_config is not None:
        key, value = (sequence_to_heads(t, block_inputs.num_frames, cp_config) for t in (key, value))
    if block_inputs.self_attn.key_rotary is None:
        key = apply_rotary_emb(key, rotary_emb)
    return key, value


class WanCausalCrossAttnProcessor:
    """Cross-attention to the text (and, for Wan2.1 I2V, image) context with cached K/V.

    The context is ``[image tokens | text tokens]``; the split comes from the real image token count carried by the
    block's :class:`CrossAttentionInputs` (never from a hard-coded text length). In :attr:`CrossKVMode.READ` the K/V
    projections do not run.

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
        causal_context: CausalBlockView | None = None,
    ) -> torch.Tensor:
        inputs = _block_inputs(causal_context, attn, self).cross_attn

        query = rms_norm_fp32(attn.norm_q, attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        if inputs.mode is CrossKVMode.READ:
            key, value, key_img, value_img = inputs.key, inputs.value, inputs.key_img, inputs.value_img
        else:
            key, value, key_img, value_img = self._project_context(
                attn, encoder_hidden_states, inputs.image_context_length
            )
            if inputs.mode is CrossKVMode.FILL:
                inputs.filled = tuple(None if t is None else t.detach() for t in (key, value, key_img, value_img))

        hidden_states = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if key_img is not None:
            hidden_states_img = dispatch_attention_fn(query, key_img, value_img, backend=self._attention_backend)
            hidden_states = hidden_states + hidden_states_img.flatten(2, 3).type_as(query)

        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)

    def store_only(self, attn, encoder_hidden_states: torch.Tensor | None, *, causal_context: CausalBlockView) -> None:
        """What :meth:`__call__` leaves behind when nothing reads its output: the context K/V it fills
        (:attr:`CrossKVMode.FILL`), computed as ``__call__`` computes them; nothing in the other modes."""
        inputs = _block_inputs(causal_context, attn, self).cross_attn
        if inputs.mode is CrossKVMode.FILL:
            projected = self._project_context(attn, encoder_hidden_states, inputs.image_context_length)
            inputs.filled = tuple(None if t is None else t.detach() for t in projected)

    @staticmethod
    def _project_context(attn, encoder_hidden_states: torch.Tensor, image_len: int):
        """Text K/V ``(B, L_text, H, D)`` and, when image tokens lead the context, image K/V ``(B, L_img, H, D)``."""
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
