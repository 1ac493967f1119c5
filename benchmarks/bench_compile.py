"""Compiled rollouts: eager vs ``compile_repeated_blocks(fullgraph=True)`` for both engines, measured in one run.

Mid-size random model of ``bench_pipeline.py`` (4 layers, 4 heads x 32, ffn 256, 64 text tokens), 81 frames at
128x128 (21 latent frames x 64 tokens, 7 chunks of 3), 4 steps plus one cache pass per chunk, batch 1, float32. Per
engine (``static``, ``vanilla``) it prints:

* eager rollout time (median of ``--repeats``) and the compiled one, and their ratio;
* first-call time of the compiled rollout (compilation included) and the number of graphs dynamo compiled;
* recompiles after the first rollout (expected 0) and max |latents diff| against eager;
* with ``--whole-model``, the same for ``torch.compile(pipe.transformer)`` (static engine only; slower to compile).

It also prints the per-forward Python cost that the model removed: diffusers' ``ModelMixin.dtype`` (a walk over
every module) against the memoised ``transformer.dtype``, per forward and as a share of the eager rollout.

On a CPU, compiling buys little at this size (the target is "never slower than eager, bounded graphs"); timings on
a shared machine are noisy. Run: ``python benchmarks/bench_compile.py [--device cuda] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch._dynamo
from diffusers.models.modeling_utils import get_parameter_dtype
from torch._dynamo.utils import counters

from fastgen_diffusers import WanCausalPipeline
from fastgen_diffusers.testing import tiny_components, tiny_transformer

CONFIG = {"num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256, "num_layers": 4, "text_dim": 64}
HEIGHT = WIDTH = 128
NUM_FRAMES = 81
TEXT_TOKENS = 64
STEPS = 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout(pipe: WanCausalPipeline, embeds: torch.Tensor, engine: str) -> tuple[float, torch.Tensor]:
    device = embeds.device
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(
            prompt_embeds=embeds,
            height=HEIGHT,
            width=WIDTH,
            num_frames=NUM_FRAMES,
            num_inference_steps=STEPS,
            kv_cache_engine=engine,
            generator=torch.Generator(device).manual_seed(0),
            output_type="latent",
        ).frames
    sync(device)
    return time.perf_counter() - start, latents


def median_rollout(pipe, embeds, engine, repeats) -> tuple[float, torch.Tensor]:
    runs = [rollout(pipe, embeds, engine) for _ in range(repeats)]
    return statistics.median(seconds for seconds, _ in runs), runs[-1][1]


def compiled_row(label, pipe, embeds, engine, repeats, eager_seconds, eager_latents) -> None:
    torch._dynamo.reset()
    counters.clear()
    first, _ = rollout(pipe, embeds, engine)
    graphs = counters["stats"]["unique_graphs"]
    seconds, latents = median_rollout(pipe, embeds, engine, repeats)
    recompiles = counters["stats"]["unique_graphs"] - graphs
    diff = (latents - eager_latents).abs().max().item()
    print(
        f"{engine:>7} {label:<22} {seconds * 1e3:7.0f} ms ({eager_seconds / seconds:.2f}x eager) | first call "
        f"{first:5.1f} s | graphs {graphs}, new after the first rollout {recompiles} | graph breaks "
        f"{sum(counters['graph_break'].values())} | max |diff| {diff:.1e}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: a shared CPU thrashes with more)")
    parser.add_argument("--engines", default="static,vanilla")
    parser.add_argument("--whole-model", action="store_true", help="also torch.compile(pipe.transformer)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    components = tiny_components()
    components["transformer"] = tiny_transformer(**CONFIG)
    pipe = WanCausalPipeline(**components).to(device)
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, TEXT_TOKENS, CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)).to(device)
    print(
        f"config: {CONFIG['num_layers']} layers, {CONFIG['num_attention_heads']}x{CONFIG['attention_head_dim']} "
        f"heads, ffn {CONFIG['ffn_dim']} | {NUM_FRAMES} frames {HEIGHT}x{WIDTH} = 21 latent frames x 64 tokens, "
        f"7 chunks of 3, {STEPS} steps + cache pass | {device}, float32, {torch.get_num_threads()} threads | torch "
        f"{torch.__version__}",
        flush=True,
    )

    # The per-forward Python tax the model removed: ModelMixin.dtype walks every module.
    transformer = pipe.transformer
    calls = 1000
    start = time.perf_counter()
    for _ in range(calls):
        get_parameter_dtype(transformer)
    walk = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        transformer.dtype  # noqa: B018
    memo = (time.perf_counter() - start) / calls
    forwards = 7 * (STEPS + 1)

    for engine in args.engines.split(","):
        rollout(pipe, embeds, engine)  # warm-up
        eager_seconds, eager_latents = median_rollout(pipe, embeds, engine, args.repeats)
        if engine == args.engines.split(",")[0]:
            print(
                f"python tax: ModelMixin.dtype {walk * 1e6:.0f} us per forward ({forwards} forwards = "
                f"{walk * forwards * 1e3:.1f} ms, {walk * forwards / eager_seconds:.1%} of the eager rollout) vs "
                f"memoised transformer.dtype {memo * 1e6:.1f} us",
                flush=True,
            )
        print(f"{engine:>7} {'eager':<22} {eager_seconds * 1e3:7.0f} ms", flush=True)

        compiled = copy.copy(pipe)  # same components; the compiled transformer is a copy sharing nothing compiled
        compiled_transformer = copy.deepcopy(pipe.transformer)
        compiled_transformer.compile_repeated_blocks(fullgraph=True)
        compiled.register_modules(transformer=compiled_transformer)
        compiled_row("compile_repeated_blocks", compiled, embeds, engine, args.repeats, eager_seconds, eager_latents)
        if args.whole_model and engine == "static":
            compiled.register_modules(transformer=torch.compile(copy.deepcopy(pipe.transformer)))
            compiled_row("torch.compile(model)", compiled, embeds, engine, args.repeats, eager_seconds, eager_latents)


if __name__ == "__main__":
    main()
