"""Which streamed decoder / encoder serves a pipeline's autoencoder: the Wan VAE ([`StreamingWanDecoder`],
[`StreamingWanEncoder`], latents de-normalized / normalized with its mean and std) or the tiny TAEHV one
([`StreamingTinyWanDecoder`], [`StreamingTinyWanEncoder`], latents as they are)."""

from __future__ import annotations

from ...models.autoencoder_tiny_wan import AutoencoderTinyWan
from .streaming_decode import StreamingWanDecoder
from .streaming_encode import StreamingWanEncoder
from .streaming_tiny import StreamingTinyWanDecoder, StreamingTinyWanEncoder


def streaming_decoder(vae) -> StreamingWanDecoder | StreamingTinyWanDecoder:
    """A fresh streamed decoder for ``vae`` (an `AutoencoderKLWan` or an [`AutoencoderTinyWan`])."""
    return StreamingTinyWanDecoder(vae) if isinstance(vae, AutoencoderTinyWan) else StreamingWanDecoder(vae)


def streaming_encoder(vae) -> StreamingWanEncoder | StreamingTinyWanEncoder:
    """A fresh streamed encoder for ``vae`` (an `AutoencoderKLWan` or an [`AutoencoderTinyWan`])."""
    return StreamingTinyWanEncoder(vae) if isinstance(vae, AutoencoderTinyWan) else StreamingWanEncoder(vae)
