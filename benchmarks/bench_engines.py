"""Static vs vanilla KV engine: time per chunk early and late in a rollout, with and without a sliding window, and
the cache memory of a long windowed rollout against a short one. All numbers come from this one run.

    python benchmarks/bench_engines.py [--threads 1] [--late-chunk 20] [--window-chunk 50] [--reps 5]
        [--latent-size 16]

Model: random weights, dim 128 (4 heads x 32), ffn 256, 4 layers, 64 text tokens, 64 tokens per latent frame, chunks
of 3 frames; a chunk is 4 denoising calls plus one cache store (the rollout protocol of the pipelines).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import CHUNK, mid_transformer, run_chunk

from fastgen_diffusers import make_engines

KINDS = ("static", "vanilla")


@torch.no_grad()
def chunk_times(
    model, measure_at: tuple[int, ...], reps: int, latent_size: int = 16, **window
) -> dict[str, dict[int, float]]:
    """Best-of-``reps`` seconds of chunk ``k`` (1-based) for each ``k`` in ``measure_at`` and each engine kind.

    Each kind rolls out once; at every ``k`` a snapshot (deep copy) of the model and its cache is taken. All snapshots
    are then timed round-robin, so that load or clock changes on the machine hit every figure alike (timing chunk 5
    early and chunk 50 minutes later would compare two machine states, not two cache states).
    """
    latents, text = torch.randn(1, 16, CHUNK, latent_size, latent_size), torch.randn(1, 64, 64)
    snapshots = {}
    for kind in KINDS:
        rolling = copy.deepcopy(model)
        rolling.set_kv_cache_engines(make_engines(rolling, kind, max_frames=CHUNK * max(measure_at), **window))
        for index in range(max(measure_at)):
            if index + 1 in measure_at:
                snapshots[kind, index + 1] = copy.deepcopy(rolling)
            rolling(latents, torch.zeros(1), text, start_frame=CHUNK * index, store_kv=True)
    samples = {key: [] for key in snapshots}
    for _ in range(reps):
        for (kind, k), snapshot in snapshots.items():
            begin = time.perf_counter()
            run_chunk(snapshot, latents, text, CHUNK * (k - 1))
            samples[kind, k].append(time.perf_counter() - begin)
            for engine in snapshot.kv_cache_engines.values():
                engine.rewind("pos", CHUNK)
    return {kind: {k: min(samples[kind, k]) for k in measure_at} for kind in KINDS}


@torch.no_grad()
def cache_bytes(model, kind: str, num_chunks: int, latent_size: int = 16, **window) -> tuple[int, int]:
    """``(held, allocated)`` self-attention cache bytes after ``num_chunks`` stored chunks."""
    model.set_kv_cache_engines(make_engines(model, kind, **window))
    latents, text = torch.randn(1, 16, CHUNK, latent_size, latent_size), torch.randn(1, 64, 64)
    for index in range(num_chunks):
        model(latents, torch.zeros(1), text, start_frame=CHUNK * index, store_kv=True)
    engine = model.kv_cache_engines["main"]
    return engine.self_cache_bytes(), engine.allocated_self_cache_bytes()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--late-chunk", type=int, default=20, help="chunk N of the unwindowed comparison")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--window-chunk", type=int, default=50, help="chunk N of the windowed comparison")
    parser.add_argument(
        "--latent-size", type=int, default=16, help="latent height = width (16: 64 tokens per frame, 32: 256)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = mid_transformer()
    window = {"window_frames": 12, "sink_frames": 3}
    tokens = (args.latent_size // 2) ** 2
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), best of {args.reps}; {tokens} tokens per latent frame; "
        "ms per chunk (5 calls)"
    )

    late, far = args.late_chunk, args.window_chunk
    rows = []
    for label, options, points in (("no window", {}, (5, late)), ("window 12, sink 3", window, (5, far))):
        times = chunk_times(model, points, args.reps, args.latent_size, **options)
        static, vanilla = times["static"], times["vanilla"]
        for point in points:
            rows.append((label, point, static[point], vanilla[point]))
        if options:
            print(
                f"[{label}] chunk {far} / chunk 5: static {static[far] / static[5]:.2f}x, "
                f"vanilla {vanilla[far] / vanilla[5]:.2f}x (goal <= 1.2x)"
            )
    print(f"{'config':<20}{'chunk':>6}{'static ms':>11}{'vanilla ms':>12}{'static/vanilla':>16}")
    for label, point, static_s, vanilla_s in rows:
        print(f"{label:<20}{point:>6}{1e3 * static_s:>11.2f}{1e3 * vanilla_s:>12.2f}{static_s / vanilla_s:>16.3f}")

    for kind in ("static", "vanilla"):
        held_5, alloc_5 = cache_bytes(model, kind, 5, args.latent_size, **window)
        held_far, alloc_far = cache_bytes(model, kind, far, args.latent_size, **window)
        print(
            f"[window 12, sink 3] {kind:<8} cache bytes held 5 chunks {held_5:,} / {far} chunks {held_far:,} "
            f"(x{held_far / held_5:.2f}); allocated {alloc_5:,} / {alloc_far:,}"
        )


if __name__ == "__main__":
    main()
