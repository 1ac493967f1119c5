"""The real-time session server (``fastgen-diffusers serve``) and its web page.

:mod:`.settings_json` checks a session's JSON settings, :mod:`.budget` admits sessions by their cache size,
:mod:`.sessions` runs every session's chunks in one worker thread, :mod:`.jpeg` is the frame format, :mod:`.app` is the
FastAPI app (page, ``/health``, WebSocket ``/ws``) and :mod:`.server` runs it with uvicorn. Needs the ``serve`` extra
(``pip install "fastgen-diffusers[serve]"``); importing this package imports none of it.
"""
