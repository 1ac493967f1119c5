"""Tiny, seeded, offline components for tests, the quickstart notebook and the CLI demo.

Nothing here touches the network: the T5 tokenizer is a Unigram model built in code from a word list, and every
model is built from a config with a fixed seed. The weights are random, so the videos are noise-like; what these
components exercise is the full path (tokenize, encode, causal rollout, decode, export).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from .models import AutoencoderTinyWan, WanCausalTransformer3DModel, WanCausalVACETransformer3DModel
from .pipelines import WanCausalPipeline, WanCausalVACEPipeline

TINY_TEXT_DIM = 32
TINY_TRANSFORMER_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,  # RoPE split 12/10/10 (head_dim % 6 < 3)
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": TINY_TEXT_DIM,
    "freq_dim": 256,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 1024,
    "chunk_size": 3,
}
TINY_WORDS = (
    "a the of and in on with red blue green fox cat dog bird runs walks flies through over fresh snow grass water "
    "forest city street night day sun rain video camera slow fast"
).split()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """A CPU RNG scope: components built inside draw from ``seed`` and leave the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_tokenizer() -> T5Tokenizer:
    """A T5 (Unigram) tokenizer built in code: special tokens, ``TINY_WORDS`` and single letters as fallback."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, -1.0) for word in TINY_WORDS]
    vocab += [(letter, -5.0) for letter in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def tiny_text_encoder(vocab_size: int, seed: int = 0) -> UMT5EncoderModel:
    """A 2-layer UMT5 encoder with ``d_model == TINY_TEXT_DIM`` (the tiny transformer's ``text_dim``)."""
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TINY_TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
    )
    with _seeded(seed):
        return UMT5EncoderModel(config).eval()


def tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    """A Wan VAE with diffusers' test sizes: 16 latent channels, 8x spatial and 4x temporal compression."""
    with _seeded(seed):
        return AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ).eval()


def taehv_released_state_dict(
    latent_channels: int = 16, patch_size: int = 1, seed: int = 0, oversized_first_unfold: bool = False
) -> dict[str, torch.Tensor]:
    """Seeded random weights for a TAEHV-family checkpoint in its released key layout (``encoder.{i}.*``,
    ``decoder.{i}.*``; ``taew2_1``: 16 channels, patch 1; ``taew2_2``: 48, patch 2), as ``tests/data/taehv_tiny`` was
    recorded with: key by key in sorted order from one ``torch.Generator(seed)``, ``randn * sqrt(1 / fan_in)`` for
    weights, ``randn * 0.1`` for biases (+ 0.4 for the last decoder conv's, so frames sit inside [0, 1]).
    ``oversized_first_unfold``: the first decoder frame unfold carries 2 frames' channels, as upstream tolerates."""
    with torch.device("meta"):  # shapes only
        model = AutoencoderTinyWan(
            latent_channels=latent_channels, patch_size=patch_size, scale_factor_spatial=8 * patch_size
        )
    shapes = {key.replace(".layers.", ".", 1): tuple(v.shape) for key, v in model.state_dict().items()}
    if oversized_first_unfold:
        channels_out, channels_in = shapes["decoder.7.conv.weight"][:2]
        shapes["decoder.7.conv.weight"] = (2 * channels_out, channels_in, 1, 1)
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for key in sorted(shapes):
        value = torch.randn(shapes[key], generator=generator, dtype=torch.float32)
        if key.endswith(".bias"):
            state_dict[key] = value * 0.1 + (0.4 if key == "decoder.22.bias" else 0.0)
        else:
            state_dict[key] = value * math.sqrt(1.0 / math.prod(shapes[key][1:]))
    return state_dict


def tiny_taehv(seed: int = 0) -> AutoencoderTinyWan:
    """A random-weight [`AutoencoderTinyWan`] for Wan2.1 latents (16 channels; the architecture has fixed widths)."""
    return AutoencoderTinyWan.from_released_state_dict(taehv_released_state_dict(seed=seed))


def tiny_transformer(seed: int = 0, **overrides) -> WanCausalTransformer3DModel:
    """A 2-layer causal Wan transformer (2 heads x 32) with ``TINY_TRANSFORMER_CONFIG`` updated by ``overrides``."""
    with _seeded(seed):
        return WanCausalTransformer3DModel(**{**TINY_TRANSFORMER_CONFIG, **overrides}).eval()


def tiny_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The causal students' few-step sampler: predict x0, then re-noise (shift 5)."""
    return FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)


def tiny_components(seed: int = 0, **transformer_overrides) -> dict:
    """All five components of a [`WanCausalPipeline`], seeded and built offline."""
    tokenizer = tiny_tokenizer()
    return {
        "tokenizer": tokenizer,
        "text_encoder": tiny_text_encoder(len(tokenizer), seed),
        "vae": tiny_vae(seed),
        "scheduler": tiny_scheduler(),
        "transformer": tiny_transformer(seed, **transformer_overrides),
    }


def tiny_vace_pipeline(seed: int = 0, **transformer_overrides) -> WanCausalVACEPipeline:
    """A random-weight [`WanCausalVACEPipeline`]: the tiny components with a causal VACE transformer (VACE on both
    layers)."""
    components = tiny_components(seed)
    config = {**TINY_TRANSFORMER_CONFIG, "vace_layers": (0, 1), "vace_in_channels": 96, **transformer_overrides}
    with _seeded(seed):
        components["transformer"] = WanCausalVACETransformer3DModel(**config).eval()
    return WanCausalVACEPipeline(**components)


def tiny_pipeline(seed: int = 0, **transformer_overrides) -> WanCausalPipeline:
    """A random-weight [`WanCausalPipeline`] that runs on a CPU in well under a second (e.g. 32x32, 9 frames)."""
    return WanCausalPipeline(**tiny_components(seed, **transformer_overrides))


class _SilentProgressBar:
    """A progress bar that shows nothing (``total`` grows for open-ended rollouts, as tqdm's does)."""

    total = 0

    def __enter__(self) -> _SilentProgressBar:
        return self

    def __exit__(self, *args) -> None:
        return None

    def update(self, n: int = 1) -> None:
        pass


class PolicyHost:
    """What a rollout policy reads of a pipeline: its ``scheduler`` (a tiny shift-5 one by default), a progress bar
    and the diffusers callback state. Runs a policy on the transformer alone, without text encoder or VAE:
    ``policy.run(PolicyHost(), session, plan, source)``."""

    interrupt = False
    _num_timesteps = 0
    _current_timestep = None

    def __init__(self, scheduler=None) -> None:
        self.scheduler = tiny_scheduler() if scheduler is None else scheduler

    def progress_bar(self, total: int | None = None) -> _SilentProgressBar:
        return _SilentProgressBar()
