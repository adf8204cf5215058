"""``python -m skipjack`` runs the command line."""

from .cli import run

run()
