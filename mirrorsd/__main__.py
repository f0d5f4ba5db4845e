"""`python -m mirrorsd ...`: the `mirrorsd` command (apps/cli.py)."""

from mirrorsd.apps.cli import main

main()
