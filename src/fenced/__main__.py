"""``python -m fenced`` runs the command line."""

from fenced.cli.main import main

main()
