"""Smoke tests of the benchmark scripts in a tiny or small mode (seconds): they keep the scripts from rotting and check
the lines their figures come from. The GPU-scale one is prepared for sessions that are lent a GPU; bench_compile
(inductor compiles for tens of seconds), bench_context_parallel (spawns ranks) and bench_pipeline (no small mode)
have none."""

from __future__ import annotations

import pytest
from bench_loader import load_benchmark

LABELS = ("static", "vanilla", "window rope", "kv8", "bias", "recompute", "rolling")


def test_gpu_scale_benchmark_runs_in_its_tiny_cpu_mode(capsys):
    """The eager rows and every part of ``--policies``, one line per measurement, with the figures that hold on any
    device: bytes equal to the formulas, forward counts, and the bias's two mask paths agreeing in float32."""
    module = load_benchmark("bench_gpu_scale")
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--num-frames", "21", "--skip-compile", "--policies"]
    module.main(argv)
    printed = capsys.readouterr().out
    assert "FAILED" not in printed
    assert "[static] rollout" in printed and "[vanilla] rollout" in printed
    rows = {label: [line for line in printed.splitlines() if line.startswith(f"[{label}] ")] for label in LABELS}
    assert [row.split("(ratio")[1][:7] for row in rows["static"] + rows["vanilla"]] == [" 1.000)"] * 2
    diff = float(printed.split("flex vs sdpa block mask: max abs diff ")[1].split()[0])
    assert diff <= 1e-5
    # window RoPE + EMA: the same bytes as absolute positions, the window's 9 frames
    assert [" ".join(row.split()[2:4]) for row in rows["window rope"]] == [
        f"{kind} {mode}:" for kind in ("static", "vanilla") for mode in ("absolute", "window+ema")
    ]
    assert all("(9 frames) vs formula" in row and "(ratio 1.000)" in row for row in rows["window rope"])
    # 8-bit: bytes held and allocated = 1 byte per element + float32 scales
    assert len(rows["kv8"]) == 4
    for row in rows["kv8"]:
        assert "(ratio held 1.0000, allocated 1.0000;" in row
        error = float(row.split("max abs diff ")[1].split(",")[0])
        assert 0 < error <= (1e-3 if "int8" in row else 5e-3)
    # bias: SDPA float mask and FlexAttention score_mod agree; three timed rows
    bias = rows["bias"]
    assert float(bias[0].split("max abs diff ")[1].split()[0]) <= 1e-5
    assert [row.split(":")[0] for row in bias[1:]] == [
        "[bias] sdpa float mask", "[bias] flex score_mod", "[bias] no mask (bias 1)"
    ]  # fmt: skip
    # recompute: as many forwards as the windowed rollout (a rebuild instead of a cache pass), 3 frames held
    assert len(rows["recompute"]) == 3
    assert all("forwards 16 denoising + 3 cache; cache held" in row for row in rows["recompute"])
    assert all(row.endswith("(3 frames)") for row in rows["recompute"])
    # rolling: 5 chunks, 5 steps (the counts of bench_rolling's smoke test)
    assert "[rolling] sequential: 5 chunks x 5 steps, forwards 29 (25 denoising + 4 cache, carrying 87" in printed
    assert "[rolling] rolling: 5 chunks x 5 steps, forwards 17 (9 denoising + 8 cache, carrying 99" in printed
    assert "[rolling] rolling vs sequential: forwards per chunk x0.59, frames/s x" in printed


def test_gpu_scale_benchmark_compiled_rows_run_in_the_tiny_cpu_mode(capsys):
    module = load_benchmark("bench_gpu_scale")
    module.main(
        ["--tiny", "--device", "cpu", "--dtype", "float32", "--num-frames", "13", "--compile", "--cuda-graphs"]
    )
    printed = capsys.readouterr().out
    assert "FAILED" not in printed
    for row in ("[compile]", "[cuda graphs]"):
        line = printed.split(row)[1].splitlines()[0]
        assert "graphs 3, new in the second rollout 0; graph breaks 0" in line
        assert float(line.split("max abs diff vs eager ")[1].split()[0]) <= 1e-4


def test_rope_window_benchmark_runs_in_its_tiny_mode(capsys):
    """bench_rope_window: per engine, absolute and window+ema rows with ratios and equal cache bytes."""
    module = load_benchmark("bench_rope_window")
    module.main(["--tiny", "--chunks", "4", "--repeats", "1", "--size", "8"])
    printed = capsys.readouterr().out
    for kind in ("static", "vanilla"):
        rows = [line for line in printed.splitlines() if line.startswith(f"[{kind}]")]
        assert len(rows) == 2 and "absolute" in rows[0] and "window+ema" in rows[1]
        assert "(ratio 1.000)" in rows[0]
        assert rows[0].split("cache held ")[1] == rows[1].split("cache held ")[1]  # same bytes held and allocated


def test_recompute_benchmark_runs_in_a_tiny_mode(capsys):
    module = load_benchmark("bench_recompute")
    module.main(["--size", "16", "--chunks", "2", "--steps", "1", "--memory-chunks", "3", "--memory-first", "2"])
    printed = capsys.readouterr().out
    assert printed.count("per-chunk time, output") == 2 and "recompute, re-encoded anchor" in printed
    assert "V2V sequential: first frames" in printed and "V2V recompute: first frames" in printed
    assert printed.count("(equal: True)") == 2  # the engines hold the context only, however many chunks


def test_rolling_benchmark_runs_in_its_tiny_mode(capsys):
    module = load_benchmark("bench_rolling")
    module.main(["--tiny"])
    printed = capsys.readouterr().out
    # 5 chunks, 5 steps: 5 x 5 denoising forwards + 4 cache passes; 9 windows: 9 denoising forwards + 8 commits
    assert "[sequential] forwards 29 (25 denoising + 4 cache, carrying 87 latent frames), 5.80 per output" in printed
    assert "[rolling] forwards 17 (9 denoising + 8 cache, carrying 99 latent frames), 3.40 per output" in printed
    assert "rolling vs sequential: forwards per chunk x0.59, time per frame x" in printed


def test_engines_benchmark_runs_in_a_tiny_mode(capsys):
    """bench_engines: static vs vanilla rows at both points, and the windowed cache flat from chunk 5 to the last."""
    load_benchmark("bench_engines").main(
        ["--late-chunk", "6", "--window-chunk", "8", "--reps", "1", "--latent-size", "4"]
    )
    printed = capsys.readouterr().out
    assert "[window 12, sink 3] chunk 8 / chunk 5: static" in printed
    rows = [line.split() for line in printed.splitlines() if line.startswith(("no window", "window 12"))]
    assert [row[-4] for row in rows] == ["5", "6", "5", "8"]
    for kind in ("static", "vanilla"):
        line = next(line for line in printed.splitlines() if line.startswith(f"[window 12, sink 3] {kind} "))
        assert "(x1.00)" in line  # 3 chunks more, the same bytes: the window holds them


# Tiny arguments of the older scripts, and what each must print (the ratios they exist for).
SMALL_RUNS = {
    "bench_streaming": (
        ["--num-frames", "21", "--size", "16", "--repeats", "1"],
        ["2 chunks, 21 frames at 16x16", "time to first frames (stream):", "decode chunk by chunk:", "overhead x"],
    ),
    "bench_v2v": (
        ["--num-frames", "21", "--size", "16", "--repeats", "1"],
        ["2 chunks, 21 frames at 16x16", "time to first frames (stream from an iterator):", "encode chunk by chunk:"],
    ),
    "bench_vace": (["--repeats", "1", "--size", "16", "--num-frames", "21", "--steps", "2"], ["speed-up"]),
    "bench_transformer": (
        ["--frames", "6", "--repeats", "1"],
        ["overhead", "speed-up", "cross K/V reuse", "formula 1572864 B, ratio 1.000", "memoised"],
    ),
}


@pytest.mark.parametrize("name", list(SMALL_RUNS))
def test_older_benchmarks_run_in_a_small_mode(name, capsys):
    argv, fragments = SMALL_RUNS[name]
    load_benchmark(name).main(argv)
    printed = capsys.readouterr().out
    for fragment in fragments:
        assert fragment in printed, (fragment, printed)
    if name == "bench_vace":  # K = 1 refreshes the hints every step: exactly the exact rollout
        rows = {line.split()[0]: line.split() for line in printed.splitlines() if line.strip()}
        assert rows["exact"][-2:] == rows["1"][-2:] == ["0.00e+00", "0.00e+00"]


def test_end_to_end_benchmark_runs_in_its_tiny_cpu_mode(capsys):
    """The plan, then one line per decoder and mode with every stage, the totals and the shares (which add up to 100%).
    On a CPU the overlapped rows run the decode at once (the serial order) through the same bookkeeping."""
    module = load_benchmark("bench_end_to_end")
    argv = ["--scale", "tiny", "--device", "cpu", "--repeats", "1", "--warmups", "0", "--modes", "serial,overlapped"]
    module.main(argv)
    printed = capsys.readouterr().out
    assert "FAILED" not in printed
    assert printed.startswith("memory plan (tiny, float32 weights, sequential,") and "  total: " in printed
    labels = [f"[{decoder}, {mode}]" for decoder in ("wan vae", "tiny decoder") for mode in ("serial", "overlapped")]
    rows = [line for line in printed.splitlines() if line.startswith(tuple(labels))]
    assert [row.split("]")[0] + "]" for row in rows] == labels
    for row in rows[::2]:  # serial: the stages follow one another inside the total
        seconds = {stage: float(row.split(f"; {stage} " if stage == "text" else f", {stage} ")[1].split(" s")[0])
                   for stage in ("text", "denoise", "decode")}  # fmt: skip
        total = float(row.split(" frames in ")[1].split(" s")[0])
        assert sum(seconds.values()) <= total + 1e-3, (seconds, total)
    # the user's path, pipe(...), with and without decode overlap: the same frames
    calls = [line for line in printed.splitlines() if line.startswith("[call, wan vae, ")]
    assert len(calls) == 2 and calls[1].endswith("frames equal the serial call's: True")
    assert all(" 21 frames in " in call for call in calls)
    for row in rows:
        assert " 21 frames in " in row and "(2 chunks)" in row and "first frame after" in row
        shares = row.split("shares: ")[1].split(" (median")[0]  # of the stages' sum (100% by construction)
        assert [part.split()[0] for part in shares.split(", ")] == ["text", "denoise", "decode"], shares
        assert all(float(part.split()[1].rstrip("%")) > 0 for part in shares.split(", ")), shares  # each stage ran


def test_end_to_end_benchmark_with_only_the_tiny_decoder_builds_no_wan_vae(capsys, monkeypatch):
    """``--decoders tiny`` (the 14B row's): the tiny autoencoder is the pipeline's VAE, as its plan counts; Krea's
    recompute policy runs through the same rows."""
    module = load_benchmark("bench_end_to_end")

    def no_wan_vae(**config):
        raise AssertionError("a Wan VAE was built")

    monkeypatch.setattr(module, "AutoencoderKLWan", no_wan_vae)
    argv = ["--scale", "tiny", "--device", "cpu", "--repeats", "1", "--warmups", "0", "--decoders", "tiny"]
    module.main([*argv, "--policy", "recompute"])
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and printed.count("memory plan (") == 1
    assert "float32 weights, recompute, text encoder on the device, tiny decoder," in printed
    assert printed.count("[tiny decoder, serial] 21 frames in") == 1
    assert "[call, tiny decoder, serial] pipe(" in printed


def test_end_to_end_shares_add_up_when_the_stage_medians_come_from_different_runs():
    module = load_benchmark("bench_end_to_end")
    runs = [
        {"text": t, "denoise": [d], "decode": [c], "ready": [d + c], "total": t + d + c, "first_frame": 1, "frames": 9}
        for t, d, c in [(1.0, 1.0, 1.0), (5.0, 1.0, 1.0), (1.0, 5.0, 1.0)]
    ]  # medians: text 1, denoise 1, decode 1, total 7
    line = module.describe("row", runs, None, 1, None)  # no peak: the device is not read
    assert "shares: text 33.3%, denoise 33.3%, decode 33.3% (median of 3)" in line


def test_serve_benchmark_runs_in_a_small_mode(capsys):
    """bench_serve: one client against ``stream()``, two clients, and the JPEG cost, one line each."""
    pytest.importorskip("fastapi")
    pytest.importorskip("websockets")
    module = load_benchmark("bench_serve")
    argv = ["--num-frames", "9", "--height", "32", "--width", "32", "--steps", "1", "--repeats", "1", "--clients", "2"]
    results = module.main(argv)
    printed = capsys.readouterr().out
    assert "x stream(), time to first frame" in printed and "serve, 2 clients:" in printed
    assert results["serve_fps"] > 0 and results["stream_fps"] > 0 and results["jpeg_encode_ms"] > 0
