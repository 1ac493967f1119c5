"""End to end: prompt to decoded frames, per stage and in total, against the memory plan.

Every figure counts, for one video of ``--num-frames`` frames from a text prompt (random weights):

* **text**: tokenizing and encoding the prompt (UMT5; offloaded: held on the CPU, each layer streamed to the GPU
  while it runs, diffusers' ``apply_group_offloading(offload_type="leaf_level", use_stream=True)``);
* **denoise**: every chunk's denoising steps and its cache pass (``pipe.stream(..., output_type="latent")``), per
  chunk (from the previous chunk's end on the main stream to this chunk's) and in total;
* **decode**: every chunk's streamed decode to pixels in [-1, 1] (the Wan VAE through ``StreamingWanDecoder``, the tiny
  decoder through ``StreamingTinyWanDecoder``), per chunk (its own span) and in total. **Serial** rows decode each
  chunk after its denoising and before the next chunk's; **overlapped** rows (CUDA) queue each chunk's decode on its
  own stream (``OverlappedDecoder``, what ``pipe.enable_decode_overlap()`` does in ``__call__``) while the next chunk
  denoises, so there the stages add up to more than the total;
* **total**: from the prompt to the last frame; frames/s = pixel frames / total; time to the first frame = text + the
  time until the first chunk's frames are decoded; per-chunk latency = the time from one chunk's frames to the next
  chunk's (the first: from the start of denoising). Spans are read on the device's timeline (CUDA events on a GPU);
* **peak** (CUDA): ``torch.cuda.max_memory_allocated`` over the timed run, against the plan's total
  (:func:`fastgen_diffusers.memory_plan.plan_rollout_memory`, printed before anything is built).

Not counted: building the components, the warm-up run, post-processing frames to uint8 or writing a file.

Scales: ``tiny`` (the smoke test, seconds); ``small`` (the CPU default: a 4-layer dim-128 transformer, a small UMT5,
the Wan2.1 VAE's architecture at a quarter of its width (the full one decodes 33 frames at 64x64 in about 100 s on
one CPU thread, 98% of the run), the tiny decoder at full size, 64x64); ``1.3b`` / ``14b`` (Wan2.1-1.3B / Krea
Realtime 14B shapes, the UMT5-XXL encoder and the Wan2.1 VAE, 480x832, 81 frames, bf16; for a GPU). ``14b``
defaults to FP8 weights (torchao float8 dynamic activation + weight, per row; Hopper or newer), Krea's recompute
policy (context 3) and the text encoder offloaded. ``--memory-cap 24`` caps the process at 24 GiB
(``torch.cuda.set_per_process_memory_fraction``). On CPU the figures are the shares of each stage at that size, not
speeds to quote.

Usage: ``python benchmarks/bench_end_to_end.py`` (CPU, small); ``python benchmarks/bench_end_to_end.py --scale 1.3b``
and ``--scale 14b --memory-cap 24`` on a GPU (see ``benchmarks/gpu_run.sh``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from _common import WEIGHTS, quantization_config, section, synchronize
from accelerate import init_empty_weights
from diffusers import AutoencoderKLWan
from transformers import UMT5Config, UMT5EncoderModel

from fastgen_diffusers import WanCausalPipeline, WanCausalTransformer3DModel
from fastgen_diffusers.memory_plan import GIB, UMT5_XXL, WAN_1_3B, WAN_14B, plan_rollout_memory
from fastgen_diffusers.models.autoencoder_tiny_wan import AutoencoderTinyWan
from fastgen_diffusers.pipelines.video_io.autoencoders import streaming_decoder
from fastgen_diffusers.pipelines.video_io.decode_overlap import OverlappedDecoder
from fastgen_diffusers.testing import tiny_scheduler, tiny_tokenizer

PROMPT = "a cat walks on the grass, realistic"
TIMESTEPS = [1000.0, 937.5, 833.3, 625.0]
TINY_TRANSFORMER = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "num_layers": 2}
SMALL_TRANSFORMER = {**WAN_1_3B, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256, "num_layers": 4}
TINY_VAE = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}
SCALES = {
    # transformer, text encoder (UMT5 config), VAE config, height, width, frames
    "tiny": (
        {**TINY_TRANSFORMER, "text_dim": 32},
        {"vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4},
        {**TINY_VAE, "temperal_downsample": [False, True, True]},
        32, 32, 21,
    ),
    "small": (
        {**SMALL_TRANSFORMER, "text_dim": 64},
        {"vocab_size": 64, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4},
        {"base_dim": 24},
        64, 64, 33,
    ),
    "1.3b": (WAN_1_3B, UMT5_XXL, {}, 480, 832, 81),
    "14b": (WAN_14B, UMT5_XXL, {}, 480, 832, 81),
}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def materialize(module: torch.nn.Module, device: torch.device, dtype: torch.dtype, quantize=None) -> None:
    """Give a module built under ``accelerate.init_empty_weights()`` (parameters on the meta device, buffers real)
    random weights on ``device`` in ``dtype``, one block at a time (a 14B transformer never exists in full precision),
    quantizing each block's linears with torchao's ``quantize_(block, quantize)`` as it lands (the configs diffusers'
    ``TorchAoConfig`` applies)."""
    parts = [b for c in module.children() for b in (c if isinstance(c, torch.nn.ModuleList) else [c])]
    keep = tuple(
        getattr(module, "_keep_in_fp32_modules", None) or ()
    )  # TorchAoConfig leaves their linears as they are

    def quantized(child: torch.nn.Module, name: str) -> bool:
        return isinstance(child, torch.nn.Linear) and not any(k in name.split(".") for k in keep)

    for part in parts:
        materialize(part, device, dtype)
        if quantize is not None and any(quantized(m, n) for n, m in part.named_modules()):
            from torchao.quantization import quantize_

            quantize_(part, quantize, filter_fn=quantized)
    for name, param in list(module.named_parameters(recurse=False)):
        if name.endswith("bias"):
            value = torch.zeros(param.shape, device=device, dtype=dtype)
        elif param.ndim >= 2:
            value = torch.randn(param.shape, device=device, dtype=dtype) * param[0].numel() ** -0.5
        else:
            value = torch.ones(param.shape, device=device, dtype=dtype)
        setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    module.to(device)  # buffers


def build_pipeline(args, device: torch.device, dtype: torch.dtype, quantize, vae=None) -> WanCausalPipeline:
    """The pipeline of ``--scale`` with random weights; ``vae``: its autoencoder (default: a Wan VAE built here)."""
    transformer_config, text_config, vae_config, *_ = SCALES[args.scale]
    tokenizer = tiny_tokenizer()
    with init_empty_weights():
        text_encoder = UMT5EncoderModel(UMT5Config(**text_config, num_decoder_layers=0, dropout_rate=0.0))
        transformer = WanCausalTransformer3DModel(**transformer_config, chunk_size=3)
        wan_vae = AutoencoderKLWan(**vae_config) if vae is None else None
    if wan_vae is not None:
        materialize(wan_vae, device, dtype)
        vae = wan_vae
    materialize(text_encoder, torch.device("cpu") if args.offload_text_encoder else device, dtype)
    if args.offload_text_encoder and device.type == "cuda":
        # diffusers' group offloading: each leaf module visits the device while it runs (streamed, pinned)
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(text_encoder, onload_device=device, offload_type="leaf_level", use_stream=True)
    materialize(transformer, device, dtype, quantize)
    pipe = WanCausalPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=tiny_scheduler(),
        transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_text(pipe: WanCausalPipeline, device: torch.device) -> torch.Tensor:
    """Prompt embeds on ``device`` (an offloaded encoder's layers visit the device through its offloading hooks)."""
    return pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, max_sequence_length=512, device=device)[0]


class Clock:
    """Time marks on the device's timeline: CUDA events (recorded on a stream, read after a synchronize) on a GPU,
    ``time.perf_counter()`` elsewhere (where every stage runs in order on the host)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, begin, end) -> float:
        return begin.elapsed_time(end) / 1000 if self.cuda else end - begin


def policy_options(args) -> dict:
    """The call's cache policy arguments: Krea's recompute (context 3, the first frame kept as the anchor) or none."""
    if args.policy == "recompute":
        return {"kv_cache_policy": "recompute", "context_frames": 3, "keep_first_frame": True}
    return {}


def run_once(pipe, tiny, args, device, dtype, kind: str, overlap: bool) -> dict:
    """One end-to-end run: text, then every chunk's denoising + cache pass and its decode.

    Serial (``overlap=False``): each chunk's decode runs after its denoising, before the next chunk's. Overlapped: each
    chunk's decode is queued on its own CUDA stream ([`OverlappedDecoder`]) as soon as the chunk is done, and the next
    chunk denoises meanwhile (on a CPU the decode runs at once: the serial order). Per chunk: ``denoise`` (from the
    previous chunk's end on the main stream to this one's), ``decode`` (the decode's own span on its stream) and
    ``ready`` (from the start of denoising to the chunk's last frame), all on the device's timeline.
    """
    _, _, _, height, width, num_frames = SCALES[args.scale]
    height, width, num_frames = args.height or height, args.width or width, args.num_frames or num_frames
    policy = policy_options(args)
    clock = Clock(device)
    synchronize(device)
    begin = time.perf_counter()
    embeds = encode_text(pipe, device)
    synchronize(device)
    text = time.perf_counter() - begin
    marks, frames = [], 0  # per chunk: (denoised, decode start, decode end)
    start = clock.mark()
    with streaming_decoder(pipe.vae if kind == "wan" else tiny) as decoder:
        decoding = OverlappedDecoder(decoder, device, overlap=overlap)
        side = decoding.stream  # None: the decode runs on the current stream, at once
        stream = pipe.stream(
            prompt_embeds=embeds.to(dtype), height=height, width=width, num_frames=num_frames, timesteps=TIMESTEPS,
            output_type="latent", generator=torch.Generator().manual_seed(0), **policy,
        )  # fmt: skip
        pending = []
        for record in stream:
            latents = record.latents.to(dtype)
            denoised = clock.mark()
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(device))
            decode_start = clock.mark(side)
            pending.append(decoding.submit(latents))
            marks.append((denoised, decode_start, clock.mark(side)))
        pixels = [chunk.frames() for chunk in pending]
        synchronize(device)
    total = time.perf_counter() - begin
    frames = sum(p.shape[2] for p in pixels)
    # a chunk denoises from the previous chunk's end on the main stream: its decode's end when serial
    previous = [start] + [denoised if side is not None else end for denoised, _, end in marks[:-1]]
    return {
        "text": text,
        "denoise": [clock.seconds(a, denoised) for a, (denoised, _, _) in zip(previous, marks)],
        "decode": [clock.seconds(a, b) for _, a, b in marks],
        "ready": [clock.seconds(start, end) for _, _, end in marks],
        "total": total,
        "first_frame": text + clock.seconds(start, marks[0][2]),
        "frames": frames,
    }


def describe(label: str, runs: list[dict], device: torch.device, plan_total: int, peak: int | None) -> str:
    """One line: medians over ``runs`` of each stage and the totals."""
    median = statistics.median
    text = median(r["text"] for r in runs)
    denoise = median(sum(r["denoise"]) for r in runs)
    decode = median(sum(r["decode"]) for r in runs)
    total = median(r["total"] for r in runs)
    first = median(r["first_frame"] for r in runs)
    stages = text + denoise + decode  # the stages' medians may come from different runs: shares of their sum
    run = runs[len(runs) // 2]
    ready = run["ready"]
    latency = [b - a for a, b in zip([0.0, *ready], ready)]  # each chunk's frames after the previous chunk's
    line = (
        f"[{label}] {run['frames']} frames in {total:.3f} s = {run['frames'] / total:.2f} frames/s; first frame after "
        f"{first:.3f} s; per chunk (frames after the previous chunk's) first {latency[0]:.3f} s, median "
        f"{median(latency):.3f} s, max {max(latency):.3f} s; text {text:.3f} s, denoise {denoise:.3f} s "
        f"({len(run['denoise'])} chunks), decode {decode:.3f} s; shares: text {100 * text / stages:.1f}%, denoise "
        f"{100 * denoise / stages:.1f}%, decode {100 * decode / stages:.1f}% (median of {len(runs)})"
    )
    if peak is not None:
        line += f"; peak {peak / GIB:.2f} GiB vs plan {plan_total / GIB:.2f} GiB (ratio {peak / plan_total:.2f})"
    return line


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default=None, help="default: 1.3b on CUDA, small on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32"
    )
    parser.add_argument("--weights", choices=WEIGHTS, default=None, help="linear weights (14b default: float8)")
    parser.add_argument("--policy", choices=("sequential", "recompute"), default=None, help="14b default: recompute")
    parser.add_argument("--offload-text-encoder", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--memory-cap", type=float, default=None, help="GiB (CUDA)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-frames", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs per row first")
    parser.add_argument("--decoders", default="wan,tiny", help="rows to run: wan, tiny")
    parser.add_argument(
        "--calls", action=argparse.BooleanOptionalAction, default=True, help="rows of pipe(...) itself, per mode"
    )
    parser.add_argument(
        "--modes", default=None, help="serial, overlapped (default: both on CUDA; serial elsewhere, where they agree)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.scale = args.scale or ("1.3b" if device.type == "cuda" else "small")
    big = args.scale == "14b"
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    args.weights = args.weights or ("float8" if big else "compute")
    args.policy = args.policy or ("recompute" if big else "sequential")
    args.offload_text_encoder = big if args.offload_text_encoder is None else args.offload_text_encoder
    transformer_config, _, _, height, width, num_frames = SCALES[args.scale]
    height, width, num_frames = args.height or height, args.width or width, args.num_frames or num_frames
    kinds = args.decoders.split(",")
    if not kinds or set(kinds) - {"wan", "tiny"}:
        raise ValueError(f"`--decoders` must name `wan` and/or `tiny`, got {args.decoders!r}.")
    modes = (args.modes or ("serial,overlapped" if device.type == "cuda" else "serial")).split(",")
    if not modes or set(modes) - {"serial", "overlapped"}:
        raise ValueError(f"`--modes` must name `serial` and/or `overlapped`, got {args.modes!r}.")

    name = str(dtype).removeprefix("torch.")
    weight_dtype = {"compute": name, "float8": "float8_e4m3fn", "int8": "int8"}[args.weights]
    plans = {
        kind: plan_rollout_memory(
            transformer_config, height=height, width=width, num_frames=num_frames, weight_dtype=weight_dtype,
            compute_dtype=name, kv_cache_policy=args.policy, context_frames=3 if args.policy == "recompute" else None,
            text_encoder_parameters=None if args.scale in ("1.3b", "14b") else 0,
            text_encoder_offloaded=args.offload_text_encoder, decoder=kind,
            description=f"{args.scale}, {weight_dtype} weights, {args.policy}, text encoder "
            f"{'offloaded' if args.offload_text_encoder else 'on the device'}, "
            f"{'Wan VAE' if kind == 'wan' else 'tiny decoder'}, {width}x{height}, {num_frames} frames",
        )
        for kind in kinds
    }  # fmt: skip
    for plan in plans.values():
        print(plan.summary(), flush=True)
    quantize = quantization_config(args.weights, device)  # refuses FP8 where it cannot run, before any weight
    if args.memory_cap is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap * GIB / total), device)
        print(f"memory capped at {args.memory_cap:g} GiB of {total / GIB:.0f} GiB", flush=True)
    begin = time.perf_counter()
    tiny = None
    if "tiny" in kinds:
        with init_empty_weights():
            tiny = AutoencoderTinyWan()
        materialize(tiny, device, dtype)
        tiny.eval()
    # without Wan VAE rows the tiny autoencoder is the pipeline's VAE (no Wan VAE on the device, as the plan counts)
    pipe = build_pipeline(args, device, dtype, quantize, vae=None if "wan" in kinds else tiny)
    print(
        f"{args.scale}: {transformer_config['num_layers']} layers, dim "
        f"{transformer_config['num_attention_heads'] * transformer_config['attention_head_dim']}, weights "
        f"{args.weights}, {name}, {device}, policy {args.policy}; built in {time.perf_counter() - begin:.1f} s",
        flush=True,
    )

    @contextmanager
    def only_decoder(kind: str):
        """Hold the other decoder on the CPU during a row on a GPU: a row's plan counts its own decoder only."""
        other = tiny if kind == "wan" else (None if pipe.vae is tiny else pipe.vae)
        if other is None or device.type != "cuda":
            yield
            return
        other.to("cpu")
        try:
            yield
        finally:
            other.to(device)

    def row(kind: str, mode: str) -> None:
        with only_decoder(kind):
            measure_row(kind, mode)

    def measure_row(kind: str, mode: str) -> None:
        overlap = mode == "overlapped"
        for _ in range(args.warmups):
            run_once(pipe, tiny, args, device, dtype, kind, overlap)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runs = [run_once(pipe, tiny, args, device, dtype, kind, overlap) for _ in range(args.repeats)]
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        label = f"{'wan vae' if kind == 'wan' else 'tiny decoder'}, {mode}"
        print(describe(label, runs, device, plans[kind].total, peak), flush=True)

    for kind in kinds:
        for mode in modes:
            section(f"{kind}, {mode}", row, kind, mode)

    # The user's path: `pipe(prompt, output_type="pt")` with and without `pipe.enable_decode_overlap()`.
    calls = {}

    def call_row(mode: str) -> None:
        if mode == "overlapped":
            pipe.enable_decode_overlap()
        kind = "wan" if "wan" in kinds else "tiny"

        def call() -> tuple[float, torch.Tensor]:
            synchronize(device)
            begin = time.perf_counter()
            frames = pipe(
                prompt=PROMPT, height=height, width=width, num_frames=num_frames, timesteps=TIMESTEPS,
                output_type="pt", generator=torch.Generator().manual_seed(0), max_sequence_length=512,
                **policy_options(args),
            ).frames  # fmt: skip
            synchronize(device)
            return time.perf_counter() - begin, frames

        try:
            with only_decoder(kind):
                for _ in range(args.warmups):
                    call()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                runs = [call() for _ in range(args.repeats)]
        finally:
            pipe.disable_decode_overlap()
        seconds = statistics.median(r[0] for r in runs)
        frames = calls[mode] = runs[-1][1]
        line = (
            f'[call, {"wan vae" if kind == "wan" else "tiny decoder"}, {mode}] pipe(prompt, output_type="pt"): '
            f"{frames.shape[1]} frames in {seconds:.3f} s = {frames.shape[1] / seconds:.2f} frames/s (median of "
            f"{len(runs)}, text encoding included)"
        )
        if mode != "serial" and "serial" in calls:
            line += f"; frames equal the serial call's: {torch.equal(frames, calls['serial'])}"
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            line += f"; peak {peak / GIB:.2f} GiB vs plan {plans[kind].total / GIB:.2f} GiB"
        print(line, flush=True)

    if args.calls:
        for mode in modes:
            section(f"call, {mode}", call_row, mode)


if __name__ == "__main__":
    main()
