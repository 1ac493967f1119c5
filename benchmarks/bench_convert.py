"""Conversion time and peak memory of `fastgen-diffusers convert` on a 40-layer (Wan2.1-14B key layout) checkpoint.

Builds a 40-block checkpoint of reduced width in the original Wan layout (as Self-Forcing's `.pt` or Krea's
`.safetensors`), a minimal base directory, and converts it in a fresh subprocess per case. Prints the wall time, the
peak RSS during the conversion (`VmHWM`, reset after imports) above the RSS after imports, and that peak split into
anonymous memory (what the converter allocates) and file-backed pages (the memory-mapped checkpoint: clean pages the
kernel drops under pressure). Output tensors go one at a time straight into their shard file, so:

    peak RSS - baseline ~ mapped source pages (file-backed, <= the checkpoint) + a small anonymous part

and the last line scales the anonymous part measured here to Wan2.1-14B (28.6 GB of bf16 weights). Most of that
anonymous part is glibc keeping the memory of freed tensors: with `MALLOC_MMAP_THRESHOLD_=65536` it falls to a fixed
~40 MB at width 512 (one tensor plus overhead). Timings on a shared machine are noisy; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# diffusers -> original Wan names (the inverse of the converter's mapping), to write original-layout checkpoints.
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm3."),
    ("proj_out.", "head.head."),
]


def _original_key(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    key = re.sub(r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation", key)
    for diffusers_name, original_name in _TO_ORIGINAL:
        key = key.replace(diffusers_name, original_name)
    return "model." + key


def _config(layers: int, dim: int) -> dict:
    head_dim = 64 if dim >= 128 else dim
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": dim // head_dim,
        "attention_head_dim": head_dim,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": dim * 27 // 10,  # 14B: 13824 / 5120
        "num_layers": layers,
    }


def build(root: Path, layers: int, dim: int, source: str) -> tuple[Path, Path, int]:
    """``(checkpoint, base, weight bytes)``: a random checkpoint and a base with its config, VAE and scheduler."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from fastgen_diffusers.testing import tiny_scheduler, tiny_vae

    torch.manual_seed(0)
    model = WanTransformer3DModel(**_config(layers, dim))
    weights = {_original_key(k): v.detach().contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    base = root / "base"
    model.save_config(base / "transformer")
    tiny_vae().save_pretrained(base / "vae")
    tiny_scheduler().save_pretrained(base / "scheduler")
    index = {
        "_class_name": "WanPipeline",
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "tokenizer": [None, None],
        "text_encoder": [None, None],
    }
    (base / "model_index.json").write_text(json.dumps(index))
    if source == "safetensors":
        checkpoint = root / "krea-realtime-video-14b.safetensors"
        save_file(weights, str(checkpoint))
    else:
        checkpoint = root / "self_forcing_dmd.pt"
        torch.save({"generator_ema": weights}, checkpoint)
    return checkpoint, base, nbytes


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


def _child(args: argparse.Namespace) -> None:
    """Convert once in this (fresh) process and print the figures as JSON: seconds, the RSS after imports, the peak
    RSS (``VmHWM``, reset after imports) and, sampled every 5 ms, the peak anonymous and file-backed RSS (mapped
    checkpoint pages are file-backed: clean, shared with the page cache, dropped by the kernel under pressure)."""
    import gc
    import threading

    from fastgen_diffusers.convert import convert_checkpoint

    gc.collect()
    baseline = _status_mb("VmRSS")
    anon0, file0 = _status_mb("RssAnon"), _status_mb("RssFile")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM so that the import-time peak does not hide the conversion's
    peaks = {"anon": anon0, "file": file0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peaks["anon"] = max(peaks["anon"], _status_mb("RssAnon"))
            peaks["file"] = max(peaks["file"], _status_mb("RssFile"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = convert_checkpoint(
        args.checkpoint,
        base=args.base,
        output=args.output,
        base_model_id="org/bench",
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
    )
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    figures = {
        "seconds": seconds,
        "baseline_mb": baseline,
        "peak_mb": _status_mb("VmHWM"),
        "anon_mb": peaks["anon"] - anon0,
        "file_mb": peaks["file"] - file0,
        "shards": len(result.shards),
    }
    print(json.dumps(figures))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--dim", type=int, default=512, help="hidden width (14B: 5120)")
    parser.add_argument("--shard-ratio", type=float, default=6.0, help="weights / shard size (14B with 5GB: ~6)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-shard-size", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return

    print(f"{args.layers}-layer checkpoint, width {args.dim} (Wan2.1-14B: 40 layers, width 5120)")
    print(
        f"{'source':<12} {'output':<9} {'weights MB':>10} {'shard MB':>8} {'seconds':>7} {'peak-base MB':>12} "
        f"{'ratio':>5} {'anon MB':>7} {'file MB':>7}"
    )
    anon_ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source, dtype in (("pt", None), ("pt", "bfloat16"), ("safetensors", None)):
            root = Path(tmp) / f"{source}-{dtype}"
            checkpoint, base, nbytes = build(root, args.layers, args.dim, source)
            out_bytes = nbytes // 2 if dtype == "bfloat16" else nbytes
            shard = max(1, int(out_bytes / args.shard_ratio))
            command = [sys.executable, __file__, "--child", "--checkpoint", str(checkpoint), "--base", str(base)]
            command += ["--output", str(root / "out"), "--max-shard-size", str(shard)]
            command += ["--dtype", dtype] if dtype else []
            run = subprocess.run(command, capture_output=True, text=True, check=True)
            figures = json.loads(run.stdout.strip().splitlines()[-1])
            extra = figures["peak_mb"] - figures["baseline_mb"]
            weights_mb = nbytes / 2**20
            anon_ratios[source] = max(anon_ratios.get(source, 0.0), figures["anon_mb"] / weights_mb)
            print(
                f"{source:<12} {dtype or 'as-is':<9} {weights_mb:>10.1f} {shard / 2**20:>8.1f} "
                f"{figures['seconds']:>7.2f} {extra:>12.1f} {extra / weights_mb:>5.2f} {figures['anon_mb']:>7.1f} "
                f"{figures['file_mb']:>7.1f}"
            )
    weights_14b = 28.6
    print(
        f"14B (bf16, {weights_14b} GB): peak - baseline ~ <= {weights_14b} GB file-backed (the mapped checkpoint) + "
        f"anonymous {anon_ratios['pt'] * weights_14b:.1f} GB (.pt) / {anon_ratios['safetensors'] * weights_14b:.1f} "
        "GB (.safetensors), scaling this run's anonymous/weights ratios (an upper estimate: part of it is fixed)."
    )


if __name__ == "__main__":
    main()
