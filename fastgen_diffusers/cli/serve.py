"""``fastgen-diffusers serve``: the real-time session server and its web page (needs the ``serve`` extra).

Building the parser imports nothing heavy; FastAPI, uvicorn and torch load when the command runs.
"""

from __future__ import annotations

import argparse

from ..serve.defaults import DEFAULT_ENDLESS_WINDOW, MAX_FRAMES, MAX_SESSIONS
from ..settings import RolloutSettings, SamplingSettings
from .checks import UsageError
from .common import DTYPES
from .decoder import add_decoder_arguments, check_decoder_arguments, use_decoder

SERVE_MODULES = ("fastapi", "uvicorn")


def add_serve_subparser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve``: a WebSocket session server with a web page, streaming video as it is generated."""
    parser = subparsers.add_parser(
        "serve",
        help="serve live generation to a web page (WebSocket sessions)",
        description="Serve a causal Wan student to browsers: open http://HOST:PORT/, type a prompt, watch the video "
        "as it is generated, change the prompt live, or restyle your camera (video-to-video). Without --model, serves "
        "the built-in tiny model with random weights (offline). Binds to loopback unless --host says otherwise; use "
        "--token when it does.",
    )
    parser.add_argument("--model", help="diffusers Wan directory or Hub id (default: the tiny random model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    parser.add_argument("--token", help="a secret every connection must present as ?token=... (open the page so)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, help="model dtype of --model")
    parser.add_argument(
        "--steps", type=int, help=RolloutSettings.help_of("num_inference_steps") + " A session may ask for others."
    )
    parser.add_argument(
        "--cache-budget-gb",
        type=float,
        help="KV-cache memory all sessions may hold together; a session that does not fit is refused (default: 80%% "
        "of the GPU memory free after loading, 4 GiB on a CPU)",
    )
    parser.add_argument(
        "--max-sessions", type=int, default=MAX_SESSIONS, help=f"sessions served at once (default: {MAX_SESSIONS})"
    )
    parser.add_argument(
        "--max-frames",
        type=int,
        default=MAX_FRAMES,
        help=f"the most frames a session may ask for (default: {MAX_FRAMES})",
    )
    parser.add_argument(
        "--endless-window",
        type=int,
        default=DEFAULT_ENDLESS_WINDOW,
        help="latent frames of the sliding attention window an endless stream (num_frames: null) gets when its "
        f"settings leave the KV cache unbounded (default: {DEFAULT_ENDLESS_WINDOW}); 0: refuse such a stream",
    )
    parser.add_argument(
        "--allow-origin", action="append", default=[], help="another page origin allowed to open sessions (repeatable)"
    )
    add_decoder_arguments(parser, serves="text and video-to-video sessions: the streams' frames and the camera's")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    parser.set_defaults(func=run_serve)


def check_serve_arguments(args: argparse.Namespace) -> None:
    """Refuse a bad command line before anything loads."""
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {args.port}.")
    try:  # the settings' own check of the step count
        SamplingSettings(num_inference_steps=args.steps)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.max_sessions < 1:
        raise UsageError(f"--max-sessions must be >= 1, got {args.max_sessions}.")
    if args.max_frames < 1:
        raise UsageError(f"--max-frames must be >= 1, got {args.max_frames}.")
    if args.endless_window < 0:
        raise UsageError(f"--endless-window must be >= 0 (0: refuse an endless stream with an unbounded cache), got "
                         f"{args.endless_window}.")  # fmt: skip
    if args.cache_budget_gb is not None and args.cache_budget_gb <= 0:
        raise UsageError(f"--cache-budget-gb must be > 0, got {args.cache_budget_gb}.")
    if args.token is not None and not args.token:
        raise UsageError("--token must not be empty.")
    check_decoder_arguments(args, conditioned=False)  # sessions are text or video-to-video, never image / VACE
    missing = []
    for module in SERVE_MODULES:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UsageError(f'`serve` needs {", ".join(missing)}: pip install "fastgen-diffusers[serve]".')


def run_serve(args: argparse.Namespace) -> int:
    """Check the flags, load the model, serve until Ctrl-C."""
    check_serve_arguments(args)
    from ..serve.server import ServeConfig, build_server, load_pipeline

    config = ServeConfig(
        model=args.model, host=args.host, port=args.port, token=args.token, device=args.device, dtype=args.dtype,
        cache_budget_gb=args.cache_budget_gb, max_sessions=args.max_sessions, max_frames=args.max_frames,
        steps=args.steps, allowed_origins=tuple(args.allow_origin), endless_window=args.endless_window or None,
    )  # fmt: skip
    if args.model is None:
        print("No --model given: serving the built-in tiny model with RANDOM weights (the video is noise).")
    pipe, name, device = load_pipeline(config.model, config.device, config.dtype)
    pipe = use_decoder(pipe, args)  # --decoder taehv PATH: the tiny autoencoder as the VAE
    query = "" if args.token is None else "?token=..."
    banner = f"Serving on http://{args.host}:{args.port}/{query} (Ctrl-C stops)"
    server = build_server(config, pipe, name, device, banner=banner)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C again once it has shut down: stopping is the normal end
        pass
    print("Server stopped.")
    return 0
