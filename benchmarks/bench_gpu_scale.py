"""The causal rollout at real scale: Wan2.1-1.3B shapes with random weights, bf16, 480x832, 81 frames.

Prepared for a session that is lent a GPU: one script, one run, the figures for a closing note.

* frames per second of the transformer rollout (7 chunks x (4 denoising steps + 1 cache pass); the text encoder and
  the VAE are not the causal part and are left out), time to the first chunk, time per chunk;
* peak memory against weights + the cache formula 2 x layers x batch x heads x tokens x head_dim x bytes;
* static vs vanilla engine;
* the CUDA-only path checked against the one the CPU tests cover: a multi-chunk call with the FlexAttention block
  mask vs the SDPA boolean mask;
* ``--compile``: the static-engine rollout with ``compile_repeated_blocks(fullgraph=True)`` against eager (frames/s,
  max abs diff, first-call time, graph count); ``--cuda-graphs``: the same with ``mode="reduce-overhead"``.

Every section runs in its own ``try``: a failure prints one line and the script goes on. Prints are flushed.

Usage: ``python benchmarks/bench_gpu_scale.py --compile --cuda-graphs`` on a GPU (a few minutes on an H200, most of
it compiling); ``python benchmarks/bench_gpu_scale.py --tiny --device cpu`` is a seconds-long smoke test of the
script itself.
"""

from __future__ import annotations

import argparse
import time

import torch

from fastgen_diffusers import WanCausalTransformer3DModel, expected_self_cache_bytes, make_engines

WAN_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
}
TINY = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "num_layers": 2}
STEPS = (1000.0, 937.5, 833.3, 625.0)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def rollout(model, latents, prompt, chunk: int, device, mark_steps: bool = False):
    """Seconds of each chunk of a cached rollout (every chunk pays its steps and its cache pass) and the last
    denoising output of every chunk, concatenated over frames.

    ``mark_steps``: tell CUDA graph trees where each forward begins (``mode="reduce-overhead"``).
    """
    model.clear_caches()
    batch = latents.shape[0]
    times, outputs = [], []
    for start in range(0, latents.shape[2], chunk):
        synchronize(device)
        begin = time.perf_counter()
        x = latents[:, :, start : start + chunk]
        for t in (*STEPS, 0.0):
            if mark_steps:
                torch.compiler.cudagraph_mark_step_begin()
            out = model(x, torch.full((batch,), t, device=device), prompt, start_frame=start, store_kv=t == 0.0)
            if t == STEPS[-1]:
                outputs.append(out.sample.clone())
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return times, torch.cat(outputs, dim=2)


def section(name: str, fn, *args) -> None:
    """Run one section; a failure is one line and the script goes on."""
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001  (a benchmark reports and continues)
        message = " ".join(str(error).split())[:300]
        print(f"[{name}] FAILED: {type(error).__name__}: {message}", flush=True)


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--num-frames", type=int, default=81, help="pixel frames, 4k+1")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at 32x32 (smoke test of this script)")
    parser.add_argument("--compile", action="store_true", help="row: compile_repeated_blocks(fullgraph=True) vs eager")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help='row: compiled with mode="reduce-overhead" (CUDA graphs) vs eager'
    )
    parser.add_argument("--skip-compile", action="store_true", help="no compiled rows (overrides the two above)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = TINY if args.tiny else WAN_1_3B
    height, width = (32, 32) if args.tiny else (args.height, args.width)
    latent_frames = (args.num_frames - 1) // 4 + 1
    chunk = 3
    script_start = time.perf_counter()

    torch.manual_seed(0)
    with torch.device(device):
        model = WanCausalTransformer3DModel(**config, chunk_size=chunk).to(dtype).eval()
    tokens_per_frame = (height // 16) * (width // 16)
    latents = torch.randn(1, 16, latent_frames, height // 8, width // 8, device=device, dtype=dtype)
    prompt = torch.randn(1, 512, config["text_dim"], device=device, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{config['num_layers']} layers, {config['num_attention_heads']}x{config['attention_head_dim']} heads, "
        f"{weights / 2**30:.2f} GiB weights ({args.dtype}); {args.num_frames} frames at {width}x{height} = "
        f"{latent_frames} latent frames x {tokens_per_frame} tokens; chunks of {chunk}; {device}; torch "
        f"{torch.__version__}",
        flush=True,
    )
    formula = expected_self_cache_bytes(
        config["num_layers"], 1, config["num_attention_heads"], latent_frames * tokens_per_frame,
        config["attention_head_dim"], dtype,
    )  # fmt: skip
    eager = {}

    # 1. Rollout speed and memory, per engine.
    def eager_rollout(kind: str) -> None:
        model.set_kv_cache_engines(make_engines(model, kind, max_frames=latent_frames))
        rollout(model, latents[:, :, : 2 * chunk], prompt, chunk, device)  # warm-up (kernels, allocator)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, outputs = rollout(model, latents, prompt, chunk, device)
        total = sum(times)
        eager[kind] = (total, outputs)
        held = model.kv_cache_bytes()
        line = (
            f"[{kind}] rollout {total:.2f} s = {args.num_frames / total:.1f} frames/s; first chunk {times[0]:.3f} s, "
            f"last {times[-1]:.3f} s; K/V cache {held / 2**30:.3f} GiB vs formula {formula / 2**30:.3f} GiB "
            f"(ratio {held / formula:.3f})"
        )
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            line += f"; peak {peak / 2**30:.2f} GiB = weights + cache + {(peak - weights - held) / 2**30:.2f} GiB"
        print(line, flush=True)

    for kind in ("static", "vanilla"):
        section(kind, eager_rollout, kind)

    # 2. Block-causal multi-chunk call: FlexAttention BlockMask vs SDPA boolean mask (2 chunks, no prefix).
    def flex_vs_sdpa() -> None:
        model.set_kv_cache_engines(make_engines(model, "vanilla"))
        two_chunks = latents[:, :, : 2 * chunk]
        timestep = torch.full((1,), 500.0, device=device)
        outputs = {}
        for backend in ("sdpa", "flex"):
            model.clear_caches()
            model.set_block_mask_backend(backend)
            outputs[backend] = model(two_chunks, timestep, prompt, return_dict=False)[0].float()
        model.set_block_mask_backend("auto")
        diff = (outputs["flex"] - outputs["sdpa"]).abs().max().item()
        print(
            f"flex vs sdpa block mask: max abs diff {diff:.3e} (|out| max {outputs['sdpa'].abs().max().item():.2f})",
            flush=True,
        )

    section("flex vs sdpa", flex_vs_sdpa)

    # 3./4. Compiled rollouts (static engine): the repeated block compiled with fullgraph=True, then CUDA graphs.
    def compiled_rollout(label: str, mode: str | None) -> None:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        if mode == "reduce-overhead":  # one recording per block and graph: 30 blocks x 3 graphs at 1.3B scale
            import torch._inductor.config

            torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit = 1024
        model.compile_repeated_blocks(fullgraph=True, mode=mode)
        model.set_kv_cache_engines(make_engines(model, "static", max_frames=latent_frames))
        mark_steps = mode == "reduce-overhead" and device.type == "cuda"
        synchronize(device)
        begin = time.perf_counter()
        rollout(model, latents, prompt, chunk, device, mark_steps)  # compiles (and records CUDA graphs)
        first = time.perf_counter() - begin
        graphs = graph_count()
        times, outputs = rollout(model, latents, prompt, chunk, device, mark_steps)
        total = sum(times)
        eager_total, eager_outputs = eager["static"]
        diff = (outputs.float() - eager_outputs.float()).abs().max().item()
        print(
            f"[{label}] rollout {total:.2f} s = {args.num_frames / total:.1f} frames/s ({eager_total / total:.2f}x "
            f"eager static); first rollout (compile) {first:.1f} s; graphs {graphs}, new in the second rollout "
            f"{graph_count() - graphs}; graph breaks {sum(counters['graph_break'].values())}; max abs diff vs eager "
            f"{diff:.3e} (|out| max {eager_outputs.abs().max().item():.2f})",
            flush=True,
        )

    if not args.skip_compile and args.compile:
        section("compile", compiled_rollout, "compile", None)
    if not args.skip_compile and args.cuda_graphs:
        section("cuda graphs", compiled_rollout, "cuda graphs", "reduce-overhead")
    print(f"total {time.perf_counter() - script_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
