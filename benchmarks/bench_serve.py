"""Frames per second that `fastgen-diffusers serve` delivers to WebSocket clients, against `pipe.stream()` alone.

Runs a real server (uvicorn on a loopback port, one worker thread) on the tiny offline pipeline (or `--model`) and
prints, as medians over `--repeats` runs alternating with the reference:
* `stream()` alone: frames per second of iterating `pipe.stream(...)` (frames decoded to numpy);
* one client (in a process of its own, as a browser is): frames per second received (start message to the last
  frame) and the ratio to `stream()`, time to first frame;
* 2 and 4 clients at once (taking turns chunk by chunk): frames per second per client and in all;
* the JPEG encode (and decode) cost of one 480x832 frame.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from fastgen_diffusers.serve.jpeg import decode_jpeg, encode_jpeg, to_uint8
from fastgen_diffusers.serve.server import ServeConfig, build_server, serving_in_thread
from fastgen_diffusers.testing import tiny_pipeline

PROMPT = "a red fox running through fresh snow"


async def _client(address: str, settings: dict, num_frames: int) -> tuple[float, int, float]:
    """``(seconds to the first frame, frames, seconds to the last frame)`` of one session."""
    import websockets

    async with websockets.connect(f"ws://{address}/ws", max_size=2**24) as ws:
        start = time.perf_counter()
        message = {"type": "start", "prompt": PROMPT, "settings": settings, "num_frames": num_frames}
        await ws.send(json.dumps(message))
        first, frames = None, 0
        while True:
            reply = await ws.recv()
            if isinstance(reply, bytes):
                frames += 1
                first = time.perf_counter() - start if first is None else first
                continue
            reply = json.loads(reply)
            if reply["type"] == "error":
                raise RuntimeError(reply["message"])
            if reply["type"] == "stopped":
                return first, frames, time.perf_counter() - start


async def _gather_clients(address: str, settings: dict, num_frames: int, count: int) -> list:
    seeds = [{**settings, "seed": settings["seed"] + k} for k in range(count)]
    return await asyncio.gather(*(_client(address, s, num_frames) for s in seeds))


def _clients(address: str, settings: dict, num_frames: int, count: int) -> list[tuple[float, int, float]]:
    """``count`` sessions at once, run in this process (the benchmark runs it in a client process of its own, as a
    browser is: the server's process only serves)."""
    return asyncio.run(_gather_clients(address, settings, num_frames, count))


def _stream_fps(pipe, settings: dict, num_frames: int) -> tuple[float, float]:
    """``(frames per second, seconds to the first frames)`` of ``pipe.stream`` alone."""
    call = {k: v for k, v in settings.items() if k not in ("seed", "encoding")}
    start = time.perf_counter()
    first, frames = None, 0
    generator = torch.Generator("cpu").manual_seed(settings["seed"])
    for chunk in pipe.stream(PROMPT, num_frames=num_frames, generator=generator, output_type="np", **call):
        frames += len(to_uint8(chunk.frames[0]))
        first = time.perf_counter() - start if first is None else first
    return frames / (time.perf_counter() - start), first


def _jpeg_cost(repeats: int = 20) -> tuple[float, float]:
    """Median milliseconds to encode and to decode one 480x832 frame (a smooth image with noise, quality 80)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:832]
    base = np.stack([x / 832, y / 480, (x + y) / 1312], axis=-1) * 200
    frame = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    encode, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        data = encode_jpeg(frame, 80)
        encode.append(time.perf_counter() - start)
        start = time.perf_counter()
        decode_jpeg(data, (480, 832))
        decode.append(time.perf_counter() - start)
    return 1000 * statistics.median(encode), 1000 * statistics.median(decode)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="diffusers Wan directory (default: the tiny random model)")
    parser.add_argument("--num-frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args(argv)
    if args.model is None:
        pipe = tiny_pipeline()
    else:
        from fastgen_diffusers.serve.server import load_pipeline

        pipe = load_pipeline(args.model, None, None)[0]
    pipe.set_progress_bar_config(disable=True)
    settings = {"height": args.height, "width": args.width, "num_inference_steps": args.steps, "seed": 0}
    server = build_server(
        ServeConfig(port=0, max_sessions=max([1, *args.clients]), cache_budget_gb=64),
        pipe=pipe,
        model_name=args.model or "tiny",
        device=str(pipe.device),
    )
    results = {}
    spawn = multiprocessing.get_context("spawn")
    # the client process imports this script by its module name (a copy loaded by path is not picklable by reference)
    run_clients = _clients if __name__ == "__main__" else importlib.import_module(__name__)._clients
    with serving_in_thread(server) as address, ProcessPoolExecutor(1, mp_context=spawn) as clients:
        _stream_fps(pipe, settings, args.num_frames)  # warm-up
        clients.submit(run_clients, address, settings, args.num_frames, 1).result()
        stream, served, ttff, stream_ttff = [], [], [], []
        for _ in range(args.repeats):  # alternate, so that a noisy machine hits both alike
            fps, first = _stream_fps(pipe, settings, args.num_frames)
            stream.append(fps)
            stream_ttff.append(first)
            ((first, frames, seconds),) = clients.submit(run_clients, address, settings, args.num_frames, 1).result()
            served.append(frames / seconds)
            ttff.append(first)
        results["stream_fps"] = statistics.median(stream)
        results["serve_fps"] = statistics.median(served)
        results["ratio"] = results["serve_fps"] / results["stream_fps"]
        print(
            f"{args.height}x{args.width}, {args.num_frames} frames, {args.steps} steps: stream() "
            f"{results['stream_fps']:.1f} fps (first frames {1000 * statistics.median(stream_ttff):.0f} ms); serve, "
            f"1 client {results['serve_fps']:.1f} fps = {results['ratio']:.2f}x stream(), time to first frame "
            f"{1000 * statistics.median(ttff):.0f} ms"
        )
        for count in args.clients:
            runs = [
                clients.submit(run_clients, address, settings, args.num_frames, count).result()
                for _ in range(args.repeats)
            ]
            per_client = statistics.median(frames / seconds for run in runs for _, frames, seconds in run)
            total = statistics.median(sum(f for _, f, _ in run) / max(s for _, _, s in run) for run in runs)
            first = statistics.median(f for run in runs for f, _, _ in run)
            results[f"clients_{count}"] = (per_client, total)
            print(
                f"serve, {count} clients: {per_client:.1f} fps each, {total:.1f} fps in all "
                f"({total / results['stream_fps']:.2f}x stream()), time to first frame {1000 * first:.0f} ms"
            )
    encode_ms, decode_ms = _jpeg_cost()
    results["jpeg_encode_ms"] = encode_ms
    print(f"JPEG 480x832 (quality 80): encode {encode_ms:.2f} ms/frame, decode {decode_ms:.2f} ms/frame")
    return results


if __name__ == "__main__":
    main()
