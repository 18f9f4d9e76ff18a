"""``python -m patchray ...``: the command-line interface (see distributed/cli.py)."""

from .distributed.cli import main

raise SystemExit(main())
