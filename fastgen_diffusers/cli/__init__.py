"""``fastgen-diffusers``: the command line (``generate``, ``convert``, ``serve``).

One module a job: :mod:`.app` builds the parser and runs a subcommand, :mod:`.checks` checks ``generate``'s arguments
before anything loads, :mod:`.i2v` / :mod:`.v2v` add the image and video inputs, :mod:`.convert` is ``convert``'s front
end, :mod:`.serve` is ``serve``'s. Importing this package imports neither torch nor diffusers.
"""

from .app import build_parser, main

__all__ = ["build_parser", "main"]
