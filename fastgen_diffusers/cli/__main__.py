"""``python -m fastgen_diffusers.cli ...`` (what ``torchrun -m`` needs): the ``fastgen-diffusers`` command line."""

from .app import main

raise SystemExit(main())
