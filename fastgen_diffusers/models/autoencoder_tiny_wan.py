"""``AutoencoderTinyWan``: the tiny streaming autoencoder of the TAEHV family (``taew2_1``, ``taew2_2``) for Wan.

The TAEHV autoencoders (madebyollin/taehv) are 2D convolution stacks applied frame by frame, with two ways for frames
to meet: a *memory block* sees its own input and the input of the previous frame at its time resolution (zeros before
the first frame), and time is resampled by 1x1 convolutions that fold ``s`` consecutive frames into channels (encoder)
or unfold channels into ``s`` frames (decoder). So the only state a stream carries from one chunk to the next is the
last input frame of every memory block: [`AutoencoderTinyWan.decode_chunk`] keeps it in a [`TinyWanStreamState`], and
chunk after chunk gives the frames of one [`AutoencoderTinyWan.decode`] of all the latents.

At its surface the model speaks diffusers: ``(B, C, T, H, W)`` tensors, pixels in [-1, 1], latents exactly as the Wan
transformer produces them (TAEHV was trained on the normalized latents: no ``latents_mean`` / ``latents_std``).
Released checkpoints (a flat state dict, ``.pth`` or ``.safetensors``) load with
[`AutoencoderTinyWan.from_single_file`], which reads the configuration from the tensors' shapes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn

# Layer positions of the released layout (``encoder.{i}.*`` / ``decoder.{i}.*`` in the checkpoints).
ENCODER_TIME_LAYERS = (2, 7, 12)  # frame-folding 1x1 convs ("TPool")
DECODER_TIME_LAYERS = (7, 13, 19)  # frame-unfolding 1x1 convs ("TGrow")
ENCODER_WIDTH = 64
DECODER_WIDTHS = (256, 128, 64, 64)
IMAGE_CHANNELS = 3


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """``3 * tanh(x / 3)``: bounds the decoder's input latents smoothly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    """Residual 3-conv block over ``[frame, previous frame]`` (channels concatenated): ``relu(convs(x, past) + x)``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Sequential(
            _conv3x3(2 * channels, channels),
            nn.ReLU(),
            _conv3x3(channels, channels),
            nn.ReLU(),
            _conv3x3(channels, channels),
        )

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], dim=1)) + x)


class FrameFold(nn.Module):
    """Fold ``stride`` consecutive frames into channels, mixed by a 1x1 conv: ``T`` frames -> ``T / stride``."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C, H, W) -> (B, T / stride, C, H, W)
        batch, frames, channels, height, width = x.shape
        x = x.reshape(batch * frames // self.stride, self.stride * channels, height, width)
        return self.conv(x).unflatten(0, (batch, -1))


class FrameUnfold(nn.Module):
    """A 1x1 conv to ``stride`` times the channels, unfolded into ``stride`` frames: ``T`` frames -> ``T * stride``."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C, H, W) -> (B, T * stride, C, H, W)
        batch, frames, channels, height, width = x.shape
        x = self.conv(x.flatten(0, 1))  # (B*T, stride*C, H, W), frame k of each input frame = channel group k
        return x.reshape(batch, frames * self.stride, channels, height, width)


@dataclass
class TinyWanStreamState:
    """What a stream through [`AutoencoderTinyWan`] carries from one chunk to the next.

    ``memory[i]``: the last input frame ``(B, C, H, W)`` of memory block ``i`` (absent before the first frame);
    ``frames_out``: frames the decoder produced so far, trimmed ones included; ``pending``: encoder input frames
    ``(B, 3 * p * p, t, H, W)`` waiting for a full group of ``scale_factor_temporal`` frames. States are never
    modified in place by the model's arithmetic, so [`copy`] (a new dict, the tensors shared) forks a stream.
    """

    memory: dict[int, torch.Tensor] = field(default_factory=dict)
    frames_out: int = 0
    pending: torch.Tensor | None = None

    def copy(self) -> TinyWanStreamState:
        return TinyWanStreamState(dict(self.memory), self.frames_out, self.pending)


def _run_layers(layers: nn.ModuleList, x: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
    """Apply ``layers`` to ``x`` ``(B, T, C, H, W)``, all frames at once, memory blocks reading the previous frame
    from ``memory`` (updated with this chunk's last frame) for the chunk's first frame."""
    for index, layer in enumerate(layers):
        if isinstance(layer, MemoryBlock):
            first = memory.get(index)
            first = torch.zeros_like(x[:, 0]) if first is None else first
            past = torch.cat([first.unsqueeze(1), x[:, :-1]], dim=1)
            memory[index] = x[:, -1].clone()
            x = layer(x.flatten(0, 1), past.flatten(0, 1)).unflatten(0, x.shape[:2])
        elif isinstance(layer, (FrameFold, FrameUnfold)):
            x = layer(x)
        else:
            x = layer(x.flatten(0, 1)).unflatten(0, x.shape[:2])
    return x


class TinyWanEncoder(nn.Module):
    """Pixels (pixel-unshuffled by ``patch_size``) -> latents: 3 stages of stride-2 conv + 3 memory blocks, each
    stage after an optional 2x frame fold."""

    def __init__(self, latent_channels: int, patch_size: int, time_downscale: Sequence[bool]):
        super().__init__()
        width = ENCODER_WIDTH
        layers: list[nn.Module] = [_conv3x3(IMAGE_CHANNELS * patch_size**2, width), nn.ReLU()]
        for downscale in time_downscale:
            layers += [FrameFold(width, 2 if downscale else 1), _conv3x3(width, width, stride=2, bias=False)]
            layers += [MemoryBlock(width) for _ in range(3)]
        layers.append(_conv3x3(width, latent_channels))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
        return _run_layers(self.layers, x, memory)


class TinyWanDecoder(nn.Module):
    """Latents -> pixels (pixel-shuffled by ``patch_size`` afterwards): soft clamp, 3 stages of 3 memory blocks, each
    followed by an optional 2x nearest upsampling, an optional 2x frame unfold and a conv; then a ReLU and an output
    conv."""

    def __init__(
        self,
        latent_channels: int,
        patch_size: int,
        time_upscale: Sequence[bool],
        space_upscale: Sequence[bool],
    ):
        super().__init__()
        widths = DECODER_WIDTHS
        layers: list[nn.Module] = [SoftClamp(), _conv3x3(latent_channels, widths[0]), nn.ReLU()]
        for stage, (grow_time, grow_space) in enumerate(zip(time_upscale, space_upscale)):
            layers += [MemoryBlock(widths[stage]) for _ in range(3)]
            layers += [
                nn.Upsample(scale_factor=2 if grow_space else 1),
                FrameUnfold(widths[stage], 2 if grow_time else 1),
            ]
            layers.append(_conv3x3(widths[stage], widths[stage + 1], bias=False))
        layers += [nn.ReLU(), _conv3x3(widths[-1], IMAGE_CHANNELS * patch_size**2)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
        return _run_layers(self.layers, x, memory)


def _check_flags(name: str, value: Sequence[bool]) -> tuple[bool, bool, bool]:
    if len(value) != 3 or not all(isinstance(v, bool) for v in value):
        raise ValueError(f"`{name}` must be 3 booleans (one per stage), got {value!r}")
    return tuple(value)


class AutoencoderTinyWan(ModelMixin, ConfigMixin):
    r"""The tiny streaming autoencoder of the TAEHV family for Wan latents (``taew2_1``: Wan2.1, 16 channels;
    ``taew2_2``: Wan2.2-TI2V, 48 channels, patch 2).

    [`decode`] maps ``(B, C, T, h, w)`` latents, exactly as the Wan transformer produces them (no latent
    de-normalization), to ``(B, 3, 4T - 3, 8 p h, 8 p w)`` frames in [-1, 1]; [`encode`] maps ``(B, 3, F, H, W)``
    frames in [-1, 1] to ``(B, C, ceil(F / 4), H / (8 p), W / (8 p))`` latents (the last group padded with the last
    frame). [`decode_chunk`] / [`encode_chunk`] stream: consecutive chunks with one [`TinyWanStreamState`] give the
    same frames as one call on all of them.

    Args:
        latent_channels (`int`): channels of the latents (16 for Wan2.1, 48 for Wan2.2-TI2V).
        patch_size (`int`): pixel (un)shuffle factor around the conv stacks (1 for Wan2.1, 2 for Wan2.2-TI2V).
        encoder_time_downscale (`tuple[bool, bool, bool]`): which encoder stages fold 2 frames into 1.
        decoder_time_upscale (`tuple[bool, bool, bool]`): which decoder stages unfold 1 frame into 2.
        decoder_space_upscale (`tuple[bool, bool, bool]`): which decoder stages upsample 2x in space.
        scale_factor_temporal (`int`), scale_factor_spatial (`int`): the resulting factors, stated for the pipelines
            (``vae.config.scale_factor_*`` as for `AutoencoderKLWan`); they must agree with the flags.

    Examples:
        ```python
        >>> from fastgen_diffusers import AutoencoderTinyWan

        >>> vae = AutoencoderTinyWan.from_single_file("taew2_1.pth")
        >>> frames = vae.decode(latents).sample  # (1, 3, 4T - 3, 8h, 8w) in [-1, 1]
        ```
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        latent_channels: int = 16,
        patch_size: int = 1,
        encoder_time_downscale: tuple[bool, bool, bool] = (True, True, False),
        decoder_time_upscale: tuple[bool, bool, bool] = (False, True, True),
        decoder_space_upscale: tuple[bool, bool, bool] = (True, True, True),
        scale_factor_temporal: int = 4,
        scale_factor_spatial: int = 8,
    ):
        super().__init__()
        encoder_time_downscale = _check_flags("encoder_time_downscale", encoder_time_downscale)
        decoder_time_upscale = _check_flags("decoder_time_upscale", decoder_time_upscale)
        decoder_space_upscale = _check_flags("decoder_space_upscale", decoder_space_upscale)
        if latent_channels < 1 or patch_size < 1:
            raise ValueError(
                f"`latent_channels` and `patch_size` must be positive, got {latent_channels} and {patch_size}"
            )
        temporal_down = 2 ** sum(encoder_time_downscale)
        temporal_up = 2 ** sum(decoder_time_upscale)
        spatial = 2 ** sum(decoder_space_upscale) * patch_size
        if temporal_down != temporal_up or scale_factor_temporal != temporal_up:
            raise ValueError(
                f"`scale_factor_temporal` ({scale_factor_temporal}) must equal the encoder's frame folding "
                f"({temporal_down}) and the decoder's frame unfolding ({temporal_up})"
            )
        if scale_factor_spatial != spatial or 2**3 * patch_size != spatial:
            raise ValueError(
                f"`scale_factor_spatial` ({scale_factor_spatial}) must equal the decoder's upsampling times "
                f"`patch_size` ({spatial}), and the encoder's 8 * `patch_size` ({8 * patch_size})"
            )
        self.encoder = TinyWanEncoder(latent_channels, patch_size, encoder_time_downscale)
        self.decoder = TinyWanDecoder(latent_channels, patch_size, decoder_time_upscale, decoder_space_upscale)
        self.use_tiling = False  # never tiles (as diffusers' `AutoencoderTiny` states it); pipelines read the flag

    @property
    def frames_to_trim(self) -> int:
        """Leading decoder output frames dropped (the first latent frame decodes to 1 frame, later ones to 4)."""
        return self.config.scale_factor_temporal - 1

    # Decoding ---------------------------------------------------------------------------------------------------

    @apply_forward_hook  # model CPU offload moves the weights in first, as for diffusers' autoencoders
    def decode_chunk(self, latents: torch.Tensor, state: TinyWanStreamState) -> torch.Tensor:
        """Decode the next latent frames of a stream, updating ``state``.

        Args:
            latents: ``(B, C, T, h, w)`` latents that follow the frames ``state`` has seen.
            state: the stream's [`TinyWanStreamState`] (a new one starts a video).

        Returns:
            ``(B, 3, F, 8 p h, 8 p w)`` frames in [-1, 1]: ``F = 4T - 3`` for the chunk that starts the video, ``4T``
            after it.
        """
        self._check_latents(latents)
        x = latents.to(self.device, self.dtype).transpose(1, 2)  # (B, T, C, h, w)
        x = self.decoder(x, state.memory)  # (B, 4T, 3 p p, H / p, W / p)
        trim = max(self.frames_to_trim - state.frames_out, 0)
        state.frames_out += x.shape[1]
        x = x[:, trim:]
        patch_size = self.config.patch_size
        if patch_size > 1:
            x = F.pixel_shuffle(x.flatten(0, 1), patch_size).unflatten(0, x.shape[:2])
        return x.clamp(0, 1).mul(2).sub(1).transpose(1, 2)

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple[torch.Tensor]:
        """Decode latents ``(B, C, T, h, w)`` to frames ``(B, 3, 4T - 3, 8 p h, 8 p w)`` in [-1, 1]."""
        video = self.decode_chunk(z, TinyWanStreamState())
        return DecoderOutput(sample=video) if return_dict else (video,)

    def _check_latents(self, latents: torch.Tensor) -> None:
        channels = self.config.latent_channels
        if latents.ndim != 5 or latents.shape[1] != channels or latents.shape[2] == 0:
            raise ValueError(
                f"`latents` must be (B, {channels}, T >= 1, h, w) latents, got shape {tuple(latents.shape)}"
            )

    # Encoding ---------------------------------------------------------------------------------------------------

    @apply_forward_hook
    def encode_chunk(self, video: torch.Tensor, state: TinyWanStreamState, last: bool = False) -> torch.Tensor:
        """Encode the next frames of a stream, updating ``state``; frames that do not fill a group of
        ``scale_factor_temporal`` wait in ``state`` for the next chunk, or, with ``last=True``, are completed with
        copies of the last frame.

        Args:
            video: ``(B, 3, F, H, W)`` frames in [-1, 1] (``F`` may be 0 with ``last=True``), ``H`` and ``W``
                multiples of ``scale_factor_spatial``.
            state: the stream's [`TinyWanStreamState`].
            last: this chunk ends the video.

        Returns:
            ``(B, C, T, H / s, W / s)`` latents for every full group so far (``T`` may be 0).
        """
        spatial = self.config.scale_factor_spatial
        if (
            video.ndim != 5
            or video.shape[1] != IMAGE_CHANNELS
            or video.shape[-1] % spatial
            or video.shape[-2] % spatial
        ):
            raise ValueError(
                f"`video` must be (B, 3, F, H, W) frames with H and W multiples of {spatial}, "
                f"got shape {tuple(video.shape)}"
            )
        x = video.to(self.device, self.dtype).transpose(1, 2).add(1).div(2)  # (B, F, 3, H, W) in [0, 1]
        patch_size = self.config.patch_size
        if patch_size > 1:
            x = F.pixel_unshuffle(x.flatten(0, 1), patch_size).unflatten(0, x.shape[:2])
        if state.pending is not None:
            x = torch.cat([state.pending, x], dim=1)
        group = self.config.scale_factor_temporal
        if last and x.shape[1] % group:
            x = torch.cat([x, x[:, -1:].expand(-1, group - x.shape[1] % group, -1, -1, -1)], dim=1)
        full = x.shape[1] - x.shape[1] % group
        state.pending = x[:, full:] if full < x.shape[1] else None
        if full == 0:
            batch, _, _, height, width = x.shape
            return x.new_zeros(batch, self.config.latent_channels, 0, height // 8, width // 8)
        return self.encoder(x[:, :full], state.memory).transpose(1, 2)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> AutoencoderTinyOutput | tuple[torch.Tensor]:
        """Encode frames ``(B, 3, F, H, W)`` in [-1, 1] to latents ``(B, C, ceil(F / 4), H / s, W / s)``."""
        latents = self.encode_chunk(x, TinyWanStreamState(), last=True)
        return AutoencoderTinyOutput(latents=latents) if return_dict else (latents,)

    def forward(self, sample: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple[torch.Tensor]:
        """Encode then decode ``sample`` frames."""
        return self.decode(self.encode(sample).latents, return_dict=return_dict)

    # Loading released checkpoints -------------------------------------------------------------------------------

    @classmethod
    def from_single_file(
        cls, pretrained_model_link_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None
    ) -> AutoencoderTinyWan:
        """Load a released TAEHV-family checkpoint (``taew2_1.pth``, ``taew2_2.pth`` or their ``.safetensors``
        copies: a flat state dict keyed ``encoder.{i}.*`` / ``decoder.{i}.*``) from a local file. The configuration
        is read from the tensors' shapes, never from the file name."""
        path = os.fspath(pretrained_model_link_or_path)
        if not os.path.isfile(path):
            raise ValueError(
                f"`pretrained_model_link_or_path` must be a local .pth or .safetensors file, got {path!r}"
            )
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state_dict = load_file(path)
        else:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise ValueError(f"{path!r} does not hold a flat state dict of tensors")
        return cls.from_released_state_dict(state_dict, torch_dtype=torch_dtype)

    @classmethod
    def from_released_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], torch_dtype: torch.dtype | None = None
    ) -> AutoencoderTinyWan:
        """Build the model from a released state dict (see [`from_single_file`]), in ``torch_dtype`` (default float32,
        whatever the file's dtype)."""
        config, converted = convert_released_state_dict(state_dict)
        dtype = torch_dtype or torch.float32
        with torch.device("meta"):  # no random init: every parameter comes from the file
            model = cls(**config)
        model.load_state_dict({key: value.to(dtype) for key, value in converted.items()}, strict=True, assign=True)
        return model.eval()


def _released_shape(state_dict: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    if key not in state_dict:
        raise ValueError(
            f"not a TAEHV-family checkpoint (taew2_1 / taew2_2 layout): missing {key!r} "
            f"(keys start with {sorted(state_dict)[:3]})"
        )
    return tuple(state_dict[key].shape)


def convert_released_state_dict(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """The configuration and the model's state dict for a released flat state dict, told from the tensors' shapes:
    latent channels from the decoder's first conv, the patch size from the encoder's first conv, the time factors
    from the frame (un)folding convs. A released decoder may carry a frame unfold trained for 2 frames where the
    encoder folds fewer (upstream keeps the last frame's channels and turns the earliest such stage off); this does the
    same, so decoding and encoding keep 4 frames per latent."""
    if "decoder.1.conv.0.weight" in state_dict:
        raise ValueError("the 'super' TAEHV decoder variant (taew2_2_super) is not supported; use taew2_1 or taew2_2")
    latent_channels = _released_shape(state_dict, "decoder.1.weight")[1]
    image_channels = _released_shape(state_dict, "encoder.0.weight")[1]
    patch_size = math.isqrt(image_channels // IMAGE_CHANNELS)
    if IMAGE_CHANNELS * patch_size**2 != image_channels:
        raise ValueError(f"the encoder's first conv takes {image_channels} channels, not 3 * patch_size ** 2")
    folds = [_released_shape(state_dict, f"encoder.{i}.conv.weight") for i in ENCODER_TIME_LAYERS]
    encoder_time_downscale = tuple(shape[1] == 2 * shape[0] for shape in folds)
    unfolds = [_released_shape(state_dict, f"decoder.{i}.conv.weight") for i in DECODER_TIME_LAYERS]
    decoder_time_upscale = [shape[0] == 2 * shape[1] for shape in unfolds]
    for index, flag in enumerate(decoder_time_upscale):  # turn the earliest unfolds off until the factors agree
        if sum(decoder_time_upscale) > sum(encoder_time_downscale) and flag:
            decoder_time_upscale[index] = False
    temporal = 2 ** sum(encoder_time_downscale)
    if 2 ** sum(decoder_time_upscale) != temporal:
        raise ValueError(
            f"the decoder unfolds {2 ** sum(decoder_time_upscale)} frames per latent, the encoder folds {temporal}"
        )
    converted = {}
    for key, value in state_dict.items():
        part, _, rest = key.partition(".")
        if part not in ("encoder", "decoder"):
            raise ValueError(f"unexpected key {key!r} in a TAEHV-family checkpoint")
        converted[f"{part}.layers.{rest}"] = value
    for index, layer in zip(DECODER_TIME_LAYERS, decoder_time_upscale):
        key = f"decoder.layers.{index}.conv.weight"
        channels = converted[key].shape[1]
        keep = (2 if layer else 1) * channels
        if converted[key].shape[0] != keep:
            converted[key] = converted[key][-keep:].clone()  # the last frame's channels
    config = {
        "latent_channels": latent_channels,
        "patch_size": patch_size,
        "encoder_time_downscale": encoder_time_downscale,
        "decoder_time_upscale": tuple(decoder_time_upscale),
        "scale_factor_temporal": temporal,
        "scale_factor_spatial": 8 * patch_size,
    }
    return config, converted
