"""``fastgen-diffusers`` user errors: one line on stderr, a non-zero exit, no traceback, and no model loaded first.

The console entry runs in subprocesses with ``PYTHONPATH`` set to this checkout (the installed console script may
point at another one). "No model loaded" is enforced, not inferred: the subprocesses make importing
``fastgen_diffusers.pipelines`` and ``fastgen_diffusers.testing`` (where every model comes from) raise ``ImportError``,
a bug that would print a traceback and fail the case; a control case shows that a valid command line does reach them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import imageio
import numpy as np
import pytest

from fastgen_diffusers.cli import app as cli
from fastgen_diffusers.cli.checks import VIDEO_EXTENSIONS

pytestmark = pytest.mark.filterwarnings("ignore:The keyword `fps` is no longer supported:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[1]
MODEL_MODULES = ("fastgen_diffusers.pipelines", "fastgen_diffusers.testing")
# Runs `python -m fastgen_diffusers ARGS` (runpy is what `-m` uses) with the model modules made unimportable.
BLOCKED_CONSOLE = (
    "import runpy, sys\n"
    f"for name in {MODEL_MODULES!r}:\n"
    "    sys.modules[name] = None\n"
    "sys.argv[0] = 'fastgen-diffusers'\n"
    "runpy.run_module('fastgen_diffusers', run_name='__main__', alter_sys=True)\n"
)
# Runs `cli.main(argv)` for every case of a JSON table in one process (one interpreter start for the whole table),
# model modules blocked, and prints {case: [exit status, stderr, stdout]}.
BLOCKED_TABLE = (
    "import contextlib, io, json, sys, traceback\n"
    f"for name in {MODEL_MODULES!r}:\n"
    "    sys.modules[name] = None\n"
    "from fastgen_diffusers.cli import main\n"
    "results = {}\n"
    "for case, argv in json.loads(sys.stdin.read()).items():\n"
    "    err, out = io.StringIO(), io.StringIO()\n"
    "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):\n"
    "        try:\n"
    "            status = main(argv)\n"
    "        except SystemExit as exit:\n"
    "            status = exit.code\n"
    "        except BaseException:\n"
    "            status, err = 'raised', io.StringIO(traceback.format_exc())\n"
    "    results[case] = [status, err.getvalue(), out.getvalue()]\n"
    "print(json.dumps(results))\n"
)


def cli_env(tmp_path: Path) -> dict[str, str]:
    """This checkout first on the path, one thread, an empty offline Hugging Face cache, no torchrun variables."""
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "LOCAL_RANK", "RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1",
    )
    return env


def run_console(args: list[str], tmp_path: Path, block_models: bool = True) -> subprocess.CompletedProcess:
    command = ["-c", BLOCKED_CONSOLE] if block_models else ["-m", "fastgen_diffusers"]
    return subprocess.run(
        [sys.executable, *command, *args], capture_output=True, text=True, env=cli_env(tmp_path), cwd=tmp_path
    )


def write_video(path: Path, frames: int, size: tuple[int, int] = (32, 32)) -> Path:
    with imageio.get_writer(path, fps=8) as writer:
        for value in np.linspace(0, 255, frames).astype(np.uint8):
            writer.append_data(np.full((size[1], size[0], 3), value, dtype=np.uint8))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Files for the table: a readable image, a text file named .png, clips and control videos of given lengths."""
    folder = tmp_path_factory.mktemp("inputs")
    imageio.imwrite(folder / "frame.png", np.zeros((32, 32, 3), dtype=np.uint8))
    (folder / "notes.png").write_text("not an image")
    (folder / "empty_model").mkdir()
    (folder / "a_file").write_text("x")
    (folder / "folder.mp4").mkdir()
    write_video(folder / "clip4.gif", 4)
    write_video(folder / "clip9.gif", 9)
    write_video(folder / "control5.gif", 5)
    write_video(folder / "control9_48.gif", 9, size=(48, 32))
    write_video(folder / "input9_50x30.gif", 9, size=(50, 30))
    (folder / "notes.mp4").write_text("not a video")
    stored = {  # pipeline config fields a converted model stores (`convert --format reward-forcing` / `krea`)
        "reward_model": {"attention_window": 9, "sink_frames": 3, "rope_positions": "window", "sink_update": "ema"},
        "krea_model": {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 0.3},
        "rolling_model": {"kv_cache_policy": "rolling"},
    }
    stored["reward_chunk2_model"] = stored["reward_model"]  # the same settings on a student chunking by 2 frames
    stored["rolling_4_steps_model"] = {**stored["rolling_model"], "timesteps": [1000.0, 750.0, 500.0, 250.0]}
    stored["narrow_window_model"] = {"attention_window": 2}  # smaller than its chunks of 3: from_pretrained refuses it
    chunk_sizes = {"reward_model": 3, "reward_chunk2_model": 2, "rolling_4_steps_model": 3, "narrow_window_model": 3}
    for name, settings in stored.items():
        (folder / name).mkdir()
        (folder / name / "model_index.json").write_text(json.dumps({"_class_name": "WanCausalPipeline", **settings}))
        if name in chunk_sizes:  # the transformer config the CLI reads the chunk layout from
            (folder / name / "transformer").mkdir()
            config = {"_class_name": "WanCausalTransformer3DModel", "chunk_size": chunk_sizes[name]}
            (folder / name / "transformer" / "config.json").write_text(json.dumps(config))
    return {path.name: str(path) for path in folder.iterdir()}


GEN = ["generate", "--prompt", "a fox", "--height", "32", "--width", "32"]
# case -> (extra arguments after GEN, exit status, a fragment of the one-line message). `{name}` is a file of `inputs`.
CASES = {
    "frames not 4k+1": (["--num-frames", "8"], 2, "--num-frames must be 4k+1"),
    "frames 0": (["--num-frames", "0"], 2, "--num-frames must be 4k+1"),
    "frames negative": (["--num-frames", "-3"], 2, "--num-frames must be 4k+1"),
    "frames not an int": (["--num-frames", "nine"], 2, "invalid int value: 'nine'"),
    "height 0": (["--height", "0"], 2, "--height must be a positive multiple of 16, got 0"),
    "width not a multiple of 16": (["--width", "50"], 2, "--width must be a positive multiple of 16, got 50"),
    "steps 0": (["--steps", "0"], 2, "`num_inference_steps` must be a positive integer, got 0"),
    "fps 0": (["--fps", "0"], 2, "--fps must be at least 1, got 0"),
    "guidance nan": (["--guidance-scale", "nan"], 2, "`guidance_scale` must be finite, got nan"),
    "guidance inf": (["--guidance-scale", "inf"], 2, "`guidance_scale` must be finite, got inf"),
    "guidance negative": (["--guidance-scale", "-2"], 2, "`guidance_scale` must be a finite number >= 1"),
    "guidance below 1": (["--guidance-scale", "0.5"], 2, "got 0.5"),
    "seed negative": (["--seed", "-1"], 2, "--seed must be in [0, 2**64)"),
    "seed too large": (["--seed", str(2**64)], 2, "--seed must be in [0, 2**64)"),
    "sink without window": (
        ["--sink-frames", "1"],
        2,
        "`sink_frames=1` needs a sliding window: set `attention_window`",
    ),
    "window 0": (["--attention-window", "0"], 2, "`attention_window` must be None or a positive number of latent"),
    "sink fills window": (["--attention-window", "4", "--sink-frames", "4"], 2, "(expected sink_frames < attention"),
    "sink negative": (["--attention-window", "4", "--sink-frames", "-1"], 2, "got -1"),
    "unknown policy": (["--kv-cache-policy", "bogus"], 2, "argument --kv-cache-policy: invalid choice"),
    "rolling with sink": (
        ["--kv-cache-policy", "rolling", "--attention-window", "21", "--sink-frames", "3"],
        2,
        "`kv_cache_policy='rolling'` keeps its first chunk as the sink (the anchor): pass no `sink_frames`",
    ),
    "rolling with positions": (
        ["--kv-cache-policy", "rolling", "--rope-positions", "window"],
        2,
        "`kv_cache_policy='rolling'` positions its keys itself",
    ),
    "rolling with image": (
        ["--kv-cache-policy", "rolling", "--image", "{frame.png}"],
        2,
        "`kv_cache_policy='rolling'` cannot run on WanCausalImageToVideoPipeline: it conditions its chunks by frame",
    ),
    "rolling with input video": (
        ["--kv-cache-policy", "rolling", "--input-video", "{clip9.gif}"],
        2,
        "`kv_cache_policy='rolling'` cannot run on WanCausalVideoToVideoPipeline: the policy replaces the "
        "chunk-by-chunk rollout, which that pipeline does not run. Accepted here: (None, 'sequential', 'recompute'). "
        "(the pipeline of --input-video)",
    ),
    "context without recompute": (
        ["--context-frames", "3"],
        2,
        "`context_frames` needs `kv_cache_policy='recompute'`",
    ),
    "bias too small without recompute": (
        ["--kv-cache-policy", "sequential", "--kv-cache-attention-bias", "0"],
        2,
        "`kv_cache_attention_bias` must be a number in [0.01, 1], got 0.0",
    ),
    "context 0": (["--kv-cache-policy", "recompute", "--context-frames", "0"], 2, "`context_frames` must be >= 1"),
    "bias too small": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--kv-cache-attention-bias", "0.001"],
        2,
        "`kv_cache_attention_bias` must be a number in [0.01, 1]",
    ),
    "keep first frame without recompute": (
        ["--keep-first-frame"],
        2,
        "`keep_first_frame=True` needs `kv_cache_policy",
    ),
    "transition without switch": (["--prompt-transition-chunks", "2"], 2, "needs a --prompt-switch FRAME:PROMPT"),
    "transition negative": (
        ["--prompt-switch", "9:a dog", "--prompt-transition-chunks", "-1"],
        2,
        "`prompt_transition_chunks` must be at least 0, got -1",
    ),
    "switch malformed": (["--prompt-switch", "a dog"], 2, "--prompt-switch must be FRAME:PROMPT"),
    "switch at frame 0": (["--prompt-switch", "0:a dog"], 2, "--prompt-switch must be FRAME:PROMPT"),
    "switch past the video": (
        ["--prompt-switch", "21:a dog"],
        2,
        "The prompt switch at pixel frame 21 is past the last",
    ),
    "switch twice": (["--prompt-switch", "9:a", "--prompt-switch", "9:b"], 2, "names pixel frame 9 twice"),
    "bias above 1": (
        ["--kv-cache-attention-bias", "1.5"],
        2,
        "`kv_cache_attention_bias` must be a number in [0.01, 1]",
    ),
    "bias nan": (
        ["--kv-cache-attention-bias", "nan"],
        2,
        "`kv_cache_attention_bias` must be a number in [0.01, 1], got nan",
    ),
    "recompute with window": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--attention-window", "4"],
        2,
        "`kv_cache_policy='recompute'` bounds the cache itself: it cannot be combined with `attention_window`",
    ),
    "recompute with sink": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--attention-window", "4", "--sink-frames", "1"],
        2,
        "`kv_cache_policy='recompute'` bounds the cache itself",
    ),
    "sink decay 1": (["--sink-update", "ema", "--sink-decay", "1"], 2, "`sink_decay` must be a number in (0, 1)"),
    "kv flush without window": (
        ["--prompt-switch", "9:a dog", "--kv-flush"],
        2,
        "`kv_flush=True` keeps the sink and the last frames of a sliding window: set `attention_window`",
    ),
    "rope cut without switch": (["--rope-cut"], 2, "`rope_cut=True` cuts at every prompt switch"),
    "rope cut at another frame": (
        ["--prompt-switch", "9:a dog", "--rope-cut", "5", "--rope-positions", "window", "--attention-window", "6"],
        2,
        "`rope_cut` frames [5] are not prompt switches",
    ),
    "recache sink keep without recache": (
        ["--prompt-switch", "9:a dog", "--recache-sink", "keep"],
        2,
        "`recache_sink='keep'` says what a recache does with the sink: set `recache=True`",
    ),
    "recache sink keep on a window of other chunks": (
        ["--prompt-switch", "9:a dog", "--recache", "--recache-sink", "keep", "--attention-window", "5"]
        + ["--sink-frames", "1"],
        2,
        "`recache_sink='keep'` re-runs the window's non-sink frames from a chunk boundary",
    ),
    "sink decay without ema": (["--sink-decay", "0.9"], 2, "`sink_decay=0.9` is the decay of the EMA sink: it needs"),
    "sink decay nan": (["--sink-decay", "nan"], 2, "got nan"),
    "ema with absolute": (
        ["--sink-update", "ema", "--rope-positions", "absolute", "--attention-window", "9", "--sink-frames", "3"],
        2,
        "which needs keys stored before RoPE: use rope_positions in ('window', 'anchor'), not 'absolute'",
    ),
    "ema without sink": (
        ["--sink-update", "ema", "--attention-window", "9", "--sink-frames", "0"],
        2,
        "`sink_update='ema'` averages evicted frames into the sink: set `sink_frames` > 0",
    ),
    "rope with recompute": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--rope-positions", "window"],
        2,
        "`kv_cache_policy='recompute'` rebuilds the cache at RoPE positions from 0",
    ),
    "unknown rope positions": (["--rope-positions", "slot"], 2, "invalid choice: 'slot'"),
    # What the pipeline would refuse once loaded, from the flags and the model's stored settings (none: tiny model)
    "recompute without context frames": (
        ["--kv-cache-policy", "recompute"],
        2,
        "`context_frames` must be a positive integer under recompute, got None",
    ),
    "window positions without window": (["--rope-positions", "window"], 2, "set `attention_window` as well"),
    "ema without window": (["--sink-update", "ema"], 2, "set `sink_frames` > 0 (and `attention_window`)"),
    "ema over absolute positions by default": (
        ["--sink-update", "ema", "--attention-window", "9", "--sink-frames", "3"],
        2,
        "needs keys stored before RoPE",
    ),
    "ema with an 8-bit cache": (
        [
            "--sink-update",
            "ema",
            "--rope-positions",
            "window",
            "--attention-window",
            "9",
            "--sink-frames",
            "3",
            "--kv-cache-dtype",
            "int8",
        ],
        2,
        "`sink_update='ema'` cannot be combined with an 8-bit `kv_cache_dtype` ('int8')",
    ),  # fmt: skip
    "stored ema with an 8-bit cache": (
        ["--model", "{reward_model}", "--kv-cache-dtype", "int8"],
        2,
        "8-bit resolution. Use kv_cache_dtype=None or sink_update='fixed'. (--model {reward_model} stores "
        "attention_window=9, sink_frames=3, rope_positions='window', sink_update='ema')",
    ),
    "stored ema under a window without sink": (
        ["--model", "{reward_model}", "--attention-window", "12", "--sink-frames", "0"],
        2,
        "`sink_update='ema'` averages evicted frames into the sink: set `sink_frames` > 0 (and `attention_window`), "
        "or use sink_update='fixed'. (--model {reward_model} stores",
    ),
    "rolling with a prompt switch": (
        ["--kv-cache-policy", "rolling", "--prompt-switch", "9:a dog"],
        2,
        "`kv_cache_policy='rolling'` denoises several chunks in one forward: a prompt schedule",
    ),
    "stored rolling with a prompt switch": (
        ["--model", "{rolling_model}", "--prompt-switch", "9:a dog"],
        2,
        "needs `kv_cache_policy='sequential'`. (--model {rolling_model} stores kv_cache_policy='rolling')",
    ),
    "stored rolling with window positions": (
        ["--model", "{rolling_model}", "--rope-positions", "window", "--attention-window", "9"],
        2,
        "pass no other `rope_positions` / `sink_update`, got 'window' / 'fixed'. (--model {rolling_model} stores",
    ),
    # Krea's recompute does not drive the image-to-video and VACE pipelines
    "recompute with image": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--image", "{frame.png}"],
        2,
        "`kv_cache_policy='recompute'` cannot run on WanCausalImageToVideoPipeline: it conditions its chunks by frame "
        "(an image, a clip, a control video), which the policy cannot read. Accepted here: (None, 'sequential'). (the "
        "pipeline of --image)",
    ),
    "recompute with control video": (
        ["--kv-cache-policy", "recompute", "--context-frames", "3", "--control-video", "{control5.gif}"],
        2,
        "`kv_cache_policy='recompute'` cannot run on WanCausalVACEPipeline: it conditions its chunks by frame",
    ),
    "switch past the input video": (
        ["--input-video", "{clip9.gif}", "--prompt-switch", "15:a dog"],
        2,
        "The prompt switch at pixel frame 15 is past the last chunk, which starts at pixel frame 0",
    ),
    # What the pipeline would refuse about the rollout's chunks once loaded, found from the transformer's chunk layout
    # (the tiny model's, or --model's transformer/config.json) and the stored settings before it loads.
    "window smaller than a chunk": (["--attention-window", "2"], 2, "[0, 3) does not fit the attention window"),
    "rolling with fewer chunks than steps": (
        ["--kv-cache-policy", "rolling", "--num-frames", "9", "--steps", "4"],
        2,
        "needs at least as many chunks as denoising steps: 4 steps, 1 chunks",
    ),
    "stored rolling schedule with fewer chunks": (
        ["--model", "{rolling_4_steps_model}", "--num-frames", "9"],
        2,
        "needs at least as many chunks as denoising steps: 4 steps, 1 chunks",
    ),
    "EMA sink 8/3": (
        [
            "--num-frames",
            "45",
            "--attention-window",
            "8",
            "--sink-frames",
            "3",
            "--sink-update",
            "ema",
            "--rope-positions",
            "window",
        ],
        2,
        "every eviction must remove exactly sink_frames=3 frames; the chunk at latent frame 6 evicts 1",
    ),  # fmt: skip
    "stored EMA sink on chunks of 2": (
        ["--model", "{reward_chunk2_model}"],
        2,
        "every eviction must remove exactly sink_frames=3 frames",
    ),
    "stored settings the model cannot sample": (
        ["--model", "{narrow_window_model}"],
        2,
        "--model {narrow_window_model}: its stored settings cannot be sampled: The chunk of latent frames [0, 3) does "
        "not fit the attention window",
    ),
    "switch past the last chunk without a reference image": (
        ["--num-frames", "17", "--prompt-switch", "5:a dog"],
        2,
        "The prompt switch at pixel frame 5 is past the last chunk, which starts at pixel frame 0",
    ),
    "switch past the last chunk": (
        ["--prompt-switch", "17:a dog"],
        2,
        "The prompt switch at pixel frame 17 is past the",
    ),
    "two switches in one chunk": (
        ["--num-frames", "45", "--prompt-switch", "10:a dog", "--prompt-switch", "13:a cat"],
        2,
        "Two prompt switches take effect at the same chunk (starting at pixel frame 21)",
    ),
    "frames past the RoPE table": (["--num-frames", "4101"], 2, "1026 latent frames run past the transformer's RoPE"),
    "rolling past the RoPE table": (
        ["--kv-cache-policy", "rolling", "--num-frames", "4101"],
        2,
        "1026 latent frames run past the transformer's RoPE table",
    ),
    "clip does not fill whole chunks": (
        ["--video", "{clip9.gif}", "--num-frames", "13"],
        2,
        "`video` encodes to 3 latent frames, which do not fill whole chunks of this rollout (chunks end at latent "
        "frames [1, 4]",
    ),
    "image on a student without a first frame alone": (
        ["--model", "{reward_model}", "--image", "{frame.png}"],
        2,
        "`image` encodes to 1 latent frames, which do not fill whole chunks",
    ),
    "output folder cannot be created": (
        ["--output", "{a_file}.d/" + "x" * 300 + "/video.mp4"],  # a folder name longer than file systems take
        2,
        "cannot create the folder",
    ),
    "missing prompt": ([], 2, "the following arguments are required: --prompt"),  # GEN without --prompt, below
    "unknown dtype": (["--dtype", "float64"], 2, "argument --dtype: invalid choice: 'float64'"),
    "missing image": (["--image", "nope.png"], 2, "--image nope.png: no such file"),
    "image is a folder": (["--image", "{empty_model}"], 2, "no such file"),
    "image does not decode": (["--image", "{notes.png}"], 2, "cannot be read as an image"),
    "missing video": (["--video", "nope.mp4"], 2, "--video nope.mp4: no such file"),
    "clip not 4k+1": (["--video", "{clip4.gif}"], 2, "`video` has 4 frames; a clip must have 4k+1 frames"),
    "clip leaves nothing": (
        ["--video", "{clip9.gif}", "--num-frames", "9"],
        2,
        "`num_frames=9` leaves nothing to generate after the 9 given frames of `video`: ask for more than 9 frames. "
        "(--video {clip9.gif})",
    ),
    "image and video": (["--image", "{frame.png}", "--video", "{clip9.gif}"], 2, "not allowed with argument"),
    "missing control video": (["--control-video", "nope.mp4"], 2, "--control-video nope.mp4: no such file"),
    "missing mask": (["--control-video", "{control5.gif}", "--mask", "nope.mp4"], 2, "--mask nope.mp4: no such"),
    "mask without control": (["--mask", "{control5.gif}"], 2, "--mask needs --control-video"),
    "missing reference": (["--reference-image", "nope.png"], 2, "--reference-image nope.png: no such file"),
    "vace and image": (["--control-video", "{control5.gif}", "--image", "{frame.png}"], 2, "cannot be combined"),
    "control too short": (["--control-video", "{control5.gif}", "--num-frames", "9"], 2, "has 5 frames, fewer"),
    "control wrong size": (["--control-video", "{control9_48.gif}", "--num-frames", "9"], 2, "frames are 48x32"),
    "output .txt": (["--output", "video.txt"], 2, "--output video.txt: extension '.txt'; accepted video formats"),
    "output without extension": (["--output", "video"], 2, "--output video: no extension"),
    "output .webm": (["--output", "video.webm"], 2, "extension '.webm'"),
    "output is a folder": (["--output", "{folder.mp4}"], 2, "is a directory"),
    "output under a file": (["--output", "{a_file}/video.mp4"], 2, "is a file, not a folder"),
    "model dir missing": (["--model", "/no/such/model_dir"], 2, "--model /no/such/model_dir: no such directory"),
    "model relative missing": (["--model", "./no_such_dir"], 2, "--model ./no_such_dir: no such directory"),
    "model dir not a pipeline": (["--model", "{empty_model}"], 2, "not a diffusers pipeline directory"),
    "model is a file": (["--model", "{a_file}"], 2, "no such directory"),
    "hub id not cached offline": (["--model", "some-org/some-student"], 2, "hf download some-org/some-student"),
    "device unknown": (["--device", "gpu"], 2, "--device gpu: not a torch device"),
    "device absent": (["--device", "cuda:99"], 2, "--device cuda:99: not available on this machine"),
    "device meta": (["--device", "meta"], 2, "--device meta: holds no data"),
    "context parallel without torchrun": (["--context-parallel", "ulysses"], 2, "launch with `torchrun"),
    "context parallel mode": (["--context-parallel", "ring"], 2, "invalid choice: 'ring'"),
    "context parallel with VACE": (
        ["--context-parallel", "ulysses", "--control-video", "{control9_48.gif}"],
        2,
        "--context-parallel does not support VACE (--control-video, --mask, --reference-image) yet",
    ),
    "strength without input video": (["--strength", "0.5"], 2, "--strength needs --input-video"),
    "strength 0 without input video": (["--strength", "0"], 2, "--strength needs --input-video"),
    "motion-aware without input video": (["--motion-aware"], 2, "--motion-aware needs --input-video"),
    "missing input video": (["--input-video", "nope.mp4"], 2, "--input-video nope.mp4: no such file"),
    "input video is a folder": (["--input-video", "{empty_model}"], 2, "no such file"),
    "input video does not decode": (["--input-video", "{notes.mp4}"], 2, "cannot be read as a video"),
    "strength above 1": (["--input-video", "{clip9.gif}", "--strength", "1.5"], 2, "--strength must be in [0, 1]"),
    "strength negative": (["--input-video", "{clip9.gif}", "--strength", "-0.1"], 2, "got -0.1"),
    "strength nan": (["--input-video", "{clip9.gif}", "--strength", "nan"], 2, "--strength must be in [0, 1]"),
    "strength not a number": (["--input-video", "{clip9.gif}", "--strength", "high"], 2, "invalid float value"),
    "input video and image": (["--input-video", "{clip9.gif}", "--image", "{frame.png}"], 2, "with --image"),
    "input video and video": (["--input-video", "{clip9.gif}", "--video", "{clip9.gif}"], 2, "with --video"),
    "input video and control": (["--input-video", "{clip9.gif}", "--control-video", "{control5.gif}"], 2, "with"),
    "input video shorter than a chunk": (["--input-video", "{clip4.gif}"], 2, "has 4 frames; the student's first"),
    "input video under num frames": (["--input-video", "{clip9.gif}", "--num-frames", "13"], 2, "fewer than"),
    "input video bad num frames": (["--input-video", "{clip9.gif}", "--num-frames", "8"], 2, "must be 4k+1"),
    # Without --height/--width (NO_SIZE): the output is the video's size, which must be a multiple of 16.
    "input video size not a multiple of 16": (["--input-video", "{input9_50x30.gif}"], 2, "frames are 50x30, not"),
    "input video with height only": (["--input-video", "{clip9.gif}", "--height", "32"], 2, "both --height and"),
}
NO_SIZE = ("input video size not a multiple of 16", "input video with height only")


# Valid command lines that need a model's stored settings (they reach the blocked model import).
CONTROLS = {
    "a stored EMA sink with its window": ["--model", "{reward_model}", "--kv-cache-dtype", "int8", "--sink-update",
                                          "fixed"],
    "a stored recompute context": ["--model", "{krea_model}", "--kv-cache-policy", "recompute"],
    "a stored Reward Forcing cache": ["--model", "{reward_model}", "--attention-window", "12", "--sink-frames", "3"],
    "a wider window over a stored EMA sink (its sink frames stand)": ["--model", "{reward_model}",
                                                                      "--attention-window", "12"],
    "a stored EMA sink on its chunks": ["--model", "{reward_model}"],
    "a stored rolling schedule with enough chunks": ["--model", "{rolling_4_steps_model}", "--num-frames", "45"],
    "video past the RoPE table with window positions": ["--num-frames", "4101", "--attention-window", "9",
                                                        "--rope-positions", "window"],
    "an output folder to create": ["--output", "new/folder/video.mp4"],
    # a reference image is a latent frame before the video: 17 frames are chunks of latent frames [0, 3), [3, 6), so
    # a chunk starts at pixel frame 5
    "a switch at a chunk that a reference image moves": ["--reference-image", "{frame.png}", "--num-frames", "17",
                                                         "--prompt-switch", "5:a dog"],
}  # fmt: skip


def argv_with_inputs(argv: list[str], inputs: dict[str, str]) -> list[str]:
    for name, path in inputs.items():
        argv = [arg.replace(f"{{{name}}}", path) for arg in argv]
    return argv


def argv_of(case: str, inputs: dict[str, str]) -> list[str]:
    extra = argv_with_inputs(list(CASES[case][0]), inputs)
    if case in NO_SIZE:
        return ["generate", "--prompt", "a fox", *extra]
    return ["generate", *extra] if case == "missing prompt" else [*GEN, *extra]


@pytest.fixture(scope="module")
def table_results(inputs, tmp_path_factory) -> dict[str, list]:
    tmp_path = tmp_path_factory.mktemp("table")
    table = {case: argv_of(case, inputs) for case in CASES}
    table["control: a valid command line reaches the model"] = [*GEN, "--num-frames", "5"]
    table["control: a valid --input-video reaches the model"] = [*GEN, "--input-video", inputs["clip9.gif"]]
    for control, argv in CONTROLS.items():
        table[f"control: {control} reaches the model"] = [*GEN, *argv_with_inputs(argv, inputs)]
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-c", BLOCKED_TABLE],
        input=json.dumps(table),
        capture_output=True,
        text=True,
        env=cli_env(tmp_path),
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    print(f"{len(table)} command lines checked in {time.perf_counter() - start:.1f} s (one interpreter)")
    return json.loads(completed.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_command_line_is_one_line_before_any_model_loads(case, table_results, inputs):
    status, stderr, _ = table_results[case]
    _, expected_status, fragment = CASES[case]
    (fragment,) = argv_with_inputs([fragment], inputs)
    assert status == expected_status, stderr
    assert "Traceback" not in stderr and "No module named" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fastgen-diffusers generate: error: ") and fragment in lines[0], lines[0]


@pytest.mark.parametrize("control", ["a valid command line", "a valid --input-video", *CONTROLS])
def test_the_model_modules_are_really_blocked(table_results, control):
    """The control cases: a valid command line gets past every check and fails on the blocked import."""
    status, stderr, _ = table_results[f"control: {control} reaches the model"]
    assert status == "raised" and "Traceback" in stderr
    assert any(f"No module named '{module}" in stderr for module in MODEL_MODULES), stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--num-frames", "8"], "--num-frames must be 4k+1"),
        (["--output", "video.txt"], "extension '.txt'"),
        (["--model", "some-org/some-student"], "hf download some-org/some-student"),
        (["--strength", "0.5"], "--strength needs --input-video"),
    ],
)
def test_console_entry_prints_one_line_and_exits_non_zero(args, fragment, tmp_path):
    completed = run_console([*GEN, *args], tmp_path)
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert completed.stderr.count("\n") == 1 and fragment in completed.stderr
    assert completed.stdout == ""


def test_version_from_both_module_entries(tmp_path):
    """``python -m fastgen_diffusers.cli`` and ``python -m fastgen_diffusers`` are the console entry."""
    from fastgen_diffusers import __version__

    completed = subprocess.run(
        [sys.executable, "-m", "fastgen_diffusers.cli", "--version"],
        capture_output=True, text=True, env=cli_env(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0 and completed.stdout.strip() == f"fastgen-diffusers {__version__}"
    completed = run_console(["--version"], tmp_path)
    assert completed.returncode == 0 and completed.stdout.strip() == f"fastgen-diffusers {__version__}"


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]])
def test_help_is_fast_and_imports_no_heavy_module(args, tmp_path):
    """``--help`` never imports the heavy stack (torch, diffusers, transformers), which is what keeps it fast; the
    time of the console script is printed, not asserted (timings belong to benchmarks, not to a shared CI box)."""
    probe = (
        "import runpy, sys\n"
        "sys.argv[0] = 'fastgen-diffusers'\n"
        "try:\n"
        "    runpy.run_module('fastgen_diffusers', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    print('HEAVY', sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=cli_env(tmp_path), cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr
    assert "usage: fastgen-diffusers" in completed.stdout and "HEAVY []" in completed.stdout
    start = time.perf_counter()
    completed = run_console(args, tmp_path, block_models=False)
    assert completed.returncode == 0 and "usage: fastgen-diffusers" in completed.stdout
    print(f"`fastgen-diffusers {' '.join(args)}`: {time.perf_counter() - start:.2f} s")


def test_pipeline_errors_are_one_line_with_status_1_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    """An error the pipeline finds after loading (here: a clip that does not fill whole chunks of the tiny I2V
    student's [1, 3, 3, ...] layout, with the CLI's pre-load layout check switched off) is one line too; ``--debug``
    prints its traceback as well, same status."""
    monkeypatch.setattr(cli, "check_rollout_layout", lambda args, given: None)
    clip = write_video(tmp_path / "clip9.gif", 9)
    args = [*GEN, "--video", str(clip), "--num-frames", "13", "--steps", "1", "--output", str(tmp_path / "o.mp4")]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`video` encodes to 3 latent frames" in err and "--debug" in err
    assert cli.main([*args, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "do not fill whole chunks" in err


def test_debug_keeps_the_usage_status(capsys):
    """``--debug`` adds the traceback of a bad command line but keeps its exit status 2."""
    assert cli.main([*GEN, "--guidance-scale", "nan", "--output", "o.mp4", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "guidance" in err


def test_real_bugs_keep_their_traceback(monkeypatch):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "run_generate", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main([*GEN])


@pytest.mark.parametrize("extension", VIDEO_EXTENSIONS)
def test_every_accepted_extension_writes_a_readable_video(extension, tmp_path):
    """The formats ``--output`` accepts are written by both writers the CLI uses and read back frame for frame."""
    from diffusers.utils import export_to_video

    frames = [np.full((32, 32, 3), value, dtype=np.float32) for value in (0.0, 0.5, 1.0, 0.25, 0.75)]
    export_to_video(frames, str(tmp_path / f"export{extension}"), fps=8)
    with imageio.get_writer(tmp_path / f"stream{extension}", fps=8) as writer:
        for frame in frames:
            writer.append_data((frame * 255).astype(np.uint8))
    for name in ("export", "stream"):
        read = imageio.mimread(tmp_path / f"{name}{extension}")
        assert len(read) == len(frames) and read[0].shape[:2] == (32, 32)


def test_cli_context_parallel_modes_match_the_library():
    from fastgen_diffusers.parallel import CONTEXT_PARALLEL_MODES

    assert cli.CONTEXT_PARALLEL_MODES == CONTEXT_PARALLEL_MODES


def test_lazy_package_exports_every_public_name_without_importing_torch(tmp_path):
    """``import fastgen_diffusers`` imports no torch (a fresh interpreter shows it); every name of ``__all__`` then
    resolves (here, where torch is loaded anyway: resolving them imports the stack)."""
    from diffusers.models.modeling_utils import ModelMixin

    import fastgen_diffusers as package

    probe = "import sys, fastgen_diffusers\nprint(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(tmp_path), cwd=tmp_path
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "[]", completed.stderr
    assert sorted(package.__all__) == sorted(package._EXPORTS), "keep __all__ and _EXPORTS in step"
    assert [name for name in package.__all__ if getattr(package, name, None) is None] == []
    assert package.ModelMixin is ModelMixin and getattr(package, "SchedulerMixin", None) is None
    assert package.pipelines.WanCausalPipeline is package.WanCausalPipeline


@pytest.mark.parametrize("guidance", [-1.0, 0.0, 1e-3, 0.5, 0.999, 1.0, 1.5, 7.0, float("nan"), float("inf")])
def test_cli_and_pipelines_take_the_same_guidance_scales(guidance, tmp_path):
    """``--guidance-scale`` and ``guidance_scale=`` accept the same values (0 or 1: no guidance, or above 1), with the
    same message: the CLI's check is the settings' own."""
    from fastgen_diffusers.cli.checks import UsageError, generate_settings
    from fastgen_diffusers.pipelines.rollout.validation import validate_call_arguments

    args = cli.build_parser().parse_args(
        [*GEN, "--guidance-scale", str(guidance), "--output", str(tmp_path / "o.mp4")]
    )
    try:
        generate_settings(args)
        cli_refusal = None
    except UsageError as error:
        cli_refusal = str(error)
    try:
        validate_call_arguments({"guidance_scale": guidance})
        python_refusal = None
    except ValueError as error:
        python_refusal = str(error)
    assert cli_refusal == python_refusal
    assert (cli_refusal is None) == (guidance in (0.0, 1.0, 1.5, 7.0)), cli_refusal


def test_guidance_scale_0_runs_as_1():
    """0 is diffusers' value for a distilled model: no classifier-free guidance, one forward per step, as 1."""
    import torch

    from fastgen_diffusers.testing import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    call = {"prompt_embeds": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0)), "height": 16}
    call |= {"width": 16, "num_frames": 9, "num_inference_steps": 1, "output_type": "latent"}
    zero = pipe(**call, guidance_scale=0.0, generator=torch.Generator().manual_seed(1)).frames
    one = pipe(**call, guidance_scale=1.0, generator=torch.Generator().manual_seed(1)).frames
    assert torch.equal(zero, one)


def test_the_output_check_leaves_no_folder_behind(tmp_path):
    """``--output`` under folders that do not exist yet: the check creates them to prove it can, then removes them
    (the run makes them again once the video is written)."""
    from fastgen_diffusers.cli.checks import check_output

    check_output(tmp_path / "new" / "folder" / "video.mp4")
    assert list(tmp_path.iterdir()) == []
