"""Ulysses context parallelism of causal rollouts on 2 CPU ranks (gloo), against the single-process rollout.

The ranks are started by the test itself (``torch.multiprocessing``, forked; gloo over 127.0.0.1). One spawn runs
every distributed scenario and saves what each rank saw; the tests compare it with the same work in this process.

Harness-only workaround (see ``shared/notes/context_parallel.md``): diffusers 0.42 places each rank on
``rank % torch.accelerator.device_count()``, a division by zero on a machine without an accelerator, so
``enable_parallelism`` runs with ``device_count`` patched to 1. GPUs need nothing of the kind.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from unittest import mock

import imageio
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.kv_cache import StaticKVCacheEngine
from fastgen_diffusers.parallel import setup_context_parallel
from fastgen_diffusers.processors import WanCausalAttnProcessor
from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG, tiny_pipeline, tiny_transformer

WORLD = 2
HEIGHT = WIDTH = 32  # 4x4 latents: 2x2 = 4 tokens per frame, 2 per rank
NUM_FRAMES = 21  # 6 latent frames: chunks [0, 3) and [3, 6)
STEPS = 4
PROMPT_SEED, NEG_SEED, NOISE_SEED = 1, 2, 3


def enable_ulysses(model, degree: int = WORLD) -> None:
    """``enable_parallelism`` with diffusers' CPU device-count division worked around (test harness only)."""
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))


def text(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, TINY_TRANSFORMER_CONFIG["text_dim"], generator=torch.Generator().manual_seed(seed))


def count_cross_projections(pipe) -> list[int]:
    """A live list of how often the cross-attention K projections ran (summed over blocks)."""
    calls = [0]
    for block in pipe.transformer.blocks:
        block.attn2.to_k.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def rollout(
    pipe, calls, guidance_scale: float = 1.0, output_type: str = "latent", num_frames: int = NUM_FRAMES, **options
):
    """One seeded rollout (``options``: more call arguments); returns the output, what the kept caches hold and the
    cross K projections it ran."""
    before = calls[0]
    out = pipe(
        prompt_embeds=text(PROMPT_SEED),
        negative_prompt_embeds=text(NEG_SEED) if guidance_scale > 1 else None,
        height=HEIGHT,
        width=WIDTH,
        num_frames=num_frames,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(NOISE_SEED),
        output_type=output_type,
        keep_cache=True,
        **options,
    ).frames
    transformer = pipe.transformer
    engine = transformer.kv_cache_engines["main"]
    tags = ("pos", "neg") if guidance_scale > 1 else ("pos",)
    result = {
        "out": out,
        "self_bytes": {tag: transformer.kv_cache_bytes(tag) for tag in tags},
        "cross_key": {tag: engine.get_cross_kv(0, tag).key.clone() for tag in tags},
        "cross_calls": calls[0] - before,
    }
    transformer.clear_caches()
    return result


def make_pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe, count_cross_projections(pipe)


def windowed_calls(model) -> list[torch.Tensor]:
    """A block-causal 6-frame forward stored in one call (masked path), then two chunks under a window and sink."""
    model.set_kv_cache_engines({"main": StaticKVCacheEngine(window_frames=4, sink_frames=1)})
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 16, 12, 4, 6, generator=gen)  # 2x3 = 6 tokens per frame
    ehs = text(PROMPT_SEED)
    outs = []
    with torch.no_grad():
        outs.append(model(latents[:, :, :6], torch.tensor([500.0]), ehs, store_kv=True, return_dict=False)[0])
        for start in (6, 9):
            chunk = latents[:, :, start : start + 3]
            outs.append(model(chunk, torch.tensor([750.0]), ehs, start_frame=start, return_dict=False)[0])
            model(chunk, torch.tensor([0.0]), ehs, start_frame=start, store_kv=True)
    outs.append(torch.tensor(model.kv_cache_bytes()))
    return outs


def write_input_video(path: Path) -> Path:
    """21 frames of 32x32 (6 latent frames: two chunks), a moving gradient."""
    ramp = np.linspace(0, 255, WIDTH, dtype=np.float32)
    frames = [
        np.stack([np.roll(ramp, 2 * k)[None].repeat(HEIGHT, 0)] * 3, axis=-1).astype(np.uint8) for k in range(21)
    ]
    imageio.mimwrite(path, frames, duration=125)
    return path


def run_cli_v2v(out_dir: str, rank: int | None) -> dict:
    """``generate --input-video ... [--context-parallel ulysses]`` through ``cli.main``, as under torchrun on CPU ranks
    (``rank=None``: one process, no flag): the launch check and the set-up are the harness's (gloo, no CUDA);
    returns its exit status and the frames it would write (``None`` when it writes none)."""
    from fastgen_diffusers.cli import app as cli
    from fastgen_diffusers.parallel import ContextParallelSetup

    argv = ["generate", "--prompt", "a fox", "--input-video", str(Path(out_dir) / "input.gif"), "--strength", "0.6"]
    argv += ["--steps", "2", "--output", str(Path(out_dir) / f"out{rank}.mp4")]
    if rank is not None:
        argv += ["--context-parallel", "ulysses"]
    written = []

    def setup(pipe, mode):
        assert mode == "ulysses"
        enable_ulysses(pipe.transformer)
        return ContextParallelSetup(rank, WORLD, torch.device("cpu"), rank == 0)

    with (
        mock.patch("fastgen_diffusers.cli.checks.check_context_parallel_launch"),
        mock.patch("fastgen_diffusers.parallel.setup_context_parallel", setup),
        mock.patch("diffusers.utils.export_to_video", lambda frames, path, fps: written.append(np.stack(frames))),
    ):
        status = cli.main(argv)
    return {"status": status, "frames": written[0] if written else None}


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        pipe, calls = make_pipe()
        enable_ulysses(pipe.transformer)
        results["t2v"] = rollout(pipe, calls)
        results["cfg"] = rollout(pipe, calls, guidance_scale=3.0)
        results["int8"] = rollout(pipe, calls, kv_cache_dtype="int8")  # per-head scales: each rank quantizes its own
        results["decoded"] = rollout(pipe, calls, output_type="np", num_frames=5)["out"]

        model = tiny_transformer()
        enable_ulysses(model)
        results["windowed"] = windowed_calls(model)
        results["cli_v2v"] = run_cli_v2v(out_dir, rank)

        # A frame of 3 tokens cannot be split across 2 ranks: raised before anything is cached.
        model.clear_caches()
        odd = torch.randn(1, 16, 3, 6, 2)
        try:
            model(odd, torch.tensor([1000.0]), text(PROMPT_SEED), start_frame=0, store_kv=True)
        except ValueError as error:
            results["odd_error"] = str(error)
        results["odd_cached_bytes"] = model.kv_cache_bytes()
        model.blocks[0].attn1.set_processor(WanCausalAttnProcessor())
        try:
            model(odd[:, :, :, :4, :4], torch.tensor([1000.0]), text(PROMPT_SEED))
        except RuntimeError as error:
            results["late_processor_error"] = str(error)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks saw (one spawn for every scenario)."""
    out_dir = tmp_path_factory.mktemp("cp")
    write_input_video(out_dir / "input.gif")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with mock.patch.dict(os.environ, env):
        # `torch.multiprocessing.spawn`'s machinery with fork: the ranks inherit this process's imports instead of
        # paying for torch + diffusers + transformers again (tens of seconds on a shared 2-core machine); no process
        # group exists in this process, and gloo ranks are forked the same way by torch's own distributed tests.
        mp.start_processes(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True, start_method="fork")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same work in one process."""
    pipe, calls = make_pipe()
    results = {"t2v": rollout(pipe, calls), "cfg": rollout(pipe, calls, guidance_scale=3.0)}
    results["int8"] = rollout(pipe, calls, kv_cache_dtype="int8")
    results["decoded"] = rollout(pipe, calls, output_type="np", num_frames=5)["out"]
    results["windowed"] = windowed_calls(tiny_transformer())
    input_dir = tmp_path_factory.mktemp("cp-single")
    write_input_video(input_dir / "input.gif")
    results["cli_v2v"] = run_cli_v2v(str(input_dir), None)
    return results


@pytest.mark.parametrize("scenario", ["t2v", "cfg", "int8"])
def test_ulysses_rollout_matches_single_process(ranks, single, scenario):
    """Every rank gets the single-process latents and holds half its cache, with an 8-bit cache too (its scales are per
    head: each rank quantizes its heads as one process does; `--kv-cache-dtype` with `--context-parallel`)."""
    expected = single[scenario]
    assert expected["out"].shape == (1, 16, 6, 4, 4)
    if scenario == "int8":  # 1 byte per element (plus scales) instead of 4
        assert expected["self_bytes"]["pos"] < single["t2v"]["self_bytes"]["pos"] / 3
    for rank in ranks:
        got = rank[scenario]
        assert (got["out"] - expected["out"]).abs().max().item() <= 1e-6
        # every rank caches its own heads of every frame: half the bytes of the single-process cache, per tag
        for tag, nbytes in expected["self_bytes"].items():
            assert nbytes > 0
            assert got["self_bytes"][tag] * WORLD == nbytes


@pytest.mark.parametrize("scenario", ["t2v", "cfg"])
def test_cross_cache_reused_on_every_rank(ranks, single, scenario):
    expected = single[scenario]
    forwards_per_tag = 2 * STEPS + 2  # 2 chunks x (4 steps + the cache pass)
    tags = len(expected["cross_key"])
    # the K projections run for the first chunk (its steps compute, its cache pass fills), then the cache is read
    assert expected["cross_calls"] == (STEPS + 1) * tags * TINY_TRANSFORMER_CONFIG["num_layers"]
    assert expected["cross_calls"] < forwards_per_tag * tags * TINY_TRANSFORMER_CONFIG["num_layers"]
    for rank in ranks:
        assert rank[scenario]["cross_calls"] == expected["cross_calls"]
        for tag, key in expected["cross_key"].items():
            torch.testing.assert_close(rank[scenario]["cross_key"][tag], key, rtol=0, atol=1e-6)


def test_masked_calls_static_engine_and_window_match(ranks, single):
    *outs, nbytes = single["windowed"]
    for rank in ranks:
        *got, got_bytes = rank["windowed"]
        for a, b in zip(got, outs):
            assert (a - b).abs().max().item() <= 1e-6
        assert got_bytes.item() * WORLD == nbytes.item() > 0


def test_only_rank_zero_decodes(ranks, single):
    assert ranks[0]["decoded"].shape == single["decoded"].shape == (1, 5, HEIGHT, WIDTH, 3)
    assert abs(ranks[0]["decoded"] - single["decoded"]).max() <= 1e-5
    assert isinstance(ranks[1]["decoded"], torch.Tensor) and ranks[1]["decoded"].shape == (1, 16, 2, 4, 4)


def test_cli_video_to_video_under_context_parallelism_writes_the_single_process_video(ranks, single):
    """``--input-video`` with ``--context-parallel``: every rank restyles the video, rank 0 writes what one process
    writes (the CLI as under torchrun; only the launch check and the GPU set-up are the harness's)."""
    expected = single["cli_v2v"]
    assert expected["status"] == 0 and expected["frames"].shape == (21, HEIGHT, WIDTH, 3)
    assert ranks[0]["cli_v2v"]["status"] == ranks[1]["cli_v2v"]["status"] == 0
    assert ranks[1]["cli_v2v"]["frames"] is None  # only the main process writes
    assert abs(ranks[0]["cli_v2v"]["frames"] - expected["frames"]).max() <= 1e-5  # measured: 0


def test_mis_sized_calls_raise_before_work(ranks):
    for rank in ranks:
        assert "3 tokens" in rank["odd_error"] and "2 ranks" in rank["odd_error"]
        assert rank["odd_cached_bytes"] == 0
        assert "set_default_attn_processor" in rank["late_processor_error"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (ContextParallelConfig(ulysses_degree=4), "4"),  # 2 heads
        (ContextParallelConfig(ring_degree=2), "Ring attention"),
        (ContextParallelConfig(ulysses_degree=2, ulysses_anything=True), "ulysses_anything"),
    ],
)
def test_unsupported_configurations_raise_before_set_up(config, match):
    model = WanCausalTransformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()
    with pytest.raises(ValueError, match=match):
        model.enable_parallelism(config=config)  # no process group needed: refused before diffusers' set-up
    assert model._parallel_config is None


def test_enable_parallelism_needs_the_causal_processors():
    model = WanCausalTransformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()
    model.set_attn_processor(WanAttnProcessor())
    with pytest.raises(ValueError, match="before the causal attention processors were installed"):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    assert model._parallel_config is None


def test_setup_refuses_ring_and_a_launch_without_torchrun():
    pipe, _ = make_pipe()
    with pytest.raises(ValueError, match="ulysses"):
        setup_context_parallel(pipe, "ring")
    with mock.patch.dict(os.environ, clear=True), pytest.raises(RuntimeError, match="torchrun"):
        setup_context_parallel(pipe, "ulysses")
    assert pipe.transformer._parallel_config is None
