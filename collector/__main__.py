"""``python -m collector [collect options]`` runs the collector; any ``shmstat`` subcommand works too."""

import sys

from .cli import COMMANDS, main

argv = sys.argv[1:]
if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "-v", "--verbose", "--version")):
    argv = ["collect", *argv]
sys.exit(main(argv))
