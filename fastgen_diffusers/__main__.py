"""``python -m fastgen_diffusers ...``: the ``fastgen-diffusers`` command line."""

from .cli import main

raise SystemExit(main())
