"""``fastgen-diffusers serve``: the command line, and Ctrl-C stopping a running server cleanly."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from fastgen_diffusers.cli import build_parser, main

pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from serve_helpers import PROMPT, SETTINGS, free_port, receive_chunks, receive_until  # noqa: E402


def test_serve_is_a_subcommand_with_loopback_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.token, args.model) == ("127.0.0.1", 7860, None, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "0"], "--port"),
        (["--steps", "0"], "`num_inference_steps` must be a positive integer, got 0"),
        (["--cache-budget-gb", "-1"], "--cache-budget-gb"),
        (["--endless-window", "-1"], "--endless-window"),
        (["--decoder", "taesd", "taew2_1.pth"], "--decoder KIND must be one of taehv, got 'taesd'"),
        (["--decoder", "taehv", "missing/taew2_1.pth"], "--decoder taehv missing/taew2_1.pth: no such file"),
    ],
)
def test_bad_serve_flags_exit_2_before_anything_loads(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def _serve(port: int, *flags: str) -> subprocess.Popen:
    """``fastgen-diffusers serve`` in its own process, once it listens on ``port``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "fastgen_diffusers", "serve", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    for line in process.stdout:
        if "Serving on" in line:
            break
    return process


def test_ctrl_c_tells_sessions_stopped_and_releases_the_port(tmp_path):
    port = free_port()
    process = _serve(port)
    try:

        async def session():
            async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
                message = {"type": "start", "prompt": PROMPT, "settings": SETTINGS, "num_frames": None}
                await ws.send(json.dumps(message))
                await receive_chunks(ws, 1)
                process.send_signal(signal.SIGINT)
                return (await receive_until(ws, "stopped", timeout=60))[-1]

        assert asyncio.run(session()) == {"type": "stopped"}
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Server stopped." in process.stdout.read()
    with socket.socket() as sock:  # the port is free again (for a server, which reuses TIME_WAIT addresses)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_serve_streams_through_the_tiny_decoder_of_decoder_taehv(tmp_path):
    """``serve --decoder taehv PATH`` loads a released-layout TAEHV file (any name) as the pipeline's autoencoder:
    ``/health`` names it and a session's chunks arrive decoded by it."""
    import torch
    from serve_helpers import health

    from fastgen_diffusers.testing import taehv_released_state_dict

    weights = tmp_path / "renamed_decoder.pth"
    torch.save(taehv_released_state_dict(), weights)
    port = free_port()
    process = _serve(port, "--decoder", "taehv", str(weights))
    try:
        assert health(f"127.0.0.1:{port}")["decoder"] == "AutoencoderTinyWan"

        async def session():
            async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
                message = {"type": "start", "prompt": PROMPT, "settings": SETTINGS, "num_frames": 21}
                await ws.send(json.dumps(message))
                return await receive_chunks(ws, 2)

        chunks = asyncio.run(session())
        assert [len(frames) for _, frames in chunks] == [9, 12]  # chunks of 3 latent frames: 4 * 3 - 3, then 4 * 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_the_serve_defaults_agree_everywhere():
    """The command line, ServeConfig and SessionManager take one set of defaults (serve/defaults.py)."""
    import inspect

    from fastgen_diffusers.cli.common import DTYPES
    from fastgen_diffusers.serve import defaults
    from fastgen_diffusers.serve.server import ServeConfig
    from fastgen_diffusers.serve.sessions import SessionManager

    args = build_parser().parse_args(["serve"])
    config, manager = ServeConfig(), inspect.signature(SessionManager).parameters
    for name, value in [("max_sessions", defaults.MAX_SESSIONS), ("max_frames", defaults.MAX_FRAMES),
                        ("endless_window", defaults.DEFAULT_ENDLESS_WINDOW)]:  # fmt: skip
        assert getattr(args, name) == getattr(config, name) == manager[name].default == value, name
    (dtype,) = [a for a in build_parser()._actions if getattr(a, "choices", None)]
    (flag,) = [a for a in dtype.choices["serve"]._actions if "--dtype" in a.option_strings]
    assert tuple(flag.choices) == DTYPES
