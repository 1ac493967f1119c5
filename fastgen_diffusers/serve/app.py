"""The FastAPI app of ``fastgen-diffusers serve``: the page, ``/health`` and the session WebSocket ``/ws``.

Protocol of ``/ws`` (one connection is one session). Client to server, JSON text messages::

    {"type": "start", "prompt": str, "settings": {...}, "num_frames": int | null, "input": "text" | "video"}
    {"type": "prompt", "prompt": str, "transition_chunks": int}      # from the next chunk on
    {"type": "stop"}

and, with ``"input": "video"``, the input frames as binary JPEG messages. Server to client::

    {"type": "waiting", "frames": n, "height": h, "width": w}       # video input: send frames; it starts after n
    {"type": "started", "settings": {...the resolved values...}}
    {"type": "chunk", "index": k, "frames": n, "frame_start": f, "height": h, "width": w, "latency_ms": ms,
     "cache_bytes": b}                                               # the session's KV cache after the chunk
        followed by its n frames as binary messages (JPEG, or RGB bytes with "encoding": "raw")
    {"type": "prompt", "prompt": str, "index": k}                    # the chunk a prompt change takes effect at
    {"type": "dropped", "index": k, "chunks": n, "frames": f, "reason": "slow_client" | "prompt"}
        # chunks never sent: "slow_client": "drop" and the client lagged (one message for a run of them), or queued
        # under the old prompt when a prompt change arrived
    {"type": "error", "message": str, "fatal": bool}
    {"type": "stopped"}

Bad input never ends the server or another session: each bad message gets an ``error`` and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from contextlib import asynccontextmanager
from functools import partial
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse

from ..cli.common import one_line
from .jpeg import decode_jpeg
from .sessions import MAX_PROMPT_CHARS, SessionManager, post_from_thread
from .settings_json import session_settings

MAX_TEXT_BYTES = 64 * 1024
MAX_BINARY_BYTES = 4 * 1024 * 1024
# replies to bad messages wait at most this many messages to be sent: a client that floods without reading gets no more
MAX_QUEUED_REPLIES = 64
# The WebSocket layer's own limit (uvicorn's ``ws_max_size``): a message over it never reaches the app, the connection
# is closed with code 1009 and a reason naming the limit (the session then ends as on a disconnect).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
INPUTS = ("text", "video")
_background: set[asyncio.Task] = set()  # closes in flight (a task needs a reference while it runs)
MESSAGE_TYPES = ("start", "prompt", "stop")


def _error(message: str, fatal: bool = False) -> dict[str, Any]:
    return {"type": "error", "message": message, "fatal": fatal}


def _token_ok(expected: str | None, given: str | None) -> bool:
    return expected is None or (given is not None and secrets.compare_digest(expected, given))


def _origin_ok(websocket: WebSocket, allowed: tuple[str, ...]) -> bool:
    """A browser's connection must come from the page's own origin (or one of ``allowed``); clients that send no
    ``Origin`` (not browsers) pass."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    host = websocket.headers.get("host", "")
    return origin in allowed or origin in (f"http://{host}", f"https://{host}")


def create_app(
    manager: SessionManager,
    model_name: str,
    device: str,
    token: str | None = None,
    allowed_origins: tuple[str, ...] = (),
    max_pending_frames: int = 64,
) -> FastAPI:
    """The server app over ``manager``; ``token``: every request to ``/ws`` and ``/health`` must carry
    ``?token=...``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(manager.stop_all)

    app = FastAPI(title="fastgen-diffusers serve", lifespan=lifespan)
    app.state.manager = manager

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if not _token_ok(token, request.query_params.get("token")):
            return JSONResponse({"error": "a valid ?token= is required"}, status_code=403)
        return JSONResponse({"model": model_name, "device": device, **manager.health()})

    @app.websocket("/ws")
    async def session_socket(websocket: WebSocket) -> None:
        if not _token_ok(token, websocket.query_params.get("token")) or not _origin_ok(websocket, allowed_origins):
            await websocket.close(code=1008)  # before accept: the handshake is refused (HTTP 403)
            return
        await websocket.accept()
        outbox: asyncio.Queue = asyncio.Queue()
        try:
            session = manager.open(post_from_thread(asyncio.get_running_loop(), outbox))
        except ValueError as error:
            await websocket.send_json(_error(str(error), fatal=True))
            await websocket.close()
            return
        session.outbox = outbox
        sender = asyncio.create_task(_send(websocket, outbox, session, manager))
        sender.add_done_callback(partial(_close_on_failure, websocket))
        try:
            await _receive(websocket, session, manager, max_pending_frames)
        except WebSocketDisconnect:
            pass
        finally:
            manager.close(session)
            sender.cancel()

    return app


async def _send(websocket: WebSocket, outbox: asyncio.Queue, session, manager: SessionManager) -> None:
    """Send what the worker posts, in order; a chunk purged while it waited (a restart, a stop, a prompt change) is
    skipped. Each send waits for the client (the transport's flow control): a slow client holds up only this loop."""
    try:
        while True:
            item = await outbox.get()
            if item[0] == "json":
                await websocket.send_json(item[1])
                continue
            if item[0] == "dropped":
                notice = manager.take_drop_notice(session)
                if notice is not None:
                    await websocket.send_json(notice)
                continue
            slot = item[1]
            encode = manager.take_chunk(session, slot)
            if encode is None:
                continue
            try:
                try:
                    frames = await asyncio.to_thread(encode)  # the chunk's encoding, off the event loop
                except Exception as error:  # noqa: BLE001  (a failing encoder ends this session, told so)
                    message = f"Encoding chunk {slot.meta['index']} failed: {one_line(error)}"
                    await websocket.send_json(_error(message, fatal=True))
                    await websocket.close(code=1011)
                    return
                await websocket.send_json(slot.meta)
                for frame in frames:
                    await websocket.send_bytes(frame)
            finally:
                manager.chunk_sent(session)
    except (WebSocketDisconnect, RuntimeError):  # the client left; the receive loop closes the session
        pass


def _close_on_failure(websocket: WebSocket, sender: asyncio.Task) -> None:
    """The sender ended on an error it did not handle: close the connection (its session then ends) rather than leave
    a session whose chunks are never sent."""
    if not sender.cancelled() and sender.exception() is not None:
        _background.add(task := asyncio.ensure_future(_close_quietly(websocket)))
        task.add_done_callback(_background.discard)


async def _close_quietly(websocket: WebSocket) -> None:
    try:
        await websocket.close(code=1011)
    except Exception:  # noqa: BLE001  (already closed)
        pass


async def _receive(websocket: WebSocket, session, manager: SessionManager, max_pending_frames: int) -> None:
    async def reply(message: dict[str, Any]) -> None:
        if session.outbox.qsize() < MAX_QUEUED_REPLIES:
            session.post(("json", message))

    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data, text = message.get("bytes"), message.get("text")
        if data is not None:
            if len(data) > MAX_BINARY_BYTES:
                await reply(_error(f"A binary message may hold at most {MAX_BINARY_BYTES} bytes, got {len(data)}."))
            elif session.input_size is None:
                await reply(_error('Binary messages are video frames: start a session with "input": "video".'))
            else:
                try:
                    frame = await asyncio.to_thread(decode_jpeg, data, session.input_size)
                except ValueError as error:
                    await reply(_error(str(error)))
                else:
                    manager.add_frame(session, frame, max_pending_frames)
            continue
        if text is None:
            continue
        if len(text.encode()) > MAX_TEXT_BYTES:
            await reply(_error(f"A text message may hold at most {MAX_TEXT_BYTES} bytes, got {len(text.encode())}."))
            continue
        try:
            handle_text(text, session, manager)
        except ValueError as error:
            await reply(_error(one_line(error)))


def _prompt_of(message: dict[str, Any]) -> str:
    prompt = message.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"`prompt` must be a non-empty string, got {prompt!r}.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"`prompt` may hold at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}.")
    return prompt


def handle_text(text: str, session, manager: SessionManager) -> None:
    """Check one client text message and hand it to the worker.

    Raises:
        ValueError: the message is not JSON, not an object, of an unknown type, or has a bad field (the settings'
            own message for a bad setting).
    """
    try:
        message = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"A text message must be JSON ({error.msg} at character {error.pos}).") from None
    if not isinstance(message, dict):
        raise ValueError(f"A message must be a JSON object, got {type(message).__name__}.")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        raise ValueError(f"Unknown message type {kind!r}; accepted: {list(MESSAGE_TYPES)}.")
    if kind == "stop":
        manager.request_stop(session)
        return
    prompt = _prompt_of(message)
    if kind == "prompt":
        transition = message.get("transition_chunks")
        if transition is not None and (isinstance(transition, bool) or not isinstance(transition, int)):
            raise ValueError(f"`transition_chunks` must be a whole number of chunks or null, got {transition!r}.")
        if transition is not None and transition < 0:
            raise ValueError(f"`transition_chunks` must be >= 0, got {transition}.")
        if not session.running and session.start_request is None:
            raise ValueError("No stream runs: send a `start` message first.")
        manager.request_prompt(session, prompt, transition)
        return
    source = message.get("input", "text")
    if source not in INPUTS:
        raise ValueError(f"`input` must be one of {list(INPUTS)}, got {source!r}.")
    num_frames = message.get("num_frames")
    if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1):
        raise ValueError(f"`num_frames` must be a positive whole number or null (endless), got {num_frames!r}.")
    if num_frames is not None and num_frames > manager.max_frames:
        raise ValueError(
            f"`num_frames` may be at most {manager.max_frames} (--max-frames), got {num_frames}; null streams until "
            "`stop`."
        )
    settings = session_settings(
        message.get("settings"), manager.session_defaults, manager.rollout_defaults, video=source == "video"
    )
    video = source == "video"
    session.input_size = (settings.height, settings.width) if video else None  # the event loop's own field
    manager.request_start(session, {"prompt": prompt, "settings": settings, "num_frames": num_frames, "input": source})
    if video:  # the stream starts once the first chunk's frames are in
        waiting = {"type": "waiting", "frames": manager.frames_needed(0), "height": settings.height,
                   "width": settings.width}  # fmt: skip
        session.post(("json", waiting))
