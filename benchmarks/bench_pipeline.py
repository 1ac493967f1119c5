"""WanCausalPipeline rollout: per-chunk latency, KV cache vs prefix recompute, and memory vs the cache formula.

Mid-size random model (4 layers, 4 heads x 32, ffn 256, 64 text tokens of width 64), 81 frames at 128x128 pixels:
21 latent frames of 8x8 = 64 tokens, 7 chunks of 3, 4 steps per chunk plus one cache pass per chunk, batch 1,
float32. Everything is measured in this one run:

* latency of each chunk (time between two chunks yielded by ``pipe.rollout``), first and last chunk;
* the whole rollout against the same rollout with the cache disabled: every step re-runs the transformer on all
  frames so far (clean prefix at the context timestep, the chunk at t) with the block-causal mask, no cache; both give
  the same latents (checked);
* memory: the self-attention K/V bytes held at the end of a ``keep_cache=True`` rollout against
  ``expected_self_cache_bytes`` (2 x layers x batch x heads x tokens x head_dim x bytes), and the peak memory of the
  rollout (CUDA allocator peak on a GPU; on a CPU only the process peak RSS, a coarse bound).

Run: ``python benchmarks/bench_pipeline.py [--device cuda] [--repeats 3] [--threads 1]`` (under a minute on a CPU).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from fastgen_diffusers import WanCausalPipeline, expected_self_cache_bytes
from fastgen_diffusers.testing import tiny_components, tiny_transformer

CONFIG = {"num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256, "num_layers": 4, "text_dim": 64}
HEIGHT = WIDTH = 128  # 16x16 latents, 8x8 = 64 tokens per latent frame
NUM_FRAMES = 81  # 21 latent frames
TEXT_TOKENS = 64
STEPS = 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_rollout(pipe: WanCausalPipeline, latents, embeds, seed: int, keep_cache: bool = False):
    """Run ``pipe.rollout``; returns the clean latents ``(B, C, F, H, W)`` and the seconds each chunk took."""
    device = latents.device
    bounds = pipe.rollout_chunk_bounds(latents.shape[2])
    generator = torch.Generator(device).manual_seed(seed)
    chunk_seconds, chunks = [], []
    sync(device)
    start = time.perf_counter()
    for chunk in pipe.rollout(
        latents,
        embeds,
        chunk_bounds=bounds,
        schedule=pipe.rollout_schedule(STEPS),
        generator=generator,
        keep_cache=keep_cache,
    ):
        sync(device)
        now = time.perf_counter()
        chunk_seconds.append(now - start)
        start = now
        chunks.append(chunk.latents)
    return torch.cat(chunks, dim=2), chunk_seconds


def recompute_rollout(pipe: WanCausalPipeline, latents, embeds, seed: int):
    """The same rollout without a cache: each forward covers frames [0, end) and keeps the chunk's output."""
    transformer, scheduler, device = pipe.transformer, pipe.scheduler, latents.device
    generator = torch.Generator(device).manual_seed(seed)
    schedule = pipe.rollout_schedule(STEPS)
    clean = []
    for start, end in pipe.rollout_chunk_bounds(latents.shape[2]):
        x = latents[:, :, start:end]
        scheduler.set_timesteps(**schedule, device=device)
        scheduler.set_begin_index(0)
        for t in scheduler.timesteps:
            frames = torch.cat([*clean, x], dim=2)
            timestep = torch.zeros(frames.shape[0], frames.shape[2], device=device)  # prefix at context_noise = 0
            timestep[:, start:] = t
            transformer.clear_caches()
            flow = transformer(frames, timestep, embeds, return_dict=False)[0][:, :, start:]
            x = scheduler.step(flow.float(), t, x, generator=generator, return_dict=False)[0]
        clean.append(x)
    transformer.clear_caches()
    return torch.cat(clean, dim=2)


def timed(fn, repeats: int, device: torch.device) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: a shared CPU thrashes with more)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    components = tiny_components()
    components["transformer"] = tiny_transformer(**CONFIG)
    pipe = WanCausalPipeline(**components).to(device)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, TEXT_TOKENS, CONFIG["text_dim"], generator=generator).to(device)
    latents = torch.randn(1, 16, (NUM_FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8, generator=generator).to(device)
    num_latent_frames, tokens_per_frame = latents.shape[2], (HEIGHT // 16) * (WIDTH // 16)
    bounds = pipe.rollout_chunk_bounds(num_latent_frames)
    print(
        f"config: {CONFIG['num_layers']} layers, {CONFIG['num_attention_heads']}x{CONFIG['attention_head_dim']} "
        "heads, "
        f"ffn {CONFIG['ffn_dim']}, {TEXT_TOKENS} text tokens | {NUM_FRAMES} frames {HEIGHT}x{WIDTH} = "
        f"{num_latent_frames} latent frames x {tokens_per_frame} tokens, {len(bounds)} chunks of "
        f"{bounds[-1][1] - bounds[-1][0]}, {STEPS} steps | {device}, float32, {torch.get_num_threads()} threads"
    )

    cached_rollout(pipe, latents, embeds, seed=1)  # warm-up
    runs = [cached_rollout(pipe, latents, embeds, seed=1) for _ in range(args.repeats)]
    per_chunk = [statistics.median(run[1][i] for run in runs) for i in range(len(bounds))]
    cached_total = statistics.median(sum(run[1]) for run in runs)
    print(
        f"per-chunk latency (median of {args.repeats}): first {per_chunk[0] * 1e3:.1f} ms, last "
        f"{per_chunk[-1] * 1e3:.1f} ms (last/first {per_chunk[-1] / per_chunk[0]:.2f}); all: "
        + ", ".join(f"{s * 1e3:.0f}" for s in per_chunk)
        + " ms"
    )

    recompute_total, recomputed = timed(lambda: recompute_rollout(pipe, latents, embeds, seed=1), 1, device)
    max_diff = (recomputed - runs[0][0]).abs().max().item()
    print(
        f"rollout: KV cache {cached_total * 1e3:.0f} ms vs prefix recomputed (no cache) "
        f"{recompute_total * 1e3:.0f} ms "
        f"-> {recompute_total / cached_total:.2f}x faster with the cache; max |latents diff| {max_diff:.1e}"
    )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = 0
    cached_rollout(pipe, latents, embeds, seed=1, keep_cache=True)
    held = pipe.transformer.kv_cache_bytes()
    formula = expected_self_cache_bytes(
        CONFIG["num_layers"],
        1,
        CONFIG["num_attention_heads"],
        num_latent_frames * tokens_per_frame,
        CONFIG["attention_head_dim"],
        torch.float32,
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - baseline
        peak_label = "CUDA peak allocated during the rollout"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        peak_label = "process peak RSS (coarse: weights, tables, the recompute baseline's activations included)"
    pipe.transformer.clear_caches()
    print(
        f"memory: K/V held after a keep_cache rollout {held / 2**20:.2f} MiB vs formula {formula / 2**20:.2f} MiB "
        f"(2 x {CONFIG['num_layers']} layers x 1 x {CONFIG['num_attention_heads']} heads x "
        f"{num_latent_frames * tokens_per_frame} tokens x {CONFIG['attention_head_dim']} x 4 B; ratio "
        f"{held / formula:.3f}); {peak_label}: {peak / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
    main()
