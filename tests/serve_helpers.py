"""A real session server on a free loopback port, serving the tiny model, for the serve tests and benchmark."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from contextlib import contextmanager

from fastgen_diffusers import testing
from fastgen_diffusers.serve.server import ServeConfig, build_server, serving_in_thread

PROMPT = "a red fox running through snow"
SETTINGS = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 7}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(pipe=None, **config):
    """``(address, server)`` of a server on a free loopback port in a background thread, stopped on exit."""
    pipe = testing.tiny_pipeline() if pipe is None else pipe
    server = build_server(ServeConfig(port=0, **config), pipe=pipe, model_name="tiny", device="cpu")
    with serving_in_thread(server) as address:
        yield address, server


def health(address: str, token: str | None = None) -> dict:
    query = "" if token is None else f"?token={token}"
    with urllib.request.urlopen(f"http://{address}/health{query}", timeout=10) as response:
        return json.loads(response.read())


async def receive_message(ws, timeout: float = 60):
    """The next message: a dict for JSON text, bytes for a frame."""
    message = await asyncio.wait_for(ws.recv(), timeout)
    return message if isinstance(message, bytes) else json.loads(message)


async def receive_until(ws, kind: str, timeout: float = 60) -> list:
    """Messages up to and including the first JSON message of type ``kind`` (frames included)."""
    messages = []
    while True:
        message = await receive_message(ws, timeout)
        messages.append(message)
        if isinstance(message, dict) and message["type"] == kind:
            return messages


async def receive_chunks(ws, count: int, timeout: float = 60) -> list[tuple[dict, list[bytes]]]:
    """The next ``count`` chunks as ``(meta, frames)``; other JSON messages are skipped, errors raise."""
    chunks = []
    while len(chunks) < count:
        message = await receive_message(ws, timeout)
        if isinstance(message, bytes):
            raise AssertionError("a frame arrived outside a chunk")
        if message["type"] == "error":
            raise AssertionError(message["message"])
        if message["type"] == "stopped":
            raise AssertionError(f"stopped after {len(chunks)} chunks")
        if message["type"] != "chunk":
            continue
        frames = [await receive_message(ws, timeout) for _ in range(message["frames"])]
        chunks.append((message, frames))
    return chunks


def throttle_sends(server, send_buffer: int = 8192) -> None:
    """Give the server's connections small kernel send buffers (accepted sockets inherit the listening socket's), so
    that a client that stops reading holds up the server's sends after a few frames rather than megabytes."""
    for sock in server.servers[0].sockets:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)


def slow_reader(address: str, receive_buffer: int = 4096):
    """``websockets.connect`` to ``/ws`` as a client that reads only when asked: a small kernel receive buffer and a
    one-message queue, so that the server's sends wait on it (with [`throttle_sends`])."""
    import websockets

    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    return websockets.connect(f"ws://{address}/ws", sock=sock, max_queue=1)
