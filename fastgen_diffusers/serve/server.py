"""Run the session server: load the pipeline, build the app, serve it with uvicorn until Ctrl-C.

On Ctrl-C (or SIGTERM) every session is stopped first (each client is told ``stopped``, the caches are freed), then
uvicorn closes the connections and releases the port.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..settings import RolloutSettings
from .app import MAX_MESSAGE_BYTES, create_app
from .defaults import DEFAULT_ENDLESS_WINDOW, MAX_FRAMES, MAX_SESSIONS
from .sessions import SessionManager

TINY_DEFAULTS = {"height": 64, "width": 64}
MODEL_DEFAULTS = {"height": 480, "width": 832}


@dataclass
class ServeConfig:
    """What ``fastgen-diffusers serve`` was asked for (the CLI's flags)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 7860
    token: str | None = None
    device: str | None = None
    dtype: str | None = None
    cache_budget_gb: float | None = None
    max_sessions: int = MAX_SESSIONS
    max_frames: int = MAX_FRAMES
    endless_window: int | None = DEFAULT_ENDLESS_WINDOW  # None: refuse an endless stream with an unbounded cache
    steps: int | None = None  # None: the model's stored schedule (4 steps without one)
    allowed_origins: tuple[str, ...] = ()


class SessionServer(uvicorn.Server):
    """uvicorn's server, stopping the sessions (telling each client ``stopped``) before it closes connections."""

    def __init__(self, config: uvicorn.Config, manager: SessionManager, banner: str | None = None) -> None:
        super().__init__(config)
        self.manager = manager
        self.banner = banner  # printed once the port listens

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, flush=True)

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.manager.stop_all)
        await asyncio.sleep(0.2)  # let the senders hand out the `stopped` messages
        await super().shutdown(sockets)


def load_pipeline(model: str | None, device: str | None, dtype: str | None) -> tuple[Any, str, str]:
    """``(pipe, model name, device)``: the model at ``model`` (a diffusers directory or Hub id), or the built-in tiny
    random model."""
    from .. import testing
    from ..cli.common import device_and_dtype, vae_in_float32
    from ..pipelines import WanCausalPipeline

    torch_device, torch_dtype = device_and_dtype(device, dtype)
    if model is None:
        pipe, name = testing.tiny_pipeline(), "tiny (random weights)"
    else:
        pipe, name = WanCausalPipeline.from_pretrained(model, dtype=torch_dtype), model
    pipe = vae_in_float32(pipe.to(torch_device))
    pipe.set_progress_bar_config(disable=True)
    return pipe, name, device or str(torch_device)


def default_budget_bytes(device: str, fraction: float = 0.8) -> int:
    """The cache budget when none is given: ``fraction`` of the GPU's free memory after loading, 4 GiB on a CPU."""
    import torch

    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * fraction)
    return 4 * 2**30


def build_server(
    config: ServeConfig, pipe=None, model_name: str = "", device: str = "", banner: str | None = None
) -> SessionServer:
    """The server for ``config`` (``pipe`` given: serve it instead of loading ``config.model``); ``banner`` is
    printed once it listens."""
    if pipe is None:
        pipe, model_name, device = load_pipeline(config.model, config.device, config.dtype)
    session_defaults = {**(TINY_DEFAULTS if config.model is None else MODEL_DEFAULTS), "seed": 0, "strength": 0.8}
    rollout_defaults = RolloutSettings.from_arguments(num_inference_steps=config.steps)  # None: the model's schedule
    budget = default_budget_bytes(device) if config.cache_budget_gb is None else int(config.cache_budget_gb * 2**30)
    manager = SessionManager(
        pipe,
        session_defaults,
        rollout_defaults,
        budget,
        max_frames=config.max_frames,
        max_sessions=config.max_sessions,
        endless_window=config.endless_window,
    )
    app = create_app(manager, model_name, device, token=config.token, allowed_origins=config.allowed_origins)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", ws_max_size=MAX_MESSAGE_BYTES, lifespan="on"
    )
    return SessionServer(uv_config, manager, banner)


@contextmanager
def serving_in_thread(server: SessionServer, timeout: float = 60) -> Iterator[str]:
    """Run ``server`` in a background thread (tests, benchmarks, notebooks); yields ``"host:port"`` once it listens
    (with ``port=0`` in its config, a free port the system picked) and stops it (sessions told ``stopped``, the port
    released) on exit."""
    thread = threading.Thread(target=server.run, name="fastgen-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("The session server did not start (see its log).")
        time.sleep(0.02)
    try:
        host, port = server.servers[0].sockets[0].getsockname()[:2]  # the port bound (a config's port 0: a free one)
        yield f"{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
