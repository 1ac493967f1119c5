"""The server's defaults, stated once for the ``serve`` command's flags and the server's classes (imports nothing: the
command line reads them before FastAPI, uvicorn or torch load)."""

MAX_SESSIONS = 4  # sessions served at once (--max-sessions)
MAX_FRAMES = 481  # the most frames a session may ask for (--max-frames); an endless stream has no end
DEFAULT_ENDLESS_WINDOW = 21  # latent frames (Self-Forcing's training length; Rolling Forcing's window)
