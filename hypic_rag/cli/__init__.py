"""Command-line interface: `hypic-rag <command>`."""
