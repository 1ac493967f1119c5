"""Sessions of the real-time server: each with its own KV caches, all taking turns on one pipeline.

One connection is one [`Session`]. A single worker thread ([`SessionManager`]) runs every piece of model work: it
prepares a session's rollout, then runs the sessions' chunks in turn, one chunk per turn, round robin, so that two
viewers each see video at about half the rate. Each session rolls out on a pipeline of its own whose transformer
shares the weights of the server's model but owns its KV-cache engines ([`session_transformer`]): a chunk only ever
touches its own session's caches, and a stop, a disconnect or a failure frees them at once.

Queues are bounded: a session runs a chunk only while fewer than ``max_pending_chunks`` of its chunks wait to be sent
(a slow client makes its own session wait, or with ``slow_client="drop"`` loses its oldest waiting chunks, told in
one coalesced ``dropped`` message), a video session only once the frames of its next chunk have arrived (at most
``max_pending_frames`` wait, older ones are dropped), and a prompt change replaces any change not yet applied. A
restart, a stop or a prompt change purges the chunks queued for the client and not yet being sent ([`ChunkSlot`]):
their frames are freed at once and never sent. The event loop only moves messages: it hands commands to the worker
and sends what the worker posts.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from ..chunking import chunk_bounds, chunk_layout
from ..cli.common import one_line
from ..pipelines.video_io.video_source import chunk_num_frames
from ..settings import RolloutSettings
from ..settings.cache import KEY_POSITIONS
from .budget import CacheBudget, session_cache_bytes
from .defaults import DEFAULT_ENDLESS_WINDOW, MAX_FRAMES, MAX_SESSIONS
from .jpeg import encode_frames, to_uint8
from .settings_json import SessionSettings

MAX_PROMPT_CHARS = 2000


def endless_settings(
    stored: RolloutSettings,
    settings: SessionSettings,
    chunk_size: int,
    rope_table: int,
    independent_first_frame: bool = False,
    default_window: int | None = DEFAULT_ENDLESS_WINDOW,
) -> tuple[SessionSettings, RolloutSettings, bool, int]:
    """A session's settings for an endless stream (``num_frames: null``), asking the settings values whether they serve
    one: ``(settings, resolved rollout, rope_rebasing, planned latent frames)``; the resolved rollout is ``stored``
    under the settings' own (what the run resolves to).

    The KV cache must stay bounded: the policy's ``held_frames`` must not grow with the video (a sliding
    ``attention_window``, or a policy that bounds the cache itself, as recompute does). Settings that leave it
    unbounded get ``attention_window=default_window`` (the server's ``--endless-window``), or are refused when it is
    ``None``. The RoPE positions must stay bounded too: the settings are asked about a plan past the RoPE table
    (``RolloutSettings.check_chunks``), with RoPE re-basing where the keys are stored rotated (absolute positions; the
    session's transformer is then re-based). ``planned latent frames``: the run's planned chunks (the cache held once
    full, and 3 chunks more); the stream goes on after them.

    Raises:
        ValueError: the settings cannot serve an endless stream (naming the setting), or their own message.
    """
    resolved = stored.merge(settings.rollout)

    def held(rollout: RolloutSettings, frames: int) -> int:
        return rollout.active_policy.held_frames(frames, chunk_size, rollout.cache.attention_window)

    far = rope_table + (resolved.cache.attention_window or 0) + 4 * chunk_size  # past the table and any window
    if held(resolved, far) < held(resolved, 2 * far):  # the cache grows with the video
        if default_window is None:
            raise ValueError(
                "An endless stream (`num_frames`: null) needs settings that bound the KV cache, or its memory grows "
                "with the video: set `attention_window` (latent frames attended to, e.g. 21), or "
                "`kv_cache_policy='recompute'` (with `context_frames`), or ask for a `num_frames`."
            )
        settings = dataclasses.replace(settings, rollout=settings.rollout.merge(attention_window=default_window))
        resolved = stored.merge(settings.rollout)
    rebasing = not KEY_POSITIONS[resolved.cache.positions].keys_before_rope
    bounds = chunk_bounds(chunk_layout(far, chunk_size, independent_first_frame))
    resolved.check_chunks(bounds, chunk_size, rope_table=rope_table, rope_rebasing=rebasing)
    return settings, resolved, rebasing, min(held(resolved, far) + 3 * chunk_size, far)


def session_transformer(transformer: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``transformer`` that shares its parameters and buffers (no copy of the weights) and owns its KV-cache
    engines, so that a rollout on it never touches another copy's caches."""
    memo = {id(tensor): tensor for tensor in (*transformer.parameters(), *transformer.buffers())}
    shell = copy.deepcopy(transformer, memo)
    shell.clear_caches()
    return shell


class ChunkSlot:
    """A finished chunk on its way to the client: posted by the worker, taken by the connection's sender, or purged
    (``stale``, its frames freed) by a restart, a stop or a prompt change while it waits."""

    __slots__ = ("meta", "encode", "stale")

    def __init__(self, meta: dict[str, Any], encode: Callable[[], list[bytes]]) -> None:
        self.meta = meta
        self.encode: Callable[[], list[bytes]] | None = encode  # the chunk's binary messages, encoded when sent
        self.stale = False


class Session:
    """One connection's state. The event loop sets the command fields under the manager's lock; the worker owns the
    rollout fields."""

    def __init__(self, session_id: int, post: Callable[[tuple], None]) -> None:
        self.id = session_id
        self.post = post  # thread-safe: hands ("json", dict) / ("chunk", generation, meta, frames) to the sender
        # commands (event loop -> worker)
        self.start_request: dict[str, Any] | None = None
        self.prompt_request: tuple[str, int | None] | None = None
        self.stop_requested = False
        self.close_requested = False
        self.frames: deque[np.ndarray] = deque()  # a fresh one for each start: a run reads only its own
        self.dropped_input_frames = 0
        self.input_size: tuple[int, int] | None = None  # (height, width) of the input frames a video start asked for
        # delivery (worker <-> sender, under the manager's lock)
        self.queued: deque[ChunkSlot] = deque()  # posted, not yet taken by the sender
        self.sending = 0  # 1 while the sender sends a chunk
        self.generation = 0  # bumped by each start and stop: a chunk of an older run is never posted
        self.run_generation = 0  # the generation the running run started under (worker)
        self.dropped_chunks = 0  # by slow_client="drop", not yet reported
        self.dropped_frames = 0
        self.last_dropped: int | None = None
        self.drop_notice_posted = False
        self.outbox: Any = None  # the connection's outgoing queue (its size shows in /health)
        self.held_cache_bytes = 0  # the session's KV cache after its last chunk (written by the worker, for /health)
        # rollout (worker; only the worker writes these)
        self.pipe: Any = None
        self.settings: SessionSettings | None = None
        self.video = False
        self.run: Any = None
        self.chunks: Iterator | None = None
        self.next_chunk = 0
        self.frames_sent = 0
        self.frames_taken = 0  # input frames the video run has read so far (the first chunk's, at its start)
        self.num_frames: int | None = None
        self.frame_size: tuple[int, int] | None = None

    @property
    def running(self) -> bool:
        return self.chunks is not None

    @property
    def pending_chunks(self) -> int:
        """Chunks posted and not yet sent (queued or being sent)."""
        return len(self.queued) + self.sending

    def purge(self) -> list[dict[str, Any]]:
        """Drop the chunks queued for the client that the sender has not begun (under the manager's lock); their
        frames are freed at once. Returns their ``chunk`` messages."""
        purged = [slot.meta for slot in self.queued]
        for slot in self.queued:
            slot.stale, slot.encode = True, None
        self.queued.clear()
        return purged

    def cache_bytes(self) -> int:
        """The bytes its KV-cache engines hold now (worker only: it walks the engines)."""
        if self.pipe is None:
            return 0
        return sum(engine.cache_bytes() for engine in self.pipe.transformer.kv_cache_engines.values())


class SessionManager:
    """Runs every session's model work in one worker thread, a chunk at a time, round robin.

    Args:
        pipe: the server's [`WanCausalPipeline`] (its components are shared by every session's pipeline).
        session_defaults: the session values a start message's ``settings`` fill in (height, width, seed, strength).
        rollout_defaults: the server's [`RolloutSettings`] under a session's own (over the pipeline's stored ones).
        budget_bytes: the KV-cache bytes all sessions may hold together ([`CacheBudget`]).
        max_frames: the most frames a session may ask for (an endless stream, ``num_frames: null``, has no end).
        max_sessions: connections served at once.
        max_pending_chunks: chunks of a session waiting to be sent before it pauses (or drops).
        endless_window: the ``attention_window`` of an endless stream whose settings leave the cache unbounded
            ([`endless_settings`]); ``None``: such a stream is refused.
    """

    def __init__(
        self,
        pipe: Any,
        session_defaults: dict[str, Any],
        rollout_defaults: RolloutSettings,
        budget_bytes: int,
        max_frames: int = MAX_FRAMES,
        max_sessions: int = MAX_SESSIONS,
        max_pending_chunks: int = 2,
        max_sequence_length: int = 512,
        endless_window: int | None = DEFAULT_ENDLESS_WINDOW,
    ) -> None:
        self.pipe = pipe
        self.session_defaults = dict(session_defaults)
        self.rollout_defaults = rollout_defaults
        self.budget = CacheBudget(budget_bytes)
        self.max_frames = max_frames
        self.max_sessions = max_sessions
        self.max_pending_chunks = max_pending_chunks
        self.max_sequence_length = max_sequence_length
        self.endless_window = endless_window
        self.sessions: dict[int, Session] = {}
        self.order: deque[int] = deque()
        self._idle_pipes: list[Any] = []  # session pipelines of closed sessions, caches cleared
        self._next_id = 0
        self._cond = threading.Condition()
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="fastgen-serve-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ event loop side
    def open(self, post: Callable[[tuple], None]) -> Session:
        """A new session for a connection; ``post`` hands its outgoing messages to the connection's sender.

        Raises:
            ValueError: the server serves ``max_sessions`` already.
        """
        with self._cond:
            if sum(not s.close_requested for s in self.sessions.values()) >= self.max_sessions:  # closing ones go
                raise ValueError(
                    f"The server serves {self.max_sessions} sessions already (--max-sessions); try later."
                )
            self._next_id += 1
            session = Session(self._next_id, post)
            self.sessions[session.id] = session
            self.order.append(session.id)
            return session

    def request_start(self, session: Session, message: dict[str, Any]) -> None:
        """(Re)start the session's stream; the old run's chunks not yet being sent are purged."""
        with self._cond:
            session.start_request = message
            session.prompt_request = None
            session.generation += 1
            session.frames = deque()  # the old run keeps its own (the worker ends it)
            session.purge()
            self._cond.notify_all()

    def request_prompt(self, session: Session, prompt: str, transition_chunks: int | None) -> None:
        """Switch the prompt from the next chunk not yet begun. The chunks queued for the client (generated under
        the old prompt, not yet being sent) are purged and reported as ``dropped``; the chunk being generated, begun
        before this message, is still sent.

        Raises:
            ValueError: the running stream's settings serve no prompt switch (their own message); nothing is purged.
        """
        with self._cond:  # one consistent snapshot: the worker may replace the run meanwhile (it re-checks later)
            run, start_request, frames_sent = session.run, session.start_request, session.frames_sent
        if run is not None and start_request is None:
            check_prompt_switch(run, frames_sent)
        with self._cond:
            session.prompt_request = (prompt, transition_chunks)  # a later change replaces one not applied yet
            purged = session.purge()
            self._cond.notify_all()
        if purged:
            session.post(("json", {"type": "dropped", "index": purged[-1]["index"], "chunks": len(purged),
                                   "frames": sum(meta["frames"] for meta in purged), "reason": "prompt"}))  # fmt: skip

    def request_stop(self, session: Session) -> None:
        """Stop the stream; its chunks not yet being sent are purged."""
        with self._cond:
            session.stop_requested = True
            session.start_request = None
            session.generation += 1
            session.purge()
            self._cond.notify_all()

    def add_frame(self, session: Session, frame: np.ndarray, max_pending_frames: int) -> None:
        with self._cond:
            session.frames.append(frame)
            while len(session.frames) > max_pending_frames:
                session.frames.popleft()
                session.dropped_input_frames += 1
            self._cond.notify_all()

    def take_chunk(self, session: Session, slot: ChunkSlot) -> Callable[[], list[bytes]] | None:
        """The sender begins sending ``slot``: its encoder, or ``None`` when it was purged (nothing to send).
        [`chunk_sent`] follows a taken chunk."""
        with self._cond:
            if slot.stale:
                return None
            session.queued.remove(slot)
            session.sending += 1
            encode, slot.encode = slot.encode, None
            return encode

    def chunk_sent(self, session: Session) -> None:
        with self._cond:
            session.sending = max(0, session.sending - 1)
            self._cond.notify_all()

    def take_drop_notice(self, session: Session) -> dict[str, Any] | None:
        """The ``dropped`` message reporting the chunks dropped (``slow_client="drop"``) since the last one."""
        with self._cond:
            session.drop_notice_posted = False
            if not session.dropped_chunks:
                return None
            notice = {"type": "dropped", "index": session.last_dropped, "chunks": session.dropped_chunks,
                      "frames": session.dropped_frames, "reason": "slow_client"}  # fmt: skip
            session.dropped_chunks = session.dropped_frames = 0
            return notice

    def close(self, session: Session) -> None:
        """The connection is gone: the worker frees the session's caches at its next turn (at once when idle)."""
        with self._cond:
            session.close_requested = True
            self._cond.notify_all()

    def health(self) -> dict[str, Any]:
        with self._cond:  # what the worker stored: the engines are the worker's
            sessions = list(self.sessions.values())
            cache_bytes = sum(s.held_cache_bytes for s in sessions)
        return {
            "decoder": type(self.pipe.stream_decoder).__name__,  # what decodes the streamed frames
            "sessions": len(sessions),
            "cache_bytes": cache_bytes,
            "reserved_bytes": sum(self.budget.reserved.values()),
            "budget_bytes": self.budget.budget_bytes,
            "queued_chunks": sum(s.pending_chunks for s in sessions),  # posted, not yet sent
            "queued_messages": sum(s.outbox.qsize() for s in sessions if s.outbox is not None),
        }

    def stop_all(self) -> None:
        """Stop every session (each is told ``stopped``), free their caches and end the worker."""
        with self._cond:
            self._closing = True
            for session in self.sessions.values():
                session.stop_requested = True
                session.start_request = None
            self._cond.notify_all()
        self._worker.join(timeout=60)

    # ------------------------------------------------------------------ worker
    def _task(self) -> tuple[Session, str] | None:
        """The next piece of work, round robin over the sessions (called under the lock)."""
        for _ in range(len(self.order)):
            session = self.sessions[self.order[0]]
            self.order.rotate(-1)
            if session.close_requested:
                return session, "close"
            if session.stop_requested:
                return session, "stop"
            if session.start_request is not None:
                if self._frames_ready(session, 0, session.start_request):
                    return session, "start"
                if session.running:  # the new run waits for its frames: the old one ends now, never offered chunks
                    return session, "end_run"
                continue
            if session.running and self._chunk_ready(session):
                return session, "chunk"
        return None

    def _frames_ready(self, session: Session, chunk_index: int, start: dict | None = None) -> bool:
        """Whether every input frame up to chunk ``chunk_index`` has arrived (a start: the first chunk's, in the new
        run's deque). Counted against what the run has read already: it reads the first chunk's frames when it
        starts, so that chunk then runs without waiting for the next chunk's."""
        if start is not None:
            return start.get("input") != "video" or len(session.frames) >= self.frames_needed(0)
        if not session.video:
            return True
        through = self.frames_needed(0) + chunk_index * self.frames_needed(1)  # later chunks all take as many
        return session.frames_taken + len(session.frames) >= through

    def frames_needed(self, chunk_index: int) -> int:
        """Input frames of a video session's chunk ``chunk_index`` (all of them arrive before it runs)."""
        config = self.pipe.transformer.config
        first = chunk_index == 0
        latent = 1 if first and config.independent_first_frame else config.chunk_size
        return chunk_num_frames(latent, first, self.pipe.vae_scale_factor_temporal)

    def _chunk_ready(self, session: Session) -> bool:
        waits = session.settings.slow_client == "wait" and session.pending_chunks >= self.max_pending_chunks
        return not waits and self._frames_ready(session, session.next_chunk)

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._task()
                while task is None:
                    if self._closing:
                        return
                    self._cond.wait()
                    task = self._task()
            session, kind = task
            was_running = session.running  # a refused restart has ended the old run: its stream stops
            try:
                getattr(self, f"_{kind}")(session)
            except Exception as error:  # a failure ends its own session only
                self._end_run(session)
                session.post(("json", {"type": "error", "message": one_line(error), "fatal": kind != "start"}))
                if kind != "start" or was_running:
                    session.post(("json", {"type": "stopped"}))

    def _close(self, session: Session) -> None:
        self._end_run(session)
        with self._cond:
            self.sessions.pop(session.id, None)
            if session.id in self.order:
                self.order.remove(session.id)
        if session.pipe is not None:
            self._release_pipe(session.pipe)
        session.pipe = None

    def _stop(self, session: Session) -> None:
        with self._cond:
            session.stop_requested = False
        self._end_run(session)
        session.post(("json", {"type": "stopped"}))

    def _end_run(self, session: Session) -> None:
        """Close the session's rollout and free its caches (they are the session's own)."""
        if session.chunks is not None:
            session.chunks.close()
        with self._cond:  # request_prompt reads the run under the lock
            session.chunks = session.run = None
            session.held_cache_bytes = 0
        if session.pipe is not None:
            session.pipe.transformer.clear_caches()
        self.budget.release(session.id)

    def _pipe_class(self, video: bool) -> type:
        from ..pipelines import WanCausalVideoToVideoPipeline

        return WanCausalVideoToVideoPipeline if video else type(self.pipe)

    def _release_pipe(self, pipe: Any) -> None:
        if len(self._idle_pipes) < self.max_sessions:
            self._idle_pipes.append(pipe)  # caches cleared: the next session reuses it

    def _session_pipe(self, pipe_class: type) -> Any:
        """A ``pipe_class`` pipeline of the server's components with a transformer (and scheduler) of its own, reused
        from a closed session when one is idle."""
        for index, idle in enumerate(self._idle_pipes):
            if type(idle) is pipe_class:
                return self._idle_pipes.pop(index)
        components = dict(self.pipe.components)
        components["transformer"] = session_transformer(self.pipe.transformer)
        components["scheduler"] = copy.deepcopy(self.pipe.scheduler)
        pipe = pipe_class(**components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _start(self, session: Session) -> None:
        with self._cond:
            message, session.start_request = session.start_request, None
            generation, frames = session.generation, session.frames
        self._end_run(session)
        settings: SessionSettings = message["settings"]
        video = message["input"] == "video"
        pipe_class = self._pipe_class(video)
        if type(session.pipe) is not pipe_class:
            if session.pipe is not None:
                self._release_pipe(session.pipe)
            session.pipe = self._session_pipe(pipe_class)
        num_frames = message["num_frames"]
        pipe = session.pipe
        config = pipe.transformer.config
        temporal = pipe.vae_scale_factor_temporal
        rebasing = getattr(self.pipe.transformer, "rope_rebasing", False)  # the server's model's own
        stored = pipe.stored_settings()
        if num_frames is None:  # endless: bounded cache and positions, or refused
            settings, rollout, endless_rebasing, latent_frames = endless_settings(
                stored, settings, config.chunk_size, config.rope_max_seq_len, config.independent_first_frame,
                self.endless_window,
            )  # fmt: skip
            rebasing = rebasing or endless_rebasing
        else:
            rollout = stored.merge(settings.rollout)  # what the call resolves to, before any allocation
            latent_frames = (num_frames - 1) // temporal + 1
        pipe.transformer.enable_rope_rebasing(rebasing)  # the session's own transformer
        session.video, session.settings = video, settings
        call = {"prompt": message["prompt"], **settings.call_kwargs(), "output_type": "np"}
        call["generator"] = torch.Generator("cpu").manual_seed(settings.seed)
        if video:
            session.frames_taken = 0
            call["video"] = self._video_frames(session, frames)
        else:
            call["num_frames"] = (latent_frames - 1) * temporal + 1 if num_frames is None else num_frames
        options = pipe.stream_options(**call)
        needed = session_cache_bytes(
            pipe.transformer, rollout, settings.height, settings.width, latent_frames, self.max_sequence_length
        )
        self.budget.reserve(session.id, needed)
        run = pipe.prepare_rollout(options)
        if num_frames is None and not video:  # a video session runs as long as its frames come
            run = run.endless()
        chunks = pipe.stream_run(run)
        with self._cond:  # request_prompt snapshots the run and its frames sent under the lock
            session.run, session.chunks, session.frames_sent = run, chunks, 0
        session.run_generation = generation
        session.next_chunk = 0
        session.num_frames = num_frames
        session.frame_size = (settings.height, settings.width)
        resolved = {**settings.to_dict(session.run.options.settings), "num_frames": num_frames}
        session.post(("json", {"type": "started", "settings": resolved, "generation": generation}))

    def _video_frames(self, session: Session, frames: deque[np.ndarray]) -> Iterator[np.ndarray]:
        """The frames arrived for one run (its own deque: a restart gives the session a new one), one by one (the
        worker reads a chunk's frames only once they are all in), counted in ``session.frames_taken``."""
        while True:
            with self._cond:
                if not frames:
                    return
                frame = frames.popleft()
                session.frames_taken += 1
            yield frame

    def _apply_prompt(self, session: Session) -> None:
        with self._cond:
            request, session.prompt_request = session.prompt_request, None
        if request is None:
            return
        prompt, transition_chunks = request
        pipe, run = session.pipe, session.run
        check_prompt_switch(run, session.frames_sent)
        device = pipe._execution_device
        embeds = pipe.encode_prompt_switches({0: prompt}, run.session.prompt_embeds, self.max_sequence_length, device)
        run.switch_prompt(session.next_chunk, embeds[0], transition_chunks)
        session.post(("json", {"type": "prompt", "prompt": prompt, "index": session.next_chunk}))

    def _run_ended(self, session: Session) -> None:
        """The run ended by itself: ``stopped``, unless the client already replaced or stopped it (a restart wants
        none; a stop gets its own)."""
        self._end_run(session)
        with self._cond:
            current = session.run_generation == session.generation
        if current:
            session.post(("json", {"type": "stopped"}))

    def _chunk(self, session: Session) -> None:
        generation = session.run_generation
        try:
            self._apply_prompt(session)
        except ValueError as error:  # a bad prompt change is refused; the stream goes on
            session.post(("json", {"type": "error", "message": one_line(error), "fatal": False}))
            return
        started = time.perf_counter()
        with torch.no_grad():
            record = next(session.chunks, None)
        if record is None:
            self._run_ended(session)
            return
        frames = to_uint8(record.frames[0])  # (F, H, W, 3)
        if session.num_frames is not None:
            frames = frames[: max(0, session.num_frames - session.frames_sent)]
        settings = session.settings
        # encoded by the connection's sender, in a thread of its own: the worker goes on with the next chunk
        payload = partial(encode_frames, frames, settings.encoding, settings.jpeg_quality)
        meta = {
            "type": "chunk",
            "index": session.next_chunk,
            "frames": len(frames),
            "frame_start": record.frame_start,
            "height": int(frames.shape[1]),
            "width": int(frames.shape[2]),
            "latency_ms": round(1000 * (time.perf_counter() - started), 2),
            "cache_bytes": session.cache_bytes(),  # the session's KV cache after this chunk
        }
        session.next_chunk += 1
        with self._cond:
            session.held_cache_bytes = meta["cache_bytes"]
            session.frames_sent += len(frames)
            stale = generation != session.generation  # a stop or a restart arrived while it ran: never posted
            full = session.pending_chunks >= self.max_pending_chunks  # only with slow_client="drop"
            if stale:
                pass
            elif full:  # the oldest chunk waiting goes (not one being sent): the client gets the newest frames
                contents = [(slot.meta, slot.encode) for slot in session.queued] + [(meta, payload)]
                dropped, _ = contents.pop(0)
                for slot, (slot_meta, slot_encode) in zip(session.queued, contents):  # the slots keep their places
                    slot.meta, slot.encode = slot_meta, slot_encode
                session.dropped_chunks += 1
                session.dropped_frames += dropped["frames"]
                session.last_dropped = dropped["index"]
                if not session.drop_notice_posted:  # one notice waits at most: a lagging client costs no memory
                    session.drop_notice_posted = True
                    session.post(("dropped",))
            else:
                slot = ChunkSlot(meta, payload)
                session.queued.append(slot)
                session.post(("chunk", slot))
        if session.num_frames is not None and session.frames_sent >= session.num_frames:
            self._run_ended(session)


def check_prompt_switch(run: Any, frame: int) -> None:
    """Ask ``run``'s resolved settings whether they serve a prompt switch at pixel frame ``frame``: ``ValueError`` with
    their own message when not (a policy that denoises several chunks in one forward)."""
    rollout = run.options.settings
    rollout.with_arguments(rollout.arguments(), switch_frames=(max(frame, 1),))


def post_from_thread(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[tuple], None]:
    """A ``post`` for [`SessionManager.open`]: hands a message to ``queue`` on ``loop`` from any thread."""

    def post(item: tuple) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the connection is gone
            pass

    return post
