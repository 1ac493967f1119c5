"""Live video-to-video inputs: frames cut into causal pixel chunks from a list or an iterator, checked before use."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from fastgen_diffusers.pipelines.video_io import video_source
from fastgen_diffusers.pipelines.video_io.video_source import VideoChunker, chunk_num_frames, frame_to_tensor


def _uint8_frames(num_frames: int, height: int = 16, width: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]


def _as(kind: str, frame: np.ndarray):
    if kind == "pil":
        return PIL.Image.fromarray(frame)
    if kind == "numpy-uint8":
        return frame
    if kind == "numpy-float":
        return frame.astype(np.float32) / 255.0
    if kind == "tensor-uint8":
        return torch.from_numpy(frame).permute(2, 0, 1)
    return torch.from_numpy(frame).permute(2, 0, 1).float() / 255.0


def _chunks(video, **kwargs) -> list[torch.Tensor]:
    return list(VideoChunker(video, **kwargs))


@pytest.fixture
def warnings_seen(monkeypatch):
    seen = []
    monkeypatch.setattr(video_source.logger, "warning", seen.append)
    return seen


def test_chunk_sizes_follow_the_vae():
    assert [chunk_num_frames(n, first=True) for n in (1, 2, 3)] == [1, 5, 9]
    assert [chunk_num_frames(n, first=False) for n in (1, 2, 3)] == [4, 8, 12]


@pytest.mark.parametrize("kind", ["pil", "numpy-uint8", "numpy-float", "tensor-uint8", "tensor-float"])
def test_every_frame_kind_gives_the_same_pixels(kind):
    frames = _uint8_frames(21)
    reference = _chunks(frames, chunk_latent_frames=3)
    chunks = _chunks([_as(kind, frame) for frame in frames], chunk_latent_frames=3)
    assert [c.shape for c in chunks] == [(1, 3, 9, 16, 32), (1, 3, 12, 16, 32)]
    assert all(torch.equal(a, b) for a, b in zip(chunks, reference))
    assert chunks[0].dtype == torch.float32 and chunks[0].min() >= -1 and chunks[0].max() <= 1
    torch.testing.assert_close(chunks[0][0, :, 0], torch.from_numpy(frames[0]).permute(2, 0, 1) / 127.5 - 1)


def test_iterator_gives_the_list_chunks_and_reads_lazily(warnings_seen):
    frames = _uint8_frames(33)
    pulled = []

    def webcam():
        for index, frame in enumerate(frames):
            pulled.append(index)
            yield frame

    chunker = VideoChunker(webcam(), chunk_latent_frames=2, first_chunk_latent_frames=3)
    assert chunker.num_chunks is None and chunker.height is None and pulled == []
    stream = iter(chunker)
    first = next(stream)
    assert first.shape[2] == 9 and len(pulled) == 9  # out before frame 9 exists
    assert (chunker.height, chunker.width) == (16, 32)
    chunks = [first, *stream]
    listed = VideoChunker(frames, chunk_latent_frames=2, first_chunk_latent_frames=3)
    assert listed.num_chunks == 4 and listed.latent_layout() == (3, 2, 2, 2) and listed.num_used_frames == 33
    assert len(chunks) == 4 and all(torch.equal(a, b) for a, b in zip(chunks, listed))
    assert chunker.dropped_frames == 0 and warnings_seen == []


@pytest.mark.parametrize("as_iterator", [False, True])
def test_video_ending_inside_a_chunk_finishes_the_chunks_it_can_and_says_so(as_iterator, warnings_seen):
    frames = _uint8_frames(9 + 12 + 7)
    chunker = VideoChunker(iter(frames) if as_iterator else frames, chunk_latent_frames=3)
    chunks = list(chunker)
    assert [c.shape[2] for c in chunks] == [9, 12]
    assert chunker.dropped_frames == 7 and chunker.num_chunks_read == 2
    assert len(warnings_seen) == 1 and "dropped the last 7 frames" in warnings_seen[0]
    if not as_iterator:
        assert chunker.num_chunks == 2 and chunker.num_used_frames == 21


def test_four_dimensional_arrays_are_videos():
    frames = _uint8_frames(9)
    reference = _chunks(frames, chunk_latent_frames=3)
    as_array = _chunks(np.stack(frames), chunk_latent_frames=3)
    as_tensor = _chunks(torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2), chunk_latent_frames=3)
    assert torch.equal(as_array[0], reference[0]) and torch.equal(as_tensor[0], reference[0])


def test_short_video_is_refused_before_any_chunk():
    frames = _uint8_frames(8)
    with pytest.raises(ValueError, match="`video` ended after 8 frames; its first chunk .* needs 9"):
        VideoChunker(frames, chunk_latent_frames=3)  # a list: at once
    chunker = VideoChunker(iter(frames), chunk_latent_frames=3)  # an iterator: when its first chunk is read
    with pytest.raises(ValueError, match="`video` ended after 8 frames"):
        next(iter(chunker))
    with pytest.raises(ValueError, match="`video` ended after 0 frames"):
        next(iter(VideoChunker(iter([]), chunk_latent_frames=1)))


def _rgba(frame):
    return PIL.Image.fromarray(frame).convert("RGBA")


@pytest.mark.parametrize(
    ("bad_frame", "message"),
    [
        (_rgba, "frame 3 of `video` is a 'RGBA' PIL image; expected 'RGB'"),
        (lambda f: PIL.Image.fromarray(f).convert("L"), "'L' PIL image"),
        (lambda f: f[:, :16], "frame 3 of `video` is 16x16 \\(HxW\\); the video is 16x32"),
        (lambda f: f[..., :1], "must be a \\(H, W, 3\\) ndarray"),
        (lambda f: torch.from_numpy(f), "must be a \\(3, H, W\\) Tensor"),
        (lambda f: f.astype(np.int64), "uint8 or floating point, got dtype int64"),
        (lambda f: f.astype(np.float32), "floating point values in \\[0, 1\\], got \\[0, 255\\]"),
        (lambda f: torch.from_numpy(f).permute(2, 0, 1).float() / 127.5 - 1, "pass `\\(frame \\+ 1\\) / 2`"),
        (lambda f: f.tolist(), "frame 3 of `video` must be one of RGB PIL images"),
        (lambda f: torch.empty(3, 16, 32, device="meta"), "frame 3 of `video` is a meta tensor"),
        (lambda f: (torch.from_numpy(f).permute(2, 0, 1) / 255.0).to_sparse(), "frame 3 .* torch.sparse_coo tensor"),
    ],
)
@pytest.mark.parametrize("as_iterator", [False, True])
def test_bad_frames_are_refused_naming_video_and_the_frame(bad_frame, message, as_iterator):
    frames = _uint8_frames(21)
    frames[3] = bad_frame(frames[3])
    if not as_iterator:
        with pytest.raises(ValueError, match=message):
            VideoChunker(frames, chunk_latent_frames=3)
        return
    with pytest.raises(ValueError, match=message):
        next(iter(VideoChunker(iter(frames), chunk_latent_frames=3)))


def test_bad_frame_late_in_a_stream_stops_before_its_chunk():
    frames = _uint8_frames(21)
    frames[15] = _rgba(frames[15])
    stream = iter(VideoChunker(iter(frames), chunk_latent_frames=3))
    assert next(stream).shape[2] == 9
    with pytest.raises(ValueError, match="frame 15 of `video`"):
        next(stream)


def test_an_iterator_reusing_one_buffer_gives_the_chunks_of_a_list_of_copies():
    """A camera reader yields one array that it overwrites with every frame: each frame is converted on arrival."""
    frames = _uint8_frames(21)

    def camera():
        buffer = np.empty_like(frames[0])
        for frame in frames:
            buffer[...] = frame
            yield buffer

    reused = _chunks(camera(), chunk_latent_frames=3)
    copies = _chunks([frame.copy() for frame in frames], chunk_latent_frames=3)
    assert len(reused) == len(copies) == 2
    for got, expected in zip(reused, copies):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("video", "kwargs", "message"),
    [
        (PIL.Image.new("RGB", (16, 16)), {}, "got a single Image"),
        (np.zeros((16, 16, 3), np.uint8), {}, "got a single ndarray of shape \\(16, 16, 3\\)"),
        (torch.zeros(3, 16, 16), {}, "got a single Tensor"),
        ("clip.mp4", {}, "`video` must be frames, not a path \\('clip.mp4'\\)"),
        (42, {}, "list or an iterator of frames, got int"),
        ([np.zeros((12, 16, 3), np.uint8)] * 9, {}, "12x16 \\(HxW\\); height and width must be multiples of 16"),
        ([np.zeros((16, 16, 3), np.uint8)] * 9, {"height": 32, "width": 32}, "is 16x16 \\(HxW\\); the video is 32x32"),
        ([np.zeros((16, 16, 3), np.uint8)] * 9, {"height": 24, "width": 32}, "`height` must be a positive multiple"),
        ([np.zeros((16, 16, 3), np.uint8)] * 9, {"height": 16}, "both `height` and `width`"),
        ([np.zeros((16, 16, 3), np.uint8)] * 9, {"chunk_latent_frames": 0}, "`chunk_latent_frames` must be"),
    ],
)
def test_bad_video_arguments_are_refused(video, kwargs, message):
    with pytest.raises(ValueError, match=message):
        VideoChunker(video, **{"chunk_latent_frames": 3, **kwargs})


def test_reading_the_first_chunk_ahead_checks_it_and_keeps_its_frames():
    frames = _uint8_frames(21)
    chunker = VideoChunker(iter(frames), chunk_latent_frames=3)
    chunker.read_first_chunk()
    assert (chunker.height, chunker.width) == (16, 32)
    assert all(torch.equal(a, b) for a, b in zip(chunker, _chunks(frames, chunk_latent_frames=3)))
    with pytest.raises(ValueError, match="`video` ended after 5 frames"):
        VideoChunker(iter(frames[:5]), chunk_latent_frames=3).read_first_chunk()
    with pytest.raises(ValueError, match="frame 2 of `video` is a 'RGBA'"):
        VideoChunker(iter(frames[:2] + [_rgba(frames[2])]), chunk_latent_frames=3).read_first_chunk()


def test_a_chunker_is_read_once():
    chunker = VideoChunker(_uint8_frames(9), chunk_latent_frames=3)
    list(chunker)
    with pytest.raises(RuntimeError, match="read once"):
        list(chunker)


def test_frame_to_tensor_maps_uint8_range_to_minus_one_one():
    frame = np.array([[[0, 255, 51]]], dtype=np.uint8)
    assert frame_to_tensor(frame).flatten().tolist() == pytest.approx([-1.0, 1.0, -0.6])
