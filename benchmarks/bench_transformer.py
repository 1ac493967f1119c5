"""Transformer-level costs of the causal model, measured side by side in one run.

Prints, on a mid-size config (4 layers, 4x32 heads, 16x16 latents = 64 tokens per frame, 21 latent frames,
512 text tokens of width 4096):

* single-chunk overhead of the causal model over stock diffusers on the same weights (goal <= 1.05x);
* the cached last chunk against recomputing the whole prefix (goal >= 5x at 21 frames, growing with frames);
* time saved per denoising step by cross K/V reuse;
* cache bytes against the formula 2 x layers x batch x heads x tokens x head_dim x bytes;
* per-call Python the model removed: ``ModelMixin.dtype`` per forward vs memoised, timestep embedding of a CFG pair.

Usage: ``python benchmarks/bench_transformer.py [--frames 21] [--repeats 7] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.modeling_utils import get_parameter_dtype

from fastgen_diffusers import WanCausalTransformer3DModel, expected_self_cache_bytes

CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 768,
    "num_layers": 4,
}


def paired_median_ms(fn_a, fn_b, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median wall time of ``fn_a`` and ``fn_b`` in ms, run alternately so that machine load hits both alike."""

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    fn_a(), fn_b()  # warm-up
    times_a, times_b = [], []
    for _ in range(repeats):
        times_a.append(timed(fn_a))
        times_b.append(timed(fn_b))
    return statistics.median(times_a), statistics.median(times_b)


def fill_cache(model, latents, prompt, chunk_size):
    model.clear_caches()
    for start in range(0, latents.shape[2], chunk_size):
        model(latents[:, :, start : start + chunk_size], torch.zeros(1), prompt, start_frame=start, store_kv=True)


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)

    stock = WanTransformer3DModel(**CONFIG).eval().to(device)
    causal = WanCausalTransformer3DModel(**CONFIG, chunk_size=3).eval().to(device)
    causal.load_state_dict(stock.state_dict())
    chunk = 3
    frames = args.frames - args.frames % chunk
    latents = torch.randn(1, 16, frames, 16, 16, device=device)
    prompt = torch.randn(1, 512, 4096, device=device)
    t = torch.full((1,), 937.5, device=device)
    heads = f"{CONFIG['num_attention_heads']}x{CONFIG['attention_head_dim']}"
    print(f"config: {CONFIG['num_layers']} layers, {heads} heads, latents 16x16 (64 tokens/frame), {frames} frames, "
          f"chunk {chunk}, text 512x4096, {torch.get_num_threads()} threads, {device}")  # fmt: skip

    # 1. One chunk, nothing cached (store_kv=False: the cross K/V are computed, as the stock model does).
    first = latents[:, :, :chunk]
    stock_ms, causal_ms = paired_median_ms(
        lambda: stock(first, t, prompt), lambda: causal(first, t, prompt), args.repeats, device
    )
    print(f"single chunk ({chunk} frames): stock {stock_ms:.2f} ms, causal {causal_ms:.2f} ms, "
          f"overhead {causal_ms / stock_ms:.3f}x (goal <= 1.05x)")  # fmt: skip

    # 2. Last chunk: cached prefix vs recomputing the whole video (one block-causal forward over every frame).
    fill_cache(causal, latents[:, :, : frames - chunk], prompt, chunk)
    last = latents[:, :, frames - chunk :]
    cached_ms, full_ms = paired_median_ms(
        lambda: causal(last, t, prompt, start_frame=frames - chunk),
        lambda: causal(latents, t, prompt, cache_tag="recompute"),
        args.repeats,
        device,
    )
    engine = causal.kv_cache_engines["main"]
    print(f"last chunk at frame {frames - chunk}: cached {cached_ms:.2f} ms, prefix recomputed {full_ms:.2f} ms, "
          f"speed-up {full_ms / cached_ms:.1f}x (goal >= 5x)")  # fmt: skip

    # 3. Cross K/V reuse: the same cached call with the cross entry read, and on a copy whose cross entry is dropped
    # (so every call recomputes it) while its self cache is the same.
    recomputing = copy.deepcopy(causal)
    recomputing.kv_cache_engines["main"].invalidate_cross("pos")
    reuse_ms, recompute_ms = paired_median_ms(
        lambda: causal(last, t, prompt, start_frame=frames - chunk),
        lambda: recomputing(last, t, prompt, start_frame=frames - chunk),
        args.repeats,
        device,
    )
    saved = recompute_ms - reuse_ms
    print(f"cross K/V reuse: {reuse_ms:.2f} ms per step vs {recompute_ms:.2f} ms recomputed, "
          f"saves {saved:.2f} ms per step ({saved / recompute_ms:.0%})")  # fmt: skip

    # 4. Cache bytes against the formula.
    fill_cache(causal, latents, prompt, chunk)
    measured = causal.kv_cache_bytes("pos")
    formula = expected_self_cache_bytes(
        CONFIG["num_layers"],
        1,
        CONFIG["num_attention_heads"],
        frames * 64,
        CONFIG["attention_head_dim"],
        torch.float32,
    )
    print(
        f"self K/V cache after {frames} frames: {measured} B, formula {formula} B, ratio {measured / formula:.3f}; "
        f"cross K/V {engine.cross_cache_bytes('pos')} B"
    )

    # 5. Per-call Python removed from the forward: diffusers' ModelMixin.dtype (a walk over every module, asked by the
    # pipelines once per forward) against the memoised transformer.dtype, and the timestep embedding that the second
    # forward of a CFG pair (same timestep tensor) reuses.
    calls = 200
    begin = time.perf_counter()
    for _ in range(calls):
        get_parameter_dtype(causal)
    walk_ms = (time.perf_counter() - begin) * 1e3 / calls
    begin = time.perf_counter()
    for _ in range(calls):
        causal.dtype  # noqa: B018
    memo_ms = (time.perf_counter() - begin) * 1e3 / calls
    print(f"per-call Python: ModelMixin.dtype {walk_ms * 1e3:.0f} us vs memoised {memo_ms * 1e3:.1f} us per forward "
          f"({(walk_ms - memo_ms) / cached_ms:.1%} of a cached step at this size)")  # fmt: skip

    def pair(same: bool):  # the two forwards of a CFG step embed the same timestep tensor
        first = t.clone()
        causal._timestep_embedding(first, 1, chunk, torch.float32)
        causal._timestep_embedding(first if same else first.clone(), 1, chunk, torch.float32)

    fresh_ms, reused_ms = paired_median_ms(lambda: pair(False), lambda: pair(True), args.repeats, device)
    print(f"CFG pair: timestep embeddings {fresh_ms:.3f} ms embedded twice, {reused_ms:.3f} ms with the second reused")


if __name__ == "__main__":
    main()
