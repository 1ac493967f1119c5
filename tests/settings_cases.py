"""The configurations whose outputs `tests/test_settings_baseline.py` compares against a recording made before the
settings values were introduced (tests/data/settings_baseline/): every pipeline, policy, window, sink rule, storage
dtype, attention bias, stream and kept-rollout operation, on tiny random models, one thread.

Each case is ``name -> run(pipes) -> tensor`` (latents); ``pipes`` builds the tiny pipelines once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import PIL.Image
import torch

from fastgen_diffusers import (
    WanCausalImageToVideoPipeline,
    WanCausalVideoToVideoPipeline,
)
from fastgen_diffusers.testing import tiny_components, tiny_pipeline, tiny_transformer, tiny_vace_pipeline

THREADS = 1
T2V = {"prompt": "a red fox", "height": 32, "width": 32, "num_frames": 21, "max_sequence_length": 16}
T2V = {**T2V, "num_inference_steps": 2, "output_type": "latent"}
V2V = {key: value for key, value in T2V.items() if key not in ("height", "width", "num_frames")}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Pipes:
    """The tiny pipelines, built once (progress bars off)."""

    def __init__(self) -> None:
        self.t2v = tiny_pipeline()
        components = tiny_components()
        components["transformer"] = tiny_transformer(chunk_size=2, independent_first_frame=True)
        self.i2v = WanCausalImageToVideoPipeline(**components)
        self.vace = tiny_vace_pipeline()
        self.v2v = WanCausalVideoToVideoPipeline(**tiny_components())
        for pipe in (self.t2v, self.i2v, self.vace, self.v2v):
            pipe.set_progress_bar_config(disable=True)


def _image(size: int = 32, seed: int = 0) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _frames(count: int = 21) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(count)]


def t2v(**kwargs) -> Callable[[Pipes], torch.Tensor]:
    return lambda pipes: pipes.t2v(generator=_gen(), **{**T2V, **kwargs}).frames


def _stream(pipes: Pipes) -> torch.Tensor:
    return torch.cat([record.latents for record in pipes.t2v.stream(generator=_gen(), **T2V)], dim=2)


def _kept(operation: str) -> Callable[[Pipes], torch.Tensor]:
    def run(pipes: Pipes) -> torch.Tensor:
        pipe = pipes.t2v
        first = pipe(generator=_gen(), keep_cache=True, **{**T2V, "num_frames": 9}).frames
        try:
            if operation == "continue":
                more = pipe.continue_rollout(12, prompt="a blue whale", generator=_gen(1), output_type="latent")
            elif operation == "redo":
                more = pipe.redo_last_chunk(prompt="a blue whale", generator=_gen(2), output_type="latent")
            else:
                pipe.fork_rollout("b")
                more = pipe.continue_rollout(12, generator=_gen(3), output_type="latent", branch="b")
        finally:
            pipe.discard_rollout()
        return torch.cat([first, more.frames], dim=2)

    return run


CASES: dict[str, Callable[[Pipes], torch.Tensor]] = {
    "t2v_plain": t2v(),
    "t2v_timesteps": t2v(timesteps=[1000.0, 757.0, 522.0]),
    "t2v_first_chunk_timesteps": t2v(first_chunk_timesteps=[1000.0, 750.0, 500.0, 250.0]),
    "t2v_context_noise": t2v(context_noise=100.0),
    "t2v_guidance": t2v(guidance_scale=3.0, negative_prompt="blurry"),
    "t2v_window": t2v(attention_window=6, sink_frames=3),
    "t2v_window_vanilla": t2v(attention_window=6, sink_frames=3, kv_cache_engine="vanilla"),
    "t2v_window_rope": t2v(attention_window=9, sink_frames=3, rope_positions="window"),
    "t2v_ema_sink": t2v(attention_window=9, sink_frames=3, rope_positions="window", sink_update="ema", sink_decay=0.9),
    "t2v_int8": t2v(kv_cache_dtype="int8"),
    "t2v_float8": t2v(kv_cache_dtype=torch.float8_e4m3fn, attention_window=6, sink_frames=3),
    "t2v_bias": t2v(kv_cache_attention_bias=0.3),
    "t2v_bias_window": t2v(kv_cache_attention_bias=0.5, attention_window=6, sink_frames=3),
    "t2v_sequential": t2v(kv_cache_policy="sequential"),
    "t2v_recompute": t2v(kv_cache_policy="recompute", context_frames=3),
    "t2v_recompute_bias_anchor": t2v(
        kv_cache_policy="recompute", context_frames=4, kv_cache_attention_bias=0.3, keep_first_frame=True
    ),
    "t2v_rolling": t2v(kv_cache_policy="rolling", attention_window=9),
    "t2v_prompt_schedule_recache": t2v(prompt={0: "a red fox", 9: "a blue whale"}, recache=True),
    "t2v_prompt_transition": t2v(prompt={0: "a red fox", 9: "a blue whale"}, prompt_transition_chunks=2),
    "t2v_stream": _stream,
    "t2v_continue": _kept("continue"),
    "t2v_redo": _kept("redo"),
    "t2v_fork": _kept("fork"),
    "i2v": lambda pipes: pipes.i2v(image=_image(), generator=_gen(), **{**T2V, "num_frames": 13}).frames,
    "vace": lambda pipes: (
        pipes.vace(reference_images=PIL.Image.new("RGB", (32, 32), (200, 30, 30)), generator=_gen(), **T2V).frames
    ),
    "v2v": lambda pipes: pipes.v2v(video=_frames(), strength=0.5, generator=_gen(), **V2V).frames,
    "v2v_recompute": lambda pipes: (
        pipes.v2v(
            video=_frames(), strength=0.5, generator=_gen(), kv_cache_policy="recompute", context_frames=3, **V2V
        ).frames
    ),
}


def record_all() -> dict[str, torch.Tensor]:
    """Every case's output, run under ``THREADS`` threads."""
    torch.set_num_threads(THREADS)
    pipes = Pipes()
    return {name: run(pipes).contiguous() for name, run in CASES.items()}
