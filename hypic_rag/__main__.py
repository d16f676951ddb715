"""`python -m hypic_rag ...` is the `hypic-rag` command."""

from hypic_rag.cli.main import run

run()
