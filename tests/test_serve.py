"""The session server end to end: a real uvicorn server on a loopback port serving the tiny model, real WebSocket
clients (the protocol of ``fastgen_diffusers.serve.app``)."""

import asyncio
import io
import json
import time

import numpy as np
import PIL.Image
import pytest
import torch

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")

from serve_helpers import (  # noqa: E402
    PROMPT,
    SETTINGS,
    health,
    receive_chunks,
    receive_message,
    receive_until,
    running_server,
    slow_reader,
    throttle_sends,
)

from fastgen_diffusers import WanCausalVideoToVideoPipeline, testing  # noqa: E402
from fastgen_diffusers.serve.app import MAX_MESSAGE_BYTES  # noqa: E402
from fastgen_diffusers.serve.jpeg import decode_jpeg, encode_jpeg, to_uint8  # noqa: E402
from fastgen_diffusers.serve.sessions import SessionManager, endless_settings, session_transformer  # noqa: E402
from fastgen_diffusers.serve.settings_json import session_settings  # noqa: E402
from fastgen_diffusers.settings import RolloutSettings  # noqa: E402

RAW = {**SETTINGS, "encoding": "raw"}
NEW_PROMPT = "a blue whale under the sea"


@pytest.fixture(scope="module")
def pipe():
    return testing.tiny_pipeline()


@pytest.fixture(scope="module")
def server(pipe):
    with running_server(pipe) as (address, srv):
        yield address, srv


def start(prompt=PROMPT, settings=RAW, num_frames=33, source="text"):
    return json.dumps({"type": "start", "prompt": prompt, "settings": settings, "num_frames": num_frames,
                       "input": source})  # fmt: skip


def raw_frames(chunks, settings=RAW):
    """(F, H, W, 3) uint8 of raw-encoded chunks."""
    shape = (settings["height"], settings["width"], 3)
    return np.stack([np.frombuffer(f, np.uint8).reshape(shape) for _, frames in chunks for f in frames])


def stream_frames(pipe, prompt, num_frames=33, seed=7, **kwargs):
    generator = torch.Generator("cpu").manual_seed(seed)
    call = {k: v for k, v in RAW.items() if k not in ("seed", "encoding")}
    chunks = pipe.stream(prompt, num_frames=num_frames, generator=generator, output_type="np", **call, **kwargs)
    return to_uint8(np.concatenate([chunk.frames[0] for chunk in chunks]))


async def wait_idle(address, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        state = health(address)
        if state["sessions"] == 0 and state["cache_bytes"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the server kept {state}")
        await asyncio.sleep(0.05)


def test_session_streams_jpeg_chunks_then_a_live_prompt_change_equals_stream_with_that_switch(server, pipe):
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings=SETTINGS))
            started = (await receive_until(ws, "started"))[-1]
            assert started["settings"]["height"] == 32 and started["settings"]["num_frames"] == 33
            resolved = RolloutSettings.from_dict(started["settings"]["rollout"])  # the run's settings, as JSON
            assert resolved.sampling.num_inference_steps == 2
            jpeg_chunks = await receive_chunks(ws, 3)
            assert (await receive_until(ws, "stopped"))[-1] == {"type": "stopped"}
            # the same session again, raw frames, a prompt change after the first chunk
            await ws.send(start())
            await receive_until(ws, "started")
            first = await receive_chunks(ws, 1)
            await ws.send(json.dumps({"type": "prompt", "prompt": NEW_PROMPT, "transition_chunks": 0}))
            rest, switch = [], None
            for message in await receive_until(ws, "stopped"):
                if isinstance(message, dict) and message["type"] == "prompt":
                    switch = message["index"]
                if isinstance(message, dict) and message["type"] == "chunk":
                    rest.append((message, []))
                elif isinstance(message, bytes):
                    rest[-1][1].append(message)
            return jpeg_chunks, first + rest, switch

    jpeg_chunks, chunks, switch = asyncio.run(run())
    assert [meta["index"] for meta, _ in jpeg_chunks] == [0, 1, 2]
    for meta, frames in jpeg_chunks:
        assert len(frames) == meta["frames"] > 0 and meta["latency_ms"] > 0
        for frame in frames:
            assert decode_jpeg(frame, (32, 32)).shape == (32, 32, 3)
    assert switch in (1, 2)
    (switch_meta,) = [meta for meta, _ in chunks if meta["index"] == switch]
    switch_frame = switch_meta["frame_start"]
    expected = stream_frames(pipe, {0: PROMPT, switch_frame: NEW_PROMPT})
    unchanged = stream_frames(pipe, PROMPT)
    assert chunks[-1][0]["index"] == 2 and [meta["index"] for meta, _ in chunks] == sorted(
        meta["index"] for meta, _ in chunks
    )
    for meta, frames in chunks:  # a chunk still queued when the change arrived may have been dropped
        first, served = meta["frame_start"], raw_frames([(meta, frames)])
        np.testing.assert_array_equal(served, expected[first : first + len(served)])
        if meta["index"] < switch:
            np.testing.assert_array_equal(served, unchanged[first : first + len(served)])
        else:
            assert not np.array_equal(served, unchanged[first : first + len(served)])


def test_two_sessions_take_turns_and_each_matches_its_solo_stream(server, pipe):
    """The second session's settings arrive as the RolloutSettings value's own JSON: the server runs that value."""
    address, _ = server
    windowed = RolloutSettings.from_arguments(num_inference_steps=2, attention_window=6)
    other = {"height": 32, "width": 32, "seed": 3, "encoding": "raw", "rollout": windowed.to_dict()}

    async def session(prompt, settings):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(prompt, settings))
            chunks = await receive_chunks(ws, 3)
            await receive_until(ws, "stopped")
            return chunks

    async def both():
        return await asyncio.gather(session(PROMPT, RAW), session(NEW_PROMPT, other))

    first, second = asyncio.run(both())
    np.testing.assert_array_equal(raw_frames(first), stream_frames(pipe, PROMPT))
    generator = torch.Generator("cpu").manual_seed(3)
    chunks = pipe.stream(
        NEW_PROMPT, num_frames=33, height=32, width=32, generator=generator, output_type="np", settings=windowed
    )
    expected = to_uint8(np.concatenate([chunk.frames[0] for chunk in chunks]))
    np.testing.assert_array_equal(raw_frames(second), expected)
    assert not np.array_equal(expected, stream_frames(pipe, NEW_PROMPT, seed=3))  # the window changed the video
    asyncio.run(wait_idle(address))


def test_disconnect_mid_stream_frees_the_session_and_its_caches(server):
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=None))
            await receive_chunks(ws, 1)
            during = health(address)
        return during, await wait_idle(address)

    during, after = asyncio.run(run())
    assert during["sessions"] == 1 and 0 < during["cache_bytes"] <= during["reserved_bytes"]
    assert after["sessions"] == 0 and after["cache_bytes"] == 0


def _jpeg(array):
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


BAD_MESSAGES = [
    ("{not json", "must be JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"type": "dance"}), "Unknown message type"),
    (start(settings={**RAW, "model_path": "/etc/passwd"}), "Unknown settings"),
    (start(settings={**RAW, "height": "tall"}), "'height' must be int"),
    (start(settings={**RAW, "height": 33}), "height"),
    (start(settings={**RAW, "num_inference_steps": "x"}), "`num_inference_steps` must be a positive integer"),
    (start(settings={**RAW, "kv_cache_policy": "bogus"}), "`kv_cache_policy` must be one of"),
    (start(settings={**RAW, "keep_cache": True}), "do not apply to a session"),
    (start(settings={**RAW, "rollout": {"version": 99}}), "`version` must be 1"),
    (start(settings={**RAW, "strength": 0.5}), "video input only"),
    (start(settings={**RAW, "kv_flush": True}), "`kv_flush=True` keeps the sink and the last frames"),
    (start(settings={**RAW, "recache_sink": "keep"}), "set `recache=True` too"),
    (start(prompt="x" * 2001), "at most 2000 characters"),
    (start(prompt=""), "non-empty"),
    (start(num_frames=0), "num_frames"),
    (start(source="audio"), "`input`"),
    (json.dumps({"type": "prompt", "prompt": "a"}), "send a `start`"),
    ("x" * (65 * 1024), "at most 65536 bytes"),
    (b"\xff\xd8 not a frame", "Binary messages are video frames"),
]


def test_every_bad_message_gets_an_error_and_the_session_goes_on(server):
    address, _ = server

    async def run():
        errors = []
        async with websockets.connect(f"ws://{address}/ws") as ws:
            for message, _ in BAD_MESSAGES:
                await ws.send(message)
                reply = await receive_message(ws)
                errors.append(reply)
            # video mode: a frame of the wrong size, a corrupt frame, a PNG, an oversized message
            await ws.send(start(settings={**RAW, "strength": 0.6}, source="video", num_frames=9))
            waiting = (await receive_until(ws, "waiting"))[-1]
            assert (waiting["frames"], waiting["height"], waiting["width"]) == (9, 32, 32)
            for frame in (
                encode_jpeg(np.zeros((16, 16, 3), np.uint8)),
                b"\xff\xd8\xff garbage",
                _jpeg(np.zeros((32, 32, 3), np.uint8)),
                b"\x00" * (4 * 1024 * 1024 + 1),
            ):
                await ws.send(frame)
                errors.append(await receive_message(ws))
            await ws.send(json.dumps({"type": "stop"}))
            await receive_until(ws, "stopped")
            # a flood of prompt changes, then the stream still ends normally
            await ws.send(start())
            await receive_until(ws, "started")
            for k in range(50):
                await ws.send(json.dumps({"type": "prompt", "prompt": f"prompt {k}", "transition_chunks": 1}))
            messages = await receive_until(ws, "stopped")
            chunks = [m for m in messages if isinstance(m, dict) and m["type"] == "chunk"]
            flood_errors = [m for m in messages if isinstance(m, dict) and m["type"] == "error"]
            return errors, chunks, flood_errors

    errors, chunks, flood_errors = asyncio.run(run())
    expected = [text for _, text in BAD_MESSAGES] + ["must be 32x32", "does not decode", "must be a JPEG", "at most"]
    for reply, text in zip(errors, expected):
        assert reply["type"] == "error" and reply["fatal"] is False, reply
        assert text in reply["message"], (text, reply["message"])
    assert len(errors) == len(expected)
    assert [c["index"] for c in chunks] == [0, 1, 2] and not flood_errors


def test_prompt_switch_options_arrive_as_settings():
    """The prompt-switch options are settings like the others: flat names or the value's JSON, the same value."""
    defaults = {"height": 32, "width": 32, "seed": 0}
    flat = {"kv_flush": True, "attention_window": 6, "sink_frames": 1, "recache_sink": "rerun"}
    settings = session_settings(flat, defaults, RolloutSettings(), video=False)
    assert settings.rollout.prompts.kv_flush and settings.rollout.cache.attention_window == 6
    rollout = {"rollout": settings.rollout.to_dict()}
    assert session_settings(rollout, defaults, RolloutSettings(), video=False).rollout == settings.rollout


def test_token_is_required_when_set_and_foreign_origins_are_refused(pipe):
    async def refused(url, **headers):
        with pytest.raises(websockets.exceptions.InvalidStatus) as error:
            async with websockets.connect(url, additional_headers=headers):
                pass
        return error.value.response.status_code

    async def run(address):
        codes = [
            await refused(f"ws://{address}/ws"),
            await refused(f"ws://{address}/ws?token=wrong"),
            await refused(f"ws://{address}/ws?token=s3cret", Origin="http://evil.example"),
        ]
        async with websockets.connect(
            f"ws://{address}/ws?token=s3cret", additional_headers={"Origin": f"http://{address}"}
        ) as ws:
            await ws.send(json.dumps({"type": "stop"}))
            assert (await receive_message(ws))["type"] == "stopped"
        return codes

    with running_server(pipe, token="s3cret") as (address, _):
        assert asyncio.run(run(address)) == [403, 403, 403]
        with pytest.raises(Exception, match="403"):
            health(address)
        assert health(address, token="s3cret")["sessions"] == 0


def test_a_session_over_the_cache_budget_is_refused_naming_the_budget(pipe):
    async def run(address):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start())
            return await receive_message(ws)

    with running_server(pipe, cache_budget_gb=1e-6) as (address, _):
        reply = asyncio.run(run(address))
        assert reply["type"] == "error" and not reply["fatal"]
        assert "cache budget" in reply["message"] and "--cache-budget-gb" in reply["message"]
        assert health(address)["cache_bytes"] == 0


def test_video_mode_equals_the_video_to_video_pipeline_on_the_same_frames(server, pipe):
    address, _ = server
    rng = np.random.default_rng(0)
    sent = [encode_jpeg(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), 90) for _ in range(33)]

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=9))  # a text stream first: the session then turns to video
            await receive_until(ws, "stopped")
            await ws.send(start(settings={**RAW, "strength": 0.6}, source="video"))
            for frame in sent:
                await ws.send(frame)
            chunks = await receive_chunks(ws, 3)
            await receive_until(ws, "stopped")
            return chunks

    served = raw_frames(asyncio.run(run()))
    v2v = WanCausalVideoToVideoPipeline(**pipe.components)
    expected = v2v(
        PROMPT,
        video=[decode_jpeg(frame, (32, 32)) for frame in sent],
        strength=0.6,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="np",
    ).frames[0]
    np.testing.assert_array_equal(served, to_uint8(expected))


def test_session_transformers_share_the_weights_and_own_their_engines(pipe):
    first, second = session_transformer(pipe.transformer), session_transformer(pipe.transformer)
    for a, b, base in zip(first.parameters(), second.parameters(), pipe.transformer.parameters()):
        assert a is base and b is base
    engines = [id(e) for t in (first, second, pipe.transformer) for e in t.kv_cache_engines.values()]
    assert len(set(engines)) == len(engines) > 0


def _wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_slow_client_pauses_or_drops_its_own_session_and_never_delays_another(pipe):
    """No chunk is ever sent (a client that never reads): a "wait" session stops at the bounded queue, a "drop" one
    goes on dropping, and another session meanwhile runs to its end."""
    defaults = {"height": 32, "width": 32, "seed": 0}
    manager = SessionManager(pipe, defaults, RolloutSettings.from_arguments(num_inference_steps=1), 2**30)
    posted = {name: [] for name in ("wait", "drop", "other")}
    sessions = {name: manager.open(posted[name].append) for name in posted}
    try:
        for name, session in sessions.items():
            slow = "drop" if name == "drop" else "wait"
            settings = session_settings({"slow_client": slow}, defaults, manager.rollout_defaults, video=False)
            frames = None if name != "other" else 9
            manager.request_start(session, {"prompt": PROMPT, "settings": settings, "num_frames": frames,
                                            "input": "text"})  # fmt: skip
        kinds = lambda name: [item[0] if item[0] != "json" else item[1]["type"] for item in posted[name]]  # noqa: E731
        _wait_for(lambda: sessions["drop"].dropped_chunks >= 3 and "stopped" in kinds("other"))
        assert kinds("wait").count("chunk") == manager.max_pending_chunks  # paused, nothing dropped
        assert "dropped" not in kinds("wait") and kinds("drop").count("chunk") == manager.max_pending_chunks
        assert kinds("drop").count("dropped") == 1  # one notice waits for a run of dropped chunks
        notice = manager.take_drop_notice(sessions["drop"])
        assert notice["type"] == "dropped" and notice["chunks"] >= 3 and notice["reason"] == "slow_client"
        first = next(item[1] for item in posted["wait"] if item[0] == "chunk")
        assert manager.take_chunk(sessions["wait"], first) is not None  # the client reads one chunk:
        manager.chunk_sent(sessions["wait"])  # the session runs one more
        _wait_for(lambda: kinds("wait").count("chunk") == manager.max_pending_chunks + 1)
    finally:
        for session in sessions.values():
            manager.close(session)
        manager.stop_all()
    assert manager.health()["sessions"] == 0 and manager.health()["cache_bytes"] == 0


def test_a_restart_never_plays_chunks_of_the_old_run(server, pipe):
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=None))
            await receive_chunks(ws, 1)
            await ws.send(start(NEW_PROMPT))  # restart at once: queued chunks of the first run are dropped
            before = await receive_until(ws, "started")
            chunks = await receive_chunks(ws, 3)
            await receive_until(ws, "stopped")
            return before, chunks

    before, chunks = asyncio.run(run())
    assert sum(isinstance(m, dict) and m["type"] == "chunk" for m in before) <= 1  # at most one already on its way
    assert [meta["index"] for meta, _ in chunks] == [0, 1, 2]
    np.testing.assert_array_equal(raw_frames(chunks), stream_frames(pipe, NEW_PROMPT))


def test_a_message_over_the_size_limit_closes_only_its_connection_naming_the_limit(server, pipe):
    """The WebSocket layer refuses a message over 16 MiB before the app sees it: its connection is closed with code
    1009 and a reason naming the limit, its session's caches are freed, and another session streams on."""
    address, _ = server

    async def oversized():
        async with websockets.connect(f"ws://{address}/ws", max_size=None) as ws:
            await ws.send(start(num_frames=None))
            await receive_chunks(ws, 1)
            await ws.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
            with pytest.raises(websockets.exceptions.ConnectionClosedError):
                while True:
                    await receive_message(ws)
            return ws.close_code, ws.close_reason

    async def bystander(started: asyncio.Event):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start())
            chunks = await receive_chunks(ws, 1)
            started.set()
            chunks += await receive_chunks(ws, 2)
            await receive_until(ws, "stopped")
            return chunks

    async def run():
        started = asyncio.Event()
        other = asyncio.create_task(bystander(started))
        await started.wait()
        closed = await oversized()
        return closed, await other

    (code, reason), chunks = asyncio.run(run())
    assert code == 1009 and str(MAX_MESSAGE_BYTES) in reason
    np.testing.assert_array_equal(raw_frames(chunks), stream_frames(pipe, PROMPT))
    asyncio.run(wait_idle(address))


@pytest.fixture(scope="module")
def slow_server(pipe):
    """A server whose sends wait on a client that stops reading after a few frames ([`throttle_sends`])."""
    with running_server(pipe) as (address, srv):
        throttle_sends(srv)
        yield address, srv


async def stalled(address, srv, settings=RAW, num_frames=241, prompt=PROMPT):
    """A [`slow_reader`] connection whose stream runs until the server's sends wait on it: ``(ws, session, chunks
    generated)``, with 2 chunks pending (one being sent, one queued)."""
    ws = await slow_reader(address)
    await ws.send(start(prompt, settings, num_frames))
    deadline = time.monotonic() + 60
    while True:
        await asyncio.sleep(0.3)
        (session,) = srv.manager.sessions.values()
        generated = session.next_chunk
        await asyncio.sleep(0.3)
        held = session.pending_chunks == 2 and bool(session.queued)
        if held and (session.dropped_chunks or session.next_chunk == generated):  # dropping, or waiting
            return ws, session, session.next_chunk
        assert time.monotonic() < deadline, "the slow reader never held up the server"


def split_messages(messages):
    """``(chunks as (meta, frames), other JSON messages)`` of received messages, in order."""
    chunks, others = [], []
    for message in messages:
        if isinstance(message, bytes):
            chunks[-1][1].append(message)
        elif message["type"] == "chunk":
            chunks.append((message, []))
        else:
            others.append(message)
    return chunks, others


@pytest.mark.parametrize("mode", ["wait", "drop"])
def test_a_slow_reader_holds_up_only_its_own_session_in_bounded_memory(slow_server, pipe, mode):
    """A client that stops reading: its session waits (or drops chunks, reported in one coalesced message) with at
    most 2 chunks and a few messages queued, while another session streams its whole video meanwhile."""
    address, srv = slow_server

    async def fast():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(NEW_PROMPT, {**RAW, "seed": 3}))
            chunks = await receive_chunks(ws, 3)
            await receive_until(ws, "stopped")
            return chunks

    async def run():
        ws, session, generated = await stalled(address, srv, {**RAW, "slow_client": mode}, num_frames=481)
        waiting = session.queued[0].meta["index"]  # the chunk queued behind the one held up
        other = asyncio.create_task(fast())
        peaks = {"queued_chunks": 0, "queued_messages": 0}
        while not other.done():
            state = health(address)
            peaks = {name: max(value, state[name]) for name, value in peaks.items()}
            await asyncio.sleep(0.02)
        fast_chunks = await other
        if mode == "drop":  # the slow session went on meanwhile, dropping its chunks
            _wait_for(lambda: session.next_chunk >= generated + 5)
        ran_meanwhile = session.next_chunk - generated
        state = health(address)
        messages = []  # the client reads again, up to a chunk begun after it stalled
        while not any(isinstance(m, dict) and m["type"] == "chunk" and m["index"] >= generated for m in messages):
            messages.append(await receive_message(ws))
        await ws.send(json.dumps({"type": "stop"}))
        messages += await receive_until(ws, "stopped")
        await ws.close()
        return fast_chunks, peaks, state, generated, waiting, ran_meanwhile, split_messages(messages)

    fast_chunks, peaks, state, generated, waiting, ran_meanwhile, (chunks, others) = asyncio.run(run())
    np.testing.assert_array_equal(raw_frames(fast_chunks), stream_frames(pipe, NEW_PROMPT, seed=3))
    # bounded: 2 chunks of each session at most, and one pending notice for any number of dropped chunks
    assert peaks["queued_chunks"] <= 4 and state["queued_chunks"] == 2 and state["queued_messages"] <= 2, peaks
    indices = [meta["index"] for meta, _ in chunks]
    dropped = [m for m in others if m["type"] == "dropped"]
    if mode == "wait":
        assert ran_meanwhile == 0 and not dropped and indices == list(range(len(indices))) and waiting in indices
    else:  # the chunk that waited was replaced by newer ones: after the one held up, the client jumps to the newest
        assert ran_meanwhile >= 5 and dropped and {m["reason"] for m in dropped} == {"slow_client"}
        jump = next(k for k, index in enumerate(indices) if index != k)
        assert waiting not in indices and indices[jump] >= generated + 4  # replaced by a newer one
        assert sum(m["chunks"] for m in dropped) >= ran_meanwhile
    asyncio.run(wait_idle(address))


def test_a_prompt_change_purges_the_chunks_queued_under_the_old_prompt(slow_server, pipe):
    """The server holds a chunk for a client that lags; a prompt change drops it (reported as ``dropped``) and the
    next chunk the client gets is the first of the new prompt."""
    address, srv = slow_server

    async def run():
        ws, session, generated = await stalled(address, srv, num_frames=12 * 12 + 1)
        queued = session.queued[0].meta["index"]
        await ws.send(json.dumps({"type": "prompt", "prompt": NEW_PROMPT, "transition_chunks": 0}))
        _wait_for(lambda: not session.queued or session.queued[0].meta["index"] != queued)
        messages = await receive_until(ws, "stopped")
        await ws.close()
        return queued, generated, split_messages(messages)

    queued, generated, (chunks, others) = asyncio.run(run())
    dropped = [m for m in others if m["type"] == "dropped"]
    assert dropped == [{"type": "dropped", "index": queued, "chunks": 1, "frames": 12, "reason": "prompt"}]
    (switch,) = [m["index"] for m in others if m["type"] == "prompt"]
    indices = [meta["index"] for meta, _ in chunks]
    assert queued == generated - 1 and switch == generated  # the queued chunk was the last of the old prompt
    assert indices == [k for k in range(12) if k != queued]  # 37 latent frames: 12 chunks
    switch_frame = chunks[indices.index(switch)][0]["frame_start"]
    expected = stream_frames(pipe, {0: PROMPT, switch_frame: NEW_PROMPT}, num_frames=12 * 12 + 1)
    for meta, frames in chunks:  # after the switch up to rounding: the new prompt is encoded alone here
        first, served = meta["frame_start"], raw_frames([(meta, frames)]).astype(int)
        tolerance = 0 if meta["index"] < switch else 1
        np.testing.assert_allclose(served, expected[first : first + len(frames)], rtol=0, atol=tolerance)
    asyncio.run(wait_idle(address))


def test_a_restart_purges_the_chunks_queued_for_a_lagging_client(slow_server, pipe):
    """Stop then start while the server holds a chunk of the old run for a lagging client: that chunk is never
    sent; every chunk after ``started`` is the new run's."""
    address, srv = slow_server

    async def run():
        ws, session, generated = await stalled(address, srv)
        await ws.send(json.dumps({"type": "stop"}))
        await ws.send(start(NEW_PROMPT))
        old = await receive_until(ws, "started")  # the first run's
        old += await receive_until(ws, "started")  # its chunks on their way, `stopped`, the new run's
        new = await receive_chunks(ws, 3)
        await receive_until(ws, "stopped")
        await ws.close()
        return generated, split_messages(old), new

    generated, (old_chunks, old_others), new = asyncio.run(run())
    assert [meta["index"] for meta, _ in old_chunks] == list(range(generated - 1))  # the queued one never came
    assert [m["type"] for m in old_others] == ["started", "stopped", "started"]
    assert [meta["index"] for meta, _ in new] == [0, 1, 2]
    np.testing.assert_array_equal(raw_frames(new), stream_frames(pipe, NEW_PROMPT))
    asyncio.run(wait_idle(address))


ENDLESS_CHUNKS = 14  # 42 latent frames: past the RoPE table of 12 and --max-frames 33


@pytest.fixture(scope="module")
def endless_pipe():
    return testing.tiny_pipeline(rope_max_seq_len=12)


@pytest.mark.parametrize(
    "rollout, window",
    [
        ({"attention_window": 6, "rope_positions": "window"}, 6),  # positions within the window
        ({"kv_cache_policy": "recompute", "context_frames": 3}, None),  # the cache rebuilt over 3 frames
        ({}, 9),  # unbounded settings: the server's --endless-window, absolute positions re-based
    ],
    ids=["window", "recompute", "default-window"],
)
def test_an_endless_stream_outlives_the_rope_table_and_max_frames_in_flat_memory(endless_pipe, rollout, window):
    """``num_frames: null`` streams for as long as the client reads, past the RoPE table and --max-frames, with the
    cache bytes constant once the window is full, then stops cleanly."""

    async def run(address):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings={**RAW, **rollout}, num_frames=None))
            started = (await receive_until(ws, "started"))[-1]
            chunks, reserved = [], []
            for _ in range(ENDLESS_CHUNKS):
                chunks += await receive_chunks(ws, 1)
                reserved.append(health(address)["reserved_bytes"])
            await ws.send(json.dumps({"type": "stop"}))
            await receive_until(ws, "stopped")
            return started, chunks, reserved

    with running_server(endless_pipe, max_frames=33, endless_window=9) as (address, _):
        started, chunks, reserved = asyncio.run(run(address))
        idle = asyncio.run(wait_idle(address))
    resolved = RolloutSettings.from_dict(started["settings"]["rollout"])
    assert resolved.cache.attention_window == window and started["settings"]["num_frames"] is None
    assert [meta["index"] for meta, _ in chunks] == list(range(ENDLESS_CHUNKS))
    assert chunks[-1][0]["frame_start"] > 33 and (chunks[-1][0]["frame_start"] - 1) // 4 + 1 > 12
    frames = raw_frames(chunks)
    assert len(frames) == sum(meta["frames"] for meta, _ in chunks) and frames.std() > 0
    caches = [meta["cache_bytes"] for meta, _ in chunks]  # after each chunk
    assert len(set(caches[4:])) == 1  # flat once the window is full (a growing cache gains a chunk each)
    assert len(set(reserved)) == 1 and 0 < max(caches) <= reserved[0]  # within the admitted formula
    assert idle["sessions"] == 0 and idle["cache_bytes"] == 0


def test_an_endless_stream_equals_the_pipelines_endless_run(endless_pipe):
    rollout = {"attention_window": 6, "rope_positions": "window"}

    async def run(address):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings={**RAW, **rollout}, num_frames=None))
            chunks = await receive_chunks(ws, 6)
            await ws.send(json.dumps({"type": "stop"}))
            await receive_until(ws, "stopped")
            return chunks

    with running_server(endless_pipe) as (address, srv):
        chunks = asyncio.run(run(address))
        settings = session_settings({**RAW, **rollout}, {"seed": 7}, srv.manager.rollout_defaults, video=False)
    config = endless_pipe.transformer.config
    _, _, _, planned = endless_settings(endless_pipe.stored_settings(), settings, config.chunk_size, 12)
    generator = torch.Generator("cpu").manual_seed(7)
    call = {k: v for k, v in RAW.items() if k not in ("seed", "encoding")}
    options = endless_pipe.stream_options(
        PROMPT, num_frames=(planned - 1) * 4 + 1, generator=generator, output_type="np", **call, **rollout
    )
    stream = endless_pipe.stream_run(endless_pipe.prepare_rollout(options).endless())
    expected = [chunk.frames[0] for _, chunk in zip(range(6), stream)]
    stream.close()
    np.testing.assert_array_equal(raw_frames(chunks), to_uint8(np.concatenate(expected)))


@pytest.mark.parametrize(
    "rollout, message",
    [
        ({}, "An endless stream (`num_frames`: null) needs settings that bound the KV cache"),
        ({"kv_cache_policy": "rolling"}, "keeps absolute RoPE positions"),  # the policy's own rule
    ],
    ids=["unbounded-cache", "rolling"],
)
def test_an_endless_stream_the_settings_cannot_serve_is_refused_by_name(endless_pipe, rollout, message):
    async def run(address):
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings={**RAW, **rollout}, num_frames=None))
            reply = await receive_message(ws)
            await ws.send(start(settings={**RAW, **rollout}, num_frames=33))  # a finite one still runs
            return reply, await receive_until(ws, "stopped")

    with running_server(endless_pipe, endless_window=None) as (address, _):
        reply, finite = asyncio.run(run(address))
        assert health(address)["cache_bytes"] == 0
    assert reply["type"] == "error" and not reply["fatal"] and message in reply["message"], reply
    assert "attention_window" in reply["message"] or rollout
    assert sum(isinstance(m, dict) and m["type"] == "chunk" for m in finite) > 0


def test_a_live_prompt_change_the_policy_cannot_serve_gets_its_settings_error_and_the_stream_goes_on(server):
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings={**RAW, "kv_cache_policy": "rolling"}, num_frames=65))
            await receive_until(ws, "started")
            await ws.send(json.dumps({"type": "prompt", "prompt": NEW_PROMPT}))
            return split_messages(await receive_until(ws, "stopped"))

    chunks, others = asyncio.run(run())
    (error,) = [m for m in others if m["type"] == "error"]
    assert "`kv_cache_policy='rolling'` denoises several chunks in one forward" in error["message"]
    assert not error["fatal"] and [meta["index"] for meta, _ in chunks] == list(range(5))
    assert not [m for m in others if m["type"] == "dropped"]  # refused before anything queued was purged


@pytest.mark.parametrize(
    "switch_settings",
    [{"recache": True}, {"recache": True, "recache_sink": "keep"}, {"kv_flush": True}],
    ids=["recache", "recache-keep-sink", "kv-flush"],
)
def test_the_prompt_switch_settings_pass_through_to_a_live_change(server, pipe, switch_settings, monkeypatch):
    """The settings JSON carries the prompt-switch settings; a live change runs under them as a scheduled switch:
    exactly the option's entry point runs, once, at the switch (the frames alone cannot tell: the tiny model's
    switch changes them by at most 1 on uint8 either way)."""
    from fastgen_diffusers.pipelines.rollout import session as rollout_session

    address, _ = server
    settings = {**RAW, "attention_window": 6, "sink_frames": 3, **switch_settings}
    entered = []  # (entry point, latent frames stored when it ran); the server runs in a thread of this process

    def spy(name, function):
        def spied(session, *args, **kwargs):
            entered.append((name, session.num_latent_frames))
            return function(session, *args, **kwargs)

        return spied

    for name in ("flush_caches", "recache_keeping_sink", "set_rope_cut"):
        monkeypatch.setattr(rollout_session, name, spy(name, getattr(rollout_session, name)))
    recache = rollout_session.RolloutSession.recache_chunks
    monkeypatch.setattr(rollout_session.RolloutSession, "recache_chunks", spy("recache_chunks", recache))

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(settings=settings, num_frames=65))
            started = (await receive_until(ws, "started"))[-1]
            first = await receive_chunks(ws, 1)
            await ws.send(json.dumps({"type": "prompt", "prompt": NEW_PROMPT, "transition_chunks": 0}))
            chunks, others = split_messages(await receive_until(ws, "stopped"))
            return started, first + chunks, others

    started, chunks, others = asyncio.run(run())
    served_entries = list(entered)
    prompts = RolloutSettings.from_dict(started["settings"]["rollout"]).prompts
    assert {name: getattr(prompts, name) for name in switch_settings} == switch_settings
    (switch,) = [m["index"] for m in others if m["type"] == "prompt"]
    (switch_meta,) = [meta for meta, _ in chunks if meta["index"] == switch]
    if switch_settings.get("kv_flush"):
        expected_entry = "flush_caches"
    elif switch_settings.get("recache_sink") == "keep":
        expected_entry = "recache_keeping_sink"
    else:
        expected_entry = "recache_chunks"
    # at the switch's chunk: its first pixel frame f > 0 starts latent frame (f + 3) // 4
    assert served_entries == [(expected_entry, (switch_meta["frame_start"] + 3) // 4)]
    call = {k: v for k, v in settings.items() if k not in RAW}
    expected = stream_frames(pipe, {0: PROMPT, switch_meta["frame_start"]: NEW_PROMPT}, num_frames=65, **call)
    for meta, frames in chunks:
        first, served = meta["frame_start"], raw_frames([(meta, frames)]).astype(int)
        tolerance = 0 if meta["index"] < switch else 1  # the new prompt is encoded alone here
        np.testing.assert_allclose(served, expected[first : first + len(frames)], rtol=0, atol=tolerance)


async def _wait_for_health(address, condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition(state := health(address)):
        assert time.monotonic() < deadline, f"the server kept {state}"
        await asyncio.sleep(0.05)
    return state


def test_a_restart_waiting_for_video_frames_ends_the_old_run_at_once(server, pipe):
    """A video restart waits for its frames: the old run ends meanwhile (its caches and budget freed, nothing posted
    for it), and the new run reads only the frames sent after the restart."""
    address, _ = server
    rng = np.random.default_rng(1)
    sent = [encode_jpeg(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), 90) for _ in range(33)]

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=None))  # an endless text run
            await receive_chunks(ws, 1)
            await ws.send(start(source="video", num_frames=9))
            waiting = await receive_until(ws, "waiting")
            idle = await _wait_for_health(address, lambda s: s["reserved_bytes"] == 0 and s["cache_bytes"] == 0)
            for frame in sent:
                await ws.send(frame)
            after = await receive_until(ws, "stopped")
            return waiting, idle, after

    waiting, idle, after = asyncio.run(run())
    chunks, others = split_messages(after)
    assert [m["type"] for m in others] == ["started", "stopped"]  # no stopped nor error for the old run
    assert [meta["index"] for meta, _ in chunks] == [0] and idle["sessions"] == 1
    asyncio.run(wait_idle(address))


def _gated_manager(pipe, monkeypatch):
    """A manager whose session runs wait, before each chunk, until the test lets them go: ``(manager, entered,
    go)``."""
    import threading

    entered, go = threading.Semaphore(0), threading.Semaphore(0)
    original = type(pipe).stream_run

    def gated(self, run):
        chunks = original(self, run)
        try:
            while True:
                entered.release()
                go.acquire()
                record = next(chunks, None)
                if record is None:
                    return
                yield record
        finally:
            chunks.close()

    monkeypatch.setattr(type(pipe), "stream_run", gated)
    defaults = {"height": 32, "width": 32, "seed": 0}
    manager = SessionManager(pipe, defaults, RolloutSettings.from_arguments(num_inference_steps=1), 2**30)
    return manager, entered, go


def _start_message(manager, num_frames, **settings):
    settings = session_settings(settings, manager.session_defaults, manager.rollout_defaults, video=False)
    return {"prompt": PROMPT, "settings": settings, "num_frames": num_frames, "input": "text"}


def _kinds(posted):
    return [item[0] if item[0] != "json" else item[1]["type"] for item in posted]


def test_a_stop_or_restart_during_the_last_chunk_gets_one_stopped_or_none(pipe, monkeypatch):
    manager, entered, go = _gated_manager(pipe, monkeypatch)
    posted = []
    session = manager.open(posted.append)
    try:
        manager.request_start(session, _start_message(manager, 9))  # one chunk
        assert entered.acquire(timeout=60)
        manager.request_stop(session)  # while its last chunk runs
        go.release()
        _wait_for(lambda: not session.running and not session.stop_requested)
        time.sleep(0.2)
        assert _kinds(posted).count("stopped") == 1
        posted.clear()
        manager.request_start(session, _start_message(manager, 9))
        assert entered.acquire(timeout=60)
        manager.request_start(session, _start_message(manager, 9))  # a restart while the last chunk runs
        go.release()
        assert entered.acquire(timeout=60)  # the new run's first chunk
        go.release()
        _wait_for(lambda: "stopped" in _kinds(posted))
        time.sleep(0.2)
        assert _kinds(posted) == ["started", "started", "chunk", "stopped"]  # nothing for the replaced run
    finally:
        for _ in range(4):
            go.release()
        manager.close(session)
        manager.stop_all()


def test_a_refused_restart_stops_the_stream_it_ended(pipe):
    defaults = {"height": 32, "width": 32, "seed": 0}
    manager = SessionManager(
        pipe, defaults, RolloutSettings.from_arguments(num_inference_steps=1), 2**30, endless_window=None
    )
    posted = []
    session = manager.open(posted.append)
    try:
        manager.request_start(session, _start_message(manager, None, attention_window=6))
        _wait_for(lambda: "chunk" in _kinds(posted))
        manager.request_start(session, _start_message(manager, None))  # an unbounded endless stream: refused
        _wait_for(lambda: "error" in _kinds(posted))
        _wait_for(lambda: _kinds(posted)[-1] == "stopped", timeout=10)
        kinds = _kinds(posted)
        assert kinds[kinds.index("error") :] == ["error", "stopped"] and not session.running
        assert manager.health()["reserved_bytes"] == 0
    finally:
        manager.close(session)
        manager.stop_all()


def test_health_reads_the_cache_bytes_the_worker_stored_never_the_engines(pipe, monkeypatch):
    import threading

    from fastgen_diffusers.serve.sessions import Session

    walk = Session.cache_bytes

    def worker_only(self):
        assert threading.current_thread().name == "fastgen-serve-worker", "the engines are the worker's"
        return walk(self)

    monkeypatch.setattr(Session, "cache_bytes", worker_only)
    manager, entered, go = _gated_manager(pipe, monkeypatch)
    posted = []
    session = manager.open(posted.append)
    try:
        manager.request_start(session, _start_message(manager, 33))  # three chunks
        assert entered.acquire(timeout=60)
        go.release()
        assert entered.acquire(timeout=60)  # the first chunk is posted, the second waits
        (chunk,) = [item[1] for item in posted if item[0] == "chunk"]
        assert manager.health()["cache_bytes"] == chunk.meta["cache_bytes"] > 0
        manager.request_stop(session)
        go.release()
        _wait_for(lambda: "stopped" in _kinds(posted))
        assert manager.health()["cache_bytes"] == 0
    finally:
        go.release()
        manager.close(session)
        manager.stop_all()


def test_a_failing_encoder_ends_its_session_with_a_fatal_error(server, monkeypatch):
    """An encoder failure (not the RuntimeError of a gone client) is told as a fatal ``error`` and the connection
    closes, freeing the session, rather than a sender that dies silently and a session that stalls."""
    from fastgen_diffusers.serve import sessions

    def broken(*args, **kwargs):
        raise TypeError("the encoder broke")

    monkeypatch.setattr(sessions, "encode_frames", broken)
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=None))
            error = (await receive_until(ws, "error"))[-1]
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                while True:
                    await receive_message(ws, timeout=30)
            return error

    error = asyncio.run(run())
    assert error["fatal"] and "the encoder broke" in error["message"], error
    asyncio.run(wait_idle(address))


def test_a_sender_that_fails_closes_its_connection(server, monkeypatch):
    """Any other failure of a connection's sender closes the connection (its session ends) instead of a stall."""

    def broken(self, session, slot):
        raise TypeError("the sender broke")

    monkeypatch.setattr(SessionManager, "take_chunk", broken)
    address, _ = server

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(num_frames=None))
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                while True:
                    await receive_message(ws, timeout=30)
            return ws.close_code

    assert asyncio.run(run()) == 1011
    asyncio.run(wait_idle(address))


def test_a_video_chunk_runs_once_its_own_frames_are_in(server):
    """A video run reads its first chunk's frames when it starts: that chunk runs with exactly its own frames (9),
    without waiting for the next chunk's, and each later chunk once its own 12 have arrived."""
    address, _ = server
    rng = np.random.default_rng(2)
    sent = [encode_jpeg(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), 90) for _ in range(21)]

    async def run():
        async with websockets.connect(f"ws://{address}/ws") as ws:
            await ws.send(start(source="video", num_frames=21))
            await receive_until(ws, "waiting")
            for frame in sent[:9]:
                await ws.send(frame)
            first = await receive_chunks(ws, 1, timeout=30)  # waited for the next chunk's frames before the fix
            for frame in sent[9:]:
                await ws.send(frame)
            second = await receive_chunks(ws, 1, timeout=30)
            await receive_until(ws, "stopped")
            return first + second

    chunks = asyncio.run(run())
    assert [(meta["index"], len(frames)) for meta, frames in chunks] == [(0, 9), (1, 12)]
    asyncio.run(wait_idle(address))
