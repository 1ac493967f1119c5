"""Absolute vs window-relative RoPE (Reward Forcing): time per chunk and cache bytes, measured in one run.

    python benchmarks/bench_rope_window.py [--device cpu] [--dtype float32] [--chunks 12] [--tiny]

A chunk-by-chunk rollout of a random causal Wan transformer (4 denoising forwards and a cache pass per chunk of 3
latent frames, window 9, sink 3: Reward Forcing's cache) with each engine, once with absolute positions (keys cached
after RoPE) and once with ``rope_positions="window"`` + ``sink_update="ema"`` (keys cached before RoPE, every key
re-rotated at every read, the sink updated once per chunk). Prints the median time per chunk once the window has
filled, the ratio window / absolute, and the self-attention cache bytes held and allocated (the same for both:
window RoPE stores the same tensors, un-rotated). On CPU the time is the process's CPU time (``time.process_time``, so
that other work on a shared machine does not skew it; run with ``OMP_NUM_THREADS=1`` for one core); on CUDA wall time
after a synchronize.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastgen_diffusers import WanCausalTransformer3DModel, make_engines

STEPS = (1000.0, 937.5, 833.3, 625.0)
CHUNK, WINDOW, SINK = 3, 9, 3
MODES = {
    "absolute": {},
    "window+ema": {"rope_positions": "window", "sink_update": "ema", "sink_decay": 0.999},
}


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> WanCausalTransformer3DModel:
    """A random transformer: tiny (2 layers, 2 heads x 32) or a mid-size one (4 layers, 12 heads x 64)."""
    torch.manual_seed(0)
    heads, head_dim, layers = (2, 32, 2) if tiny else (12, 64, 4)
    config = dict(
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=2 * heads * head_dim,
        num_layers=layers,
        chunk_size=CHUNK,
    )
    model = WanCausalTransformer3DModel(**config).eval().to(device)
    return model if dtype == torch.float32 else model.to(dtype)


@torch.no_grad()
def rollout(model, kind: str, mode: str, latents, text, chunks: int, device) -> tuple[list[float], int, int]:
    """Seconds of every chunk, and the self-attention bytes held and allocated at the end."""
    model.set_kv_cache_engines(
        make_engines(model, kind, window_frames=WINDOW, sink_frames=SINK, max_frames=CHUNK * chunks, **MODES[mode])
    )
    seconds = []
    for chunk in range(chunks):
        start = CHUNK * chunk
        x = latents[:, :, start : start + CHUNK]
        clock = time.perf_counter if device.type == "cuda" else time.process_time
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = clock()
        for t in STEPS:
            model(x, torch.tensor([t], device=device), text, start_frame=start)
        model(x, torch.zeros(1, device=device), text, start_frame=start, store_kv=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(clock() - begin)
    engine = model.kv_cache_engines["main"]
    return seconds, engine.self_cache_bytes(), engine.allocated_self_cache_bytes()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--chunks", type=int, default=12, help="chunks of 3 latent frames (>= 5)")
    parser.add_argument("--size", type=int, default=16, help="latent height = width (tokens per frame: size^2 / 4)")
    parser.add_argument("--repeats", type=int, default=3, help="rollouts per engine and mode, interleaved")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_model(args.tiny, device, dtype)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, CHUNK * args.chunks, args.size, args.size, generator=gen).to(device, dtype)
    text = torch.randn(1, 16, 32, generator=gen).to(device, dtype)
    tokens = (args.size // 2) ** 2
    print(
        f"{model.config.num_layers} layers x {model.config.num_attention_heads} heads x "
        f"{model.config.attention_head_dim}, {tokens} tokens per frame, window {WINDOW} / sink {SINK}, "
        f"{args.chunks} chunks of {CHUNK} frames, {len(STEPS)} steps + cache pass, {device} {args.dtype}"
    )
    for kind in ("static", "vanilla"):
        seconds, bytes_held = {mode: [] for mode in MODES}, {}
        for mode in MODES:
            rollout(model, kind, mode, latents, text, 2, device)  # warm-up
        for _ in range(args.repeats):  # interleaved, so that a change of the machine's load hits every mode
            for mode in MODES:
                per_chunk, held, allocated = rollout(model, kind, mode, latents, text, args.chunks, device)
                seconds[mode] += per_chunk[WINDOW // CHUNK :]  # once the window has filled
                bytes_held[mode] = (held, allocated)
        medians = {mode: statistics.median(values) for mode, values in seconds.items()}
        for mode in MODES:
            held, allocated = bytes_held[mode]
            ratio = medians[mode] / medians["absolute"]
            print(
                f"[{kind}] {mode}: {medians[mode] * 1e3:.2f} ms per chunk (ratio {ratio:.3f}), cache held {held} B, "
                f"allocated {allocated} B"
            )


if __name__ == "__main__":
    main()
