"""Causal rollout under Ulysses context parallelism: per-chunk time and per-rank KV-cache bytes, 1 rank vs N ranks.

A mid-size random causal Wan (4 layers, 4x32 heads, 16x16 latents = 64 tokens per frame) runs the rollout protocol
(``--steps`` denoising forwards and one cache pass per chunk of 3 latent frames) and reports, per rank count, the
median time of a chunk, the self-attention cache bytes each rank holds at the end (against the cache formula divided
by the ranks) and the largest difference of the latents from the 1-rank run.

Usage:
* CPU (default): ``python benchmarks/bench_context_parallel.py [--frames 9] [--steps 4]`` runs 1 rank in this process,
  then forks 2 gloo ranks on 127.0.0.1. On CPU the point is correctness and memory, not speed. diffusers 0.42 cannot
  set up its device mesh without an accelerator; this harness works around that (see
  ``shared/notes/context_parallel.md``), which GPUs do not need.
* GPUs: ``torchrun --nproc_per_node=N benchmarks/bench_context_parallel.py`` (NCCL, one GPU per process) measures
  N ranks; run it with ``--nproc_per_node=1`` for the 1-rank row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig

from fastgen_diffusers import WanCausalTransformer3DModel, expected_self_cache_bytes

CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 256,
    "freq_dim": 256,
    "ffn_dim": 512,
    "num_layers": 4,
    "chunk_size": 3,
}
LATENT_HW = (16, 16)
TIMESTEPS = (1000.0, 937.5, 833.3, 625.0)


def rollout(model, args, device) -> tuple[list[float], torch.Tensor]:
    """The rollout protocol on fixed noise; returns per-chunk seconds and the clean latents ``(1, 16, F, H, W)``."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 16, args.frames, *LATENT_HW, generator=gen).to(device)
    text = torch.randn(1, 64, CONFIG["text_dim"], generator=gen).to(device)
    timesteps = TIMESTEPS[: args.steps]
    model.clear_caches()
    times, chunks = [], []
    with torch.no_grad():
        for start in range(0, args.frames, CONFIG["chunk_size"]):
            x = noise[:, :, start : start + CONFIG["chunk_size"]]
            if device.type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            for i, t in enumerate(timesteps):  # x0 = x - sigma * v, re-noised to the next sigma with the same noise
                sigma = t / 1000.0
                x0 = x - sigma * model(x, torch.tensor([t], device=device), text, start_frame=start)[0]
                nxt = timesteps[i + 1] / 1000.0 if i + 1 < len(timesteps) else 0.0
                x = (1 - nxt) * x0 + nxt * noise[:, :, start : start + CONFIG["chunk_size"]]
            model(x, torch.zeros(1, device=device), text, start_frame=start, store_kv=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
            chunks.append(x)
    return times, torch.cat(chunks, dim=2).cpu()


def measure(world: int, args, device) -> dict:
    """One rank's numbers (the process group, if any, is already initialized)."""
    torch.manual_seed(0)
    model = WanCausalTransformer3DModel(**CONFIG).eval().to(device)
    if world > 1:
        # CPU harness only: diffusers divides by the accelerator count when it builds the device mesh
        no_accelerator = mock.patch.object(torch.accelerator, "device_count", return_value=1)
        with no_accelerator if device.type == "cpu" else contextlib.nullcontext():
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    rollout(model, args, device)  # warm-up
    times, latents = rollout(model, args, device)
    return {"chunk_s": statistics.median(times), "cache_bytes": model.kv_cache_bytes(), "latents": latents}


def report(world: int, result: dict, reference: torch.Tensor | None, args) -> None:
    tokens = args.frames * (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2)
    formula = expected_self_cache_bytes(
        CONFIG["num_layers"], 1, CONFIG["num_attention_heads"], tokens, CONFIG["attention_head_dim"], torch.float32
    )
    diff = "-" if reference is None else f"{(result['latents'] - reference).abs().max().item():.1e}"
    print(
        f"{world:>5} | {result['chunk_s'] * 1e3:>12.1f} | {result['cache_bytes'] / 2**20:>15.3f} | "
        f"{formula / world / 2**20:>16.3f} | {diff:>13}"
    )


def header(args) -> None:
    print(
        f"causal Wan {CONFIG['num_layers']} layers, {CONFIG['num_attention_heads']}x{CONFIG['attention_head_dim']} "
        f"heads, latents {args.frames}x{LATENT_HW[0]}x{LATENT_HW[1]} (64 tokens/frame), chunks of "
        f"{CONFIG['chunk_size']}, {args.steps} steps + cache pass per chunk, {torch.get_num_threads()} thread(s)/rank"
    )
    print("ranks | chunk ms (med) | cache MiB/rank | formula/ranks MiB | max|dx| vs 1")


def forked_rank(rank: int, world: int, port: int, args, out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = measure(world, args, torch.device("cpu"))
        if rank == 0:
            torch.save(result, Path(out_dir) / "result.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=9, help="latent frames (multiple of 3)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk (at most 4)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:  # torchrun: one process per GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        world = dist.get_world_size()
        result = measure(world, args, device)
        if dist.get_rank() == 0:
            header(args)
            report(world, result, None, args)
        dist.destroy_process_group()
        return

    torch.set_num_threads(args.threads)
    header(args)
    single = measure(1, args, torch.device("cpu"))
    report(1, single, None, args)
    with tempfile.TemporaryDirectory() as out_dir, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.start_processes(forked_rank, args=(2, port, args, out_dir), nprocs=2, join=True, start_method="fork")
        report(2, torch.load(Path(out_dir) / "result.pt", weights_only=False), single["latents"], args)


if __name__ == "__main__":
    main()
