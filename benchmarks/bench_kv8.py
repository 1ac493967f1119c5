"""8-bit vs 16/32-bit KV cache: cache bytes, time per chunk, and the output error over a long windowed rollout. All
numbers come from this one run.

    python benchmarks/bench_kv8.py [--threads 1] [--reps 5] [--error-chunks 50] [--tiny]

* bytes and time: a model with random weights (dim 128 = 4 heads x 32, ffn 256, 4 layers, 64 tokens per latent frame,
  chunks of 3 frames, window 21 with sink 3), float32 and bfloat16 compute; each cache dtype (the compute dtype, int8,
  float8_e4m3fn) on each engine, its window filled, then one chunk (4 denoising calls and the store) timed, best of
  ``--reps``, round-robin over the configurations. Bytes are :meth:`self_cache_bytes` (the formula: elements in the
  storage dtype plus, 8-bit, the float32 scales, split as data + scales). An 8-bit static engine takes the gathering
  path (its buffers cannot be read in place), so its time ratio against the float32 static engine is the cost of
  dequantizing plus the lost fast path.
* error: the tiny pipeline (``fastgen_diffusers.testing``), 32x32, ``--error-chunks`` chunks of 3 latent frames,
  window 9 with sink 3, the same seed: mean and max abs latent difference of each 8-bit cache against the float32
  cache (the README's numbers).

``--tiny`` runs the tiny model everywhere with few chunks (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import CHUNK, mid_transformer, run_chunk

from fastgen_diffusers import WanCausalTransformer3DModel, make_engines
from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG, tiny_pipeline

STORAGE = (None, "int8", "float8_e4m3fn")
KINDS = ("static", "vanilla")


def build_model(tiny: bool) -> WanCausalTransformer3DModel:
    if tiny:
        torch.manual_seed(0)
        return WanCausalTransformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()
    return mid_transformer()


@torch.no_grad()
def bytes_and_times(tiny: bool, reps: int) -> None:
    window, sink = (9, 3) if tiny else (21, 3)
    fill = window // CHUNK + 1  # chunks stored before the timed one: the window is full and sliding
    latent_size = 4 if tiny else 16
    base = build_model(tiny)
    text_dim = base.config.text_dim
    configs = {}
    for compute in (torch.float32, torch.bfloat16):
        cast = base if compute == torch.float32 else base.to(compute)  # diffusers warns once here: fine for timing
        latents = torch.randn(1, 16, CHUNK, latent_size, latent_size).to(compute)
        text = torch.randn(1, 16, text_dim).to(compute)
        for kind in KINDS:
            for storage in STORAGE:
                model = copy.deepcopy(cast)
                model.set_kv_cache_engines(
                    make_engines(
                        model, kind, window_frames=window, sink_frames=sink, max_frames=CHUNK * (fill + 1),
                        kv_cache_dtype=storage,
                    )
                )  # fmt: skip
                for index in range(fill):
                    model(latents, torch.zeros(1), text, start_frame=CHUNK * index, store_kv=True)
                configs[compute, kind, storage] = (model, latents, text)
    samples = {key: [] for key in configs}
    for _ in range(reps):
        for key, (model, latents, text) in configs.items():
            begin = time.perf_counter()
            run_chunk(model, latents, text, CHUNK * fill)
            samples[key].append(time.perf_counter() - begin)
            for engine in model.kv_cache_engines.values():
                engine.rewind("pos", CHUNK)
    fp32_bytes = configs[torch.float32, "static", None][0].kv_cache_engines["main"].self_cache_bytes("pos")
    print(
        f"model: {'tiny' if tiny else 'dim 128, 4 layers'}, {latent_size // 2 * latent_size // 2} tokens per frame, "
        f"window {window} (sink {sink}), chunk {fill + 1} of {CHUNK} frames; best of {reps}"
    )
    for (compute, kind, storage), (model, _, _) in configs.items():
        engine = model.kv_cache_engines["main"]
        total, scales = engine.self_cache_bytes("pos"), engine.self_cache_scale_bytes("pos")
        seconds = min(samples[compute, kind, storage])
        baseline = min(samples[compute, "static", None])
        name = str(storage or compute).removeprefix("torch.")
        compute_name = str(compute).removeprefix("torch.")
        print(
            f"[{kind} {name}] ({compute_name} compute) cache {total} bytes (scales {scales}), bytes ratio vs float32 "
            f"{total / fp32_bytes:.3f} (data {(total - scales) / fp32_bytes:.3f} + scales {scales / fp32_bytes:.4f}); "
            f"time per chunk {seconds * 1e3:.2f} ms (ratio vs static {compute_name} cache {seconds / baseline:.2f})"
        )


@torch.no_grad()
def rollout_error(chunks: int) -> None:
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def generate(storage):
        return pipe(
            "a fox",
            num_frames=4 * (CHUNK * chunks - 1) + 1,
            height=32,
            width=32,
            output_type="latent",
            attention_window=9,
            sink_frames=3,
            generator=torch.Generator().manual_seed(0),
            kv_cache_dtype=storage,
        ).frames

    reference = generate(None)
    for storage in STORAGE[1:]:
        error = (generate(storage) - reference).abs()
        print(
            f"[{storage}] error vs float32 cache, {chunks} chunks (window 9, sink 3), tiny pipeline: mean abs latent "
            f"diff {error.mean():.3g}, max {error.max():.3g} (latents' mean abs {reference.abs().mean():.3g})"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--error-chunks", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="tiny model, few chunks (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bytes_and_times(args.tiny, 1 if args.tiny else args.reps)
    rollout_error(5 if args.tiny else args.error_chunks)


if __name__ == "__main__":
    main()
