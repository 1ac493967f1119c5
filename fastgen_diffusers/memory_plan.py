"""Device memory of a causal rollout from the formulas, before any weight is loaded.

[`plan_rollout_memory`] adds up what a GPU must hold while a rollout runs:

* **transformer weights**: the parameter count of the causal Wan transformer from its configuration, stored as
  diffusers' loader stores it (the linears in ``weight_dtype``, e.g. FP8 or int8 under diffusers' ``TorchAoConfig``,
  plus torchao's per-row scale (and int8's zero point); biases, norms and the patch embedding in ``compute_dtype``;
  the time embedder, the modulation tables and ``norm2`` in float32, the model's ``_keep_in_fp32_modules``);
* **self-attention K/V**: the cache formula ``2 x layers x batch x heads x cached tokens x head_dim x bytes`` per cache
  tag (2 tags under classifier-free guidance) over the frames the policy's engines allocate: the whole video
  (``"sequential"``), the window (``attention_window``), the context and one chunk (``"recompute"``, Krea's bounded
  cache) or the anchor and the attention window (``"rolling"``); an 8-bit cache adds its float32 scales;
* **cross-attention K/V**: ``2 x layers x batch x text tokens x dim x bytes`` per tag;
* **activations** of one forward (an estimate: the live tensors of one block on the frames a forward carries);
* **text encoder** (UMT5-XXL unless given) unless offloaded, and the **decoder** (Wan VAE or a tiny decoder) with
  an estimate of its streamed decode's working memory.

The cache terms are exact (``tests/test_memory_plan.py`` checks them against the engines' ``kv_cache_bytes()`` after
real rollouts, and the weights against parameter counts of real models); activations and decode working memory are
estimates, which ``benchmarks/bench_end_to_end.py`` compares with the measured peak on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .kv_cache.accounting import expected_kv_cache_bytes
from .settings import KV_CACHE_DTYPE_NAMES, RolloutSettings

WEIGHT_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# torchao's per-row metadata of a quantized linear weight: float8 (PerRow) a float32 scale; int8 weight-only a
# float32 scale and an int8 zero point
QUANTIZED_ROW_BYTES = {"float8_e4m3fn": 4, "int8": 5}
DECODERS = ("wan", "tiny", None)
GIB = 2**30

# Published shapes (diffusers' Wan transformer configuration keys).
WAN_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
}
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}  # Krea Realtime 14B too
UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64}
# Estimated working memory of a streamed decode per output pixel and channel of its widest full-resolution stage
# (input, output and the causal convolutions' carried frames alive at once), times those channels.
DECODER_FULL_RES_CHANNELS = {"wan": 96, "tiny": 64}
DECODE_LIVE_TENSORS = {"wan": 8, "tiny": 4}


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ParameterCounts(NamedTuple):
    """Parameters of a causal Wan transformer by how diffusers stores them.

    ``linear``: elements of the ``nn.Linear`` weights weight quantization converts (every linear outside the time
    embedder); ``rows``: their output features (one scale each when quantized); ``other``: the rest held in the
    compute dtype (biases, q/k RMSNorms, the patch embedding); ``float32``: what diffusers' loader keeps in float32
    whatever ``torch_dtype`` (the model's ``_keep_in_fp32_modules``: the time embedder, the modulation tables,
    ``norm2``), never quantized.
    """

    linear: int
    rows: int
    other: int
    float32: int

    @property
    def total(self) -> int:
        return self.linear + self.other + self.float32


def transformer_parameter_counts(config: Mapping[str, Any]) -> ParameterCounts:
    """The [`ParameterCounts`] of a (causal) Wan text-to-video transformer of ``config``. Raises ``ValueError`` for an
    image-conditioned configuration (``image_dim`` / ``added_kv_proj_dim``), which the plan does not cover."""
    if config.get("image_dim") is not None or config.get("added_kv_proj_dim") is not None:
        raise ValueError(
            "`config` must describe a text-to-video transformer (`image_dim` / `added_kv_proj_dim` None)."
        )
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    ffn, layers, freq, text = config["ffn_dim"], config["num_layers"], config["freq_dim"], config["text_dim"]
    patch = math.prod(config["patch_size"])
    out = config["out_channels"] * patch
    # per block: self and cross attention q/k/v/out (4 + 4 linears of dim x dim), FFN dim -> ffn -> dim; their
    # biases and the q/k RMSNorms; in float32 the modulation table (6 dim) and norm2's affine (2 dim)
    block_weights = 8 * dim * dim + 2 * dim * ffn
    block_rows = 8 * dim + ffn + dim
    block_other = block_rows + 4 * dim
    block_float32 = 6 * dim + (2 * dim if config.get("cross_attn_norm", True) else 0)
    # time projection (dim -> 6 dim), text embedder (text -> dim -> dim), output; biases, patch conv; in float32 the
    # time embedder (freq -> dim -> dim, with biases) and the output modulation table (2 dim)
    top_weights = 6 * dim * dim + text * dim + dim * dim + dim * out
    top_rows = 6 * dim + dim + dim + out
    top_other = top_rows + config["in_channels"] * patch * dim + dim
    top_float32 = freq * dim + dim + dim * dim + dim + 2 * dim
    return ParameterCounts(
        linear=layers * block_weights + top_weights,
        rows=layers * block_rows + top_rows,
        other=layers * block_other + top_other,
        float32=layers * block_float32 + top_float32,
    )


def umt5_encoder_parameters(config: Mapping[str, int] = UMT5_XXL) -> int:
    """Parameters of a UMT5 encoder (``UMT5EncoderModel``: shared embedding, per layer self-attention with its own
    relative position bias (32 buckets), gated-GELU FFN and two RMSNorms, final RMSNorm)."""
    d, inner, ff = config["d_model"], config["num_heads"] * config["d_kv"], config["d_ff"]
    per_layer = 4 * d * inner + 32 * config["num_heads"] + 3 * d * ff + 2 * d
    return config["vocab_size"] * d + config["num_layers"] * per_layer + d


def decoder_parameters(decoder: str) -> int:
    """Parameters of the decoding half of the ``"wan"`` decoder (diffusers' ``AutoencoderKLWan``, Wan2.1's VAE: its
    decoder and ``post_quant_conv``) or the ``"tiny"`` one (``AutoencoderTinyWan``), counted on the meta device."""
    if decoder == "wan":
        from diffusers import AutoencoderKLWan

        with torch.device("meta"):
            vae = AutoencoderKLWan()
        return sum(p.numel() for name, p in vae.named_parameters() if not name.startswith(("encoder.", "quant_conv.")))
    from .models.autoencoder_tiny_wan import AutoencoderTinyWan

    with torch.device("meta"):
        tiny = AutoencoderTinyWan()
    return sum(p.numel() for name, p in tiny.named_parameters() if not name.startswith("encoder."))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a rollout holds on its device, by part (see the module docstring for what each includes)."""

    weights: int
    self_kv_cache: int
    cross_kv_cache: int
    activations: int
    text_encoder: int
    decoder: int
    cached_frames: int
    frames_per_forward: int
    description: str = ""

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in PLAN_PARTS)

    def summary(self) -> str:
        """One line per part in GiB and the total (what ``bench_end_to_end.py`` prints before running)."""
        rows = [f"memory plan ({self.description})" if self.description else "memory plan"]
        notes = {
            "self_kv_cache": f"{self.cached_frames} latent frames",
            "activations": f"one forward on {self.frames_per_forward} frames, estimate",
        }
        for name in PLAN_PARTS:
            note = f" ({notes[name]})" if name in notes else ""
            rows.append(f"  {name.replace('_', ' ')}: {getattr(self, name) / GIB:.2f} GiB{note}")
        rows.append(f"  total: {self.total / GIB:.2f} GiB")
        return "\n".join(rows)


PLAN_PARTS = ("weights", "self_kv_cache", "cross_kv_cache", "activations", "text_encoder", "decoder")


def _check_choice(name: str, value: Any, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"`{name}` must be one of {list(accepted)}, got {value!r}.")


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def plan_rollout_memory(
    config: Mapping[str, Any],
    *,
    height: int = 480,
    width: int = 832,
    num_frames: int = 81,
    chunk_size: int = 3,
    batch_size: int = 1,
    guidance_scale: float = 1.0,
    weight_dtype: str = "bfloat16",
    compute_dtype: str = "bfloat16",
    kv_cache_dtype: str | None = None,
    kv_cache_policy: str = "sequential",
    attention_window: int | None = None,
    context_frames: int | None = None,
    num_inference_steps: int = 4,
    text_len: int = 512,
    text_encoder_parameters: int | None = None,
    text_encoder_offloaded: bool = False,
    decoder: str | None = "wan",
    description: str = "",
) -> MemoryPlan:
    """The [`MemoryPlan`] of a rollout of the transformer ``config`` (a diffusers Wan configuration dict, e.g.
    ``transformer.config``, :data:`WAN_1_3B` or :data:`WAN_14B`).

    Args:
        height, width, num_frames: the video (``num_frames`` pixel frames, 4k+1; tokens per latent frame
            ``(height / 16) x (width / 16)`` with the (1, 2, 2) patch).
        chunk_size: latent frames per chunk.
        batch_size, guidance_scale: batch and classifier-free guidance (> 1: a second cache tag).
        weight_dtype: storage of the linear weights, one of :data:`WEIGHT_DTYPES` (``"float8_e4m3fn"`` /
            ``"int8"``: quantized per output row, :data:`QUANTIZED_ROW_BYTES` of metadata each).
        compute_dtype: the other parameters, the activations and the cache.
        kv_cache_dtype: ``None`` (the compute dtype) or an 8-bit cache (``"float8_e4m3fn"``, ``"int8"``).
        kv_cache_policy, attention_window, context_frames: the cache policy (a registered policy name), its window and
            Krea's recompute context (required for ``"recompute"``).
        num_inference_steps: steps per chunk (the rolling policy's forwards carry one chunk per step).
        text_len: text tokens (UMT5: 512).
        text_encoder_parameters: the text encoder's parameters (default UMT5-XXL's), held in ``compute_dtype``
            unless ``text_encoder_offloaded``.
        decoder: ``"wan"``, ``"tiny"`` or ``None`` (no decode on the device).
    """
    _check_positive(
        height=height, width=width, num_frames=num_frames, chunk_size=chunk_size, batch_size=batch_size,
        num_inference_steps=num_inference_steps, text_len=text_len,
    )  # fmt: skip
    if height % 16 or width % 16:
        raise ValueError(f"`height` and `width` must be multiples of 16, got {height}x{width}.")
    if (num_frames - 1) % 4:
        raise ValueError(f"`num_frames` must be of the form 4k+1, got {num_frames}.")
    _check_choice("weight_dtype", weight_dtype, tuple(WEIGHT_DTYPES))
    _check_choice("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    _check_choice("decoder", decoder, DECODERS)
    _check_choice("kv_cache_dtype", kv_cache_dtype, (None, *KV_CACHE_DTYPE_NAMES))  # by name here
    # the cache settings' and the policy's rules, stated once (fastgen_diffusers.settings)
    settings = RolloutSettings.from_arguments(
        kv_cache_policy=kv_cache_policy,
        attention_window=attention_window,
        context_frames=context_frames,
        kv_cache_dtype=kv_cache_dtype,
    )
    policy = settings.active_policy

    compute = WEIGHT_DTYPES[compute_dtype]
    compute_bytes = _dtype_bytes(compute)
    counts = transformer_parameter_counts(config)
    weights = (
        counts.linear * _dtype_bytes(WEIGHT_DTYPES[weight_dtype])
        + counts.rows * QUANTIZED_ROW_BYTES.get(weight_dtype, 0)
        + counts.other * compute_bytes
        + counts.float32 * 4
    )

    heads, head_dim, layers = config["num_attention_heads"], config["attention_head_dim"], config["num_layers"]
    dim = heads * head_dim
    tags = 2 if guidance_scale > 1 else 1
    latent_frames = (num_frames - 1) // 4 + 1
    patch_size = config["patch_size"]
    tokens_per_frame = (height // 8 // patch_size[-2]) * (width // 8 // patch_size[-1])
    frames = policy.held_frames(latent_frames, chunk_size, attention_window)
    self_cache, cross_cache = expected_kv_cache_bytes(
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        patch_size=patch_size,
        height=height,
        width=width,
        cached_frames=frames,
        text_tokens=text_len,
        dtype=compute,
        cache_dtype=None if kv_cache_dtype is None else WEIGHT_DTYPES[kv_cache_dtype],
        batch_size=batch_size,
        tags=tags,
    )

    # One forward at a time (CFG branches run one after the other). Live tensors of one block on the tokens of a
    # forward: residual, normed input, q, k, v, attention output, projection (7 x dim), the FFN hidden and its GELU
    # (2 x ffn), two float32 norm/modulation temporaries (dim each at 4 bytes), and the rotated keys of the chunk.
    forward_frames = policy.forward_frames(chunk_size, num_inference_steps, attention_window)
    tokens = batch_size * forward_frames * tokens_per_frame
    activations = tokens * ((8 * dim + 2 * config["ffn_dim"]) * compute_bytes + 2 * dim * 4)
    activations += batch_size * text_len * (config["text_dim"] + dim) * compute_bytes  # prompt embeds, embedded

    if text_encoder_offloaded:
        text_encoder = 0
    else:
        parameters = umt5_encoder_parameters() if text_encoder_parameters is None else text_encoder_parameters
        text_encoder = parameters * compute_bytes
    decoder_bytes = 0
    if decoder is not None:
        working = DECODE_LIVE_TENSORS[decoder] * batch_size * 4 * height * width * DECODER_FULL_RES_CHANNELS[decoder]
        decoder_bytes = (decoder_parameters(decoder) + working) * compute_bytes
    return MemoryPlan(
        weights=weights,
        self_kv_cache=self_cache,
        cross_kv_cache=cross_cache,
        activations=activations,
        text_encoder=text_encoder,
        decoder=decoder_bytes,
        cached_frames=frames,
        frames_per_forward=forward_frames,
        description=description,
    )
