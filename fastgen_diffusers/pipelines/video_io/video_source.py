"""Pixel chunks of a video that is given whole or arrives frame by frame (a webcam), for live video-to-video.

A causal Wan student generates a video chunk after chunk; video-to-video encodes the matching input frames chunk
after chunk ([`StreamingWanEncoder`]). For a chunk of ``n`` latent frames that is ``1 + 4(n - 1)`` pixel frames for
the first chunk of the video and ``4n`` for every later one (4 being the VAE's temporal factor). [`VideoChunker`] cuts
a list of frames, or an iterator that yields frames as they arrive, into those chunks, checking every frame (type,
colour mode, size, value range) before the frames reach any model: a list is checked whole when the chunker is made,
an iterator frame by frame as each arrives, when it is also converted (a camera reader may overwrite one buffer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import PIL.Image
import torch
from diffusers.utils import logging

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

Frame = PIL.Image.Image | np.ndarray | torch.Tensor
FRAME_KINDS = (
    "RGB PIL images, (H, W, 3) numpy arrays or (3, H, W) tensors (uint8 in [0, 255] or floating point in [0, 1])"
)


def chunk_num_frames(num_latent_frames: int, first: bool, temporal_factor: int = 4) -> int:
    """Pixel frames that encode to ``num_latent_frames`` latent frames: ``1 + 4(n - 1)`` for the first chunk of a
    video, ``4n`` after it."""
    return temporal_factor * num_latent_frames - (temporal_factor - 1 if first else 0)


def _frame_size(frame: Frame) -> tuple[int, int]:
    """``(height, width)`` of a frame whose layout was checked."""
    if isinstance(frame, PIL.Image.Image):
        return frame.height, frame.width
    if isinstance(frame, np.ndarray):
        return frame.shape[0], frame.shape[1]
    return frame.shape[1], frame.shape[2]


def check_frame(frame: Frame, index: int, size: tuple[int, int] | None = None) -> tuple[int, int]:
    """Check one frame of ``video`` and return its ``(height, width)``.

    Raises:
        ValueError: naming ``video`` and the frame's index, when the frame is not one of ``FRAME_KINDS`` (type,
            colour mode, layout, dtype), has values outside its range, or is not ``size`` (when given).
    """
    where = f"frame {index} of `video`"
    if isinstance(frame, PIL.Image.Image):
        if frame.mode != "RGB":
            raise ValueError(f"{where} is a {frame.mode!r} PIL image; expected 'RGB' (use `image.convert('RGB')`).")
    elif isinstance(frame, (np.ndarray, torch.Tensor)):
        is_numpy = isinstance(frame, np.ndarray)
        if not is_numpy and (frame.layout != torch.strided or frame.is_meta):
            kind = "meta tensor" if frame.is_meta else f"{frame.layout} tensor"
            raise ValueError(
                f"{where} is a {kind}; frames must hold their values (a dense tensor on the CPU or a GPU, e.g. "
                "`frame.to_dense()`)."
            )
        layout_ok = frame.ndim == 3 and (frame.shape[2] == 3 if is_numpy else frame.shape[0] == 3)
        if not layout_ok:
            layout = "(H, W, 3)" if is_numpy else "(3, H, W)"
            raise ValueError(f"{where} must be a {layout} {type(frame).__name__}, got shape {tuple(frame.shape)}.")
        is_uint8 = frame.dtype == (np.uint8 if is_numpy else torch.uint8)
        is_float = np.issubdtype(frame.dtype, np.floating) if is_numpy else frame.is_floating_point()
        if not (is_uint8 or is_float):
            raise ValueError(f"{where} must be uint8 or floating point, got dtype {frame.dtype}.")
        num_values = frame.size if is_numpy else frame.numel()
        if is_float and num_values:
            low, high = float(frame.min()), float(frame.max())
            if not (0.0 <= low and high <= 1.0):
                raise ValueError(
                    f"{where} must hold floating point values in [0, 1], got [{low:.3g}, {high:.3g}] "
                    "(for [-1, 1] frames pass `(frame + 1) / 2`)."
                )
    else:
        raise ValueError(f"{where} must be one of {FRAME_KINDS}; got {type(frame).__name__}.")
    frame_size = _frame_size(frame)
    if size is not None and frame_size != size:
        raise ValueError(f"{where} is {frame_size[0]}x{frame_size[1]} (HxW); the video is {size[0]}x{size[1]}.")
    return frame_size


def frame_to_tensor(frame: Frame) -> torch.Tensor:
    """``(3, H, W)`` float32 pixels in [-1, 1] of a checked frame (see [`check_frame`])."""
    if isinstance(frame, (PIL.Image.Image, np.ndarray)):
        frame = torch.from_numpy(np.array(frame)).permute(2, 0, 1)  # a copy: PIL's and read-only arrays are shared
    if frame.dtype == torch.uint8:
        frame = frame.float() / 255.0
    return frame.float() * 2.0 - 1.0


class VideoChunker:
    r"""Cut ``video`` into the pixel chunks of a causal rollout, from a list of frames or from an iterator.

    Chunk ``i`` holds the pixel frames of ``latent_frames[i]`` latent frames (``1 + 4(n - 1)`` for the first chunk,
    ``4n`` after it). A list is checked whole when the chunker is made; an iterator is read lazily, one chunk at a
    time, as its frames arrive (so a webcam's first chunk is out before its later frames exist). A video that ends
    inside a chunk gives the chunks it completes: the frames of the unfinished chunk are dropped, counted in
    [`dropped_frames`] and reported with a warning.

    Args:
        video: a sequence of frames, or an iterable yielding them (a generator, a webcam reader); also a
            ``(F, H, W, 3)`` numpy array or ``(F, 3, H, W)`` tensor. Frames are RGB PIL images, ``(H, W, 3)`` numpy
            arrays or ``(3, H, W)`` tensors, uint8 in [0, 255] or floating point in [0, 1] (diffusers' conventions).
        chunk_latent_frames: latent frames per chunk after the first.
        first_chunk_latent_frames: latent frames of the first chunk (default: ``chunk_latent_frames``).
        height, width: the frame size every frame must have (default: the first frame's).
        size_multiple: height and width must be multiples of it (the VAE's spatial factor times the transformer's
            patch size: 16 for Wan2.1, 32 for Wan2.2 TI2V).
        temporal_factor: pixel frames per latent frame after the first (the VAE's, 4 for Wan).

    Raises:
        ValueError: naming ``video``, for a single frame passed as the video, a bad frame, or (for a list at once,
            for an iterator when its first chunk is read) a video shorter than the first chunk.

    Examples:
        ```python
        >>> chunker = VideoChunker(webcam_frames(), chunk_latent_frames=3)  # any iterator of frames
        >>> for pixels in chunker:  # (1, 3, 9, H, W) first, then (1, 3, 12, H, W) ...
        ...     latents = encoder.encode(pixels)
        ```
    """

    def __init__(
        self,
        video: Iterable[Frame] | np.ndarray | torch.Tensor,
        chunk_latent_frames: int,
        first_chunk_latent_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        size_multiple: int = 16,
        temporal_factor: int = 4,
    ):
        first_chunk_latent_frames = (
            chunk_latent_frames if first_chunk_latent_frames is None else first_chunk_latent_frames
        )
        for name, value in (
            ("chunk_latent_frames", chunk_latent_frames),
            ("first_chunk_latent_frames", first_chunk_latent_frames),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive number of latent frames, got {value!r}.")
        if (height is None) != (width is None):
            raise ValueError(f"Pass both `height` and `width` or neither, got height={height}, width={width}.")
        for name, value in (("height", height), ("width", width)):
            if value is not None and (not isinstance(value, int) or value <= 0 or value % size_multiple):
                raise ValueError(f"`{name}` must be a positive multiple of {size_multiple}, got {value!r}.")
        if isinstance(video, (str, bytes)):
            raise ValueError(
                f"`video` must be frames, not a path ({video!r}): load them first, e.g. with "
                "`diffusers.utils.load_video`."
            )
        if isinstance(video, PIL.Image.Image) or (isinstance(video, (np.ndarray, torch.Tensor)) and video.ndim != 4):
            shape = f" of shape {tuple(video.shape)}" if hasattr(video, "shape") else ""
            raise ValueError(
                "`video` must be a list or an iterator of frames (or a 4-D array of frames), got a single "
                f"{type(video).__name__}{shape}."
            )
        if not isinstance(video, Iterable):
            raise ValueError(f"`video` must be a list or an iterator of frames, got {type(video).__name__}.")
        self.chunk_latent_frames = chunk_latent_frames
        self.first_chunk_latent_frames = first_chunk_latent_frames
        self.size_multiple = size_multiple
        self.temporal_factor = temporal_factor
        self._expected_size = None if height is None else (height, width)
        self.dropped_frames = 0
        self.num_chunks_read = 0
        self._is_sequence = isinstance(video, (Sequence, np.ndarray, torch.Tensor))
        self._frames: Iterator[Frame] = iter(video)
        self._next_index = 0
        self._num_frames = len(video) if self._is_sequence else None
        self._started = False
        self._first_chunk: list[torch.Tensor] | None = None  # read ahead by `read_first_chunk`
        if self._is_sequence:
            for index, frame in enumerate(video):
                self._check(frame, index)
            self._check_enough_frames(len(video))

    # ------------------------------------------------------------------ layout
    def chunk_num_frames(self, chunk_index: int) -> int:
        """Pixel frames of chunk ``chunk_index``."""
        if chunk_index == 0:
            return chunk_num_frames(self.first_chunk_latent_frames, True, self.temporal_factor)
        return chunk_num_frames(self.chunk_latent_frames, False, self.temporal_factor)

    @property
    def num_chunks(self) -> int | None:
        """Chunks a list of frames gives (``None`` for an iterator: unknown until it ends)."""
        if self._num_frames is None:
            return None
        rest = self._num_frames - self.chunk_num_frames(0)
        return 1 + rest // self.chunk_num_frames(1)

    @property
    def num_used_frames(self) -> int | None:
        """Pixel frames the chunks of a list hold (``None`` for an iterator)."""
        num_chunks = self.num_chunks
        if num_chunks is None:
            return None
        return self.chunk_num_frames(0) + (num_chunks - 1) * self.chunk_num_frames(1)

    def latent_layout(self) -> tuple[int, ...] | None:
        """Latent frames of every chunk of a list (``None`` for an iterator)."""
        num_chunks = self.num_chunks
        if num_chunks is None:
            return None
        return (self.first_chunk_latent_frames,) + (self.chunk_latent_frames,) * (num_chunks - 1)

    # ------------------------------------------------------------------ checks
    def _check(self, frame: Frame, index: int) -> None:
        size = check_frame(frame, index, self._expected_size)
        if self._expected_size is None:
            height, width = size
            if height % self.size_multiple or width % self.size_multiple:
                raise ValueError(
                    f"frame {index} of `video` is {height}x{width} (HxW); height and width must be multiples of "
                    f"{self.size_multiple} (resize the frames, e.g. with `VideoProcessor.preprocess_video`)."
                )
            self._expected_size = size

    def _check_enough_frames(self, num_frames: int) -> None:
        needed = self.chunk_num_frames(0)
        if num_frames < needed:
            raise ValueError(
                f"`video` ended after {num_frames} frames; its first chunk ({self.first_chunk_latent_frames} latent "
                f"frames) needs {needed} (1 + {self.temporal_factor} x {self.first_chunk_latent_frames - 1})."
            )

    @property
    def height(self) -> int | None:
        """Frame height (known once the first frame is checked)."""
        return None if self._expected_size is None else self._expected_size[0]

    @property
    def width(self) -> int | None:
        """Frame width (known once the first frame is checked)."""
        return None if self._expected_size is None else self._expected_size[1]

    # ------------------------------------------------------------------ reading
    def _read(self, count: int) -> list[torch.Tensor]:
        """Up to ``count`` next frames, each checked (an iterator's frames as they arrive) and converted at once: a
        camera reader may yield one buffer that it overwrites with every frame."""
        frames = []
        for frame in self._frames:
            if not self._is_sequence:
                self._check(frame, self._next_index)
            frames.append(frame_to_tensor(frame))
            self._next_index += 1
            if len(frames) == count:
                break
        return frames

    def read_first_chunk(self) -> None:
        """Read and check the frames of the first chunk now (waiting for an iterator's frames), so that a bad or too
        short video is refused before any model work; the frame size is known afterwards. Iterating the chunker then
        starts with these frames. A list was checked whole already."""
        if self._first_chunk is not None or self._started:
            return
        self._first_chunk = self._read(self.chunk_num_frames(0))
        self._check_enough_frames(len(self._first_chunk))

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Yield ``(1, 3, f, H, W)`` float32 pixel chunks in [-1, 1], ``f`` from [`chunk_num_frames`]."""
        if self._started:
            raise RuntimeError("A VideoChunker is read once; make a new one for another pass over `video`.")
        self._started = True
        chunk_index = 0
        while True:
            count = self.chunk_num_frames(chunk_index)
            if chunk_index == 0 and self._first_chunk is not None:
                frames, self._first_chunk = self._first_chunk, None
            else:
                frames = self._read(count)
            if len(frames) < count:
                if chunk_index == 0:
                    self._check_enough_frames(len(frames))
                self._report_dropped(len(frames))
                return
            self.num_chunks_read += 1
            yield torch.stack(frames, dim=1)[None]
            chunk_index += 1

    def _report_dropped(self, count: int) -> None:
        self.dropped_frames = count
        if count:
            logger.warning(
                f"`video` ended inside chunk {self.num_chunks_read} ({self._next_index} frames in all): generated "
                f"{self.num_chunks_read} chunks and dropped the last {count} frames, which do not fill a chunk of "
                f"{self.chunk_num_frames(self.num_chunks_read)} frames."
            )
