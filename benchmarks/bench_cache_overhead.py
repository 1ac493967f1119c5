"""What cache integrity costs per forward: the content comparison of the conditioning (cross K/V reuse) and the
transaction of a forward (snapshot, and the static engine's copy of overwritten slots). All numbers from this run.

    python benchmarks/bench_cache_overhead.py [--device cpu] [--dtype bfloat16] [--reps 50]

* content key: ``ConditioningKey.matches`` on Wan's text conditioning ``(1, 512, 4096)``, per call;
* transaction: ``begin_transaction`` + ``end_transaction`` of a 30-block engine holding 21 stored chunks, per call;
* undo copies: bytes the windowed static engine keeps during one chunk (4 denoising calls and a store) once the
  window has filled (only the first call at a new chunk overwrites held slots), against the bytes it holds.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import CHUNK, mid_transformer, run_chunk

from fastgen_diffusers import make_engines
from fastgen_diffusers.kv_cache.cross import ConditioningKey


def timed(fn, reps: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` (synchronised on accelerators)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def content_key(device: torch.device, dtype: torch.dtype, reps: int) -> None:
    text = torch.randn(1, 512, 4096, device=device).to(dtype)
    key = ConditioningKey(text, None)
    per_call = timed(lambda: key.matches(text, None), reps, device)
    print(f"content key: matches (1, 512, 4096) {dtype}: {per_call * 1e6:.1f} us per call")


def transaction(device: torch.device, dtype: torch.dtype, reps: int) -> None:
    for kind in ("static", "vanilla"):
        engine = make_engines(FakeModel(30), kind)["main"]
        engine.register_blocks(FakeModel(30).blocks)
        layout = dict(batch_size=1, frame_seqlen=4, num_heads=2, head_dim=8, dtype=dtype, device=device)
        engine.ensure_capacity("pos", **layout, text_len=4, max_frames=63)
        kv = torch.zeros(1, 12, 2, 8, device=device, dtype=dtype)
        for chunk in range(21):
            for block in range(30):
                engine.append_self_kv(block, "pos", kv, kv, 3 * chunk)
            engine.commit_store("pos", 3 * chunk, 3)

        def begin_end(engine=engine):
            engine.begin_transaction("pos")
            engine.end_transaction()

        print(
            f"transaction [{kind}]: begin + end, 30 blocks, 21 chunks: {timed(begin_end, reps, device) * 1e6:.1f} us"
        )


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn1, self.attn2 = torch.nn.Identity(), torch.nn.Identity()


class FakeModel:
    """Blocks with two attention modules each, for engines benchmarked without a model."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [
            type("Block", (), {"attn1": torch.nn.Identity(), "attn2": torch.nn.Identity()})()
            for _ in range(num_blocks)
        ]

    def kv_cache_branches(self):
        return {"main": self.blocks}


@torch.no_grad()
def undo_copies(device: torch.device) -> None:
    model = mid_transformer().to(device)
    model.set_kv_cache_engines(make_engines(model, "static", window_frames=9, sink_frames=3))
    engine = model.kv_cache_engines["main"]
    kept = []
    keep = engine._keep_for_undo

    def counting(entry, first, last, seqlen):
        before = len(engine._transaction.undo) if engine._transaction else 0
        keep(entry, first, last, seqlen)
        if engine._transaction is not None:
            kept.extend(copy.nbytes for copy in engine._transaction.undo[before:])

    engine._keep_for_undo = counting
    latents, text = torch.randn(1, 16, 3, 16, 16, device=device), torch.randn(1, 64, 64, device=device)
    for chunk in range(8):
        kept.clear()
        run_chunk(model, latents, text, CHUNK * chunk)
    held = engine.self_cache_bytes("pos")
    print(
        f"undo copies [static, window 9, sink 3, chunk 8]: {sum(kept)} bytes kept during the chunk's 5 calls, "
        f"{len(kept)} copies; the cache holds {held} bytes (ratio {sum(kept) / held:.3f})"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    content_key(device, dtype, args.reps)
    content_key(device, torch.float32, args.reps)
    transaction(device, dtype, args.reps)
    undo_copies(device)


if __name__ == "__main__":
    main()
