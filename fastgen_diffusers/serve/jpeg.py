"""Frames to and from JPEG (the wire format of the session server), with PIL."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """``(F, H, W, 3)`` float frames in [0, 1] (a pipeline's ``output_type="np"``) as uint8, rounded as
    ``stream_to_video`` writes them."""
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_jpeg(frame: np.ndarray, quality: int = 80) -> bytes:
    """One ``(H, W, 3)`` uint8 frame as JPEG bytes."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(frame, mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def encode_frames(frames: np.ndarray, encoding: str, quality: int = 80) -> list[bytes]:
    """``(F, H, W, 3)`` uint8 frames as the binary messages of a chunk: JPEG (``encoding="jpeg"``) or raw RGB bytes
    (``"raw"``)."""
    if encoding == "jpeg":
        return [encode_jpeg(frame, quality) for frame in frames]
    return [frame.tobytes() for frame in frames]


def decode_jpeg(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """JPEG bytes as an ``(H, W, 3)`` uint8 RGB frame of ``size`` ``(height, width)``.

    Raises:
        ValueError: the bytes are not a decodable image, or the image is not ``size``.
    """
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG":
                raise ValueError(f"a {image.format} image")
            frame = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise ValueError(f"A video frame must be a JPEG image; this one does not decode ({error}).") from None
    if frame.shape[:2] != tuple(size):
        raise ValueError(
            f"A video frame must be {size[1]}x{size[0]} (the session's width x height), got "
            f"{frame.shape[1]}x{frame.shape[0]}."
        )
    return frame
