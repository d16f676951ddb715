"""`python -m hypic_rag ...` is the `hypic-rag` command."""

import sys

from hypic_rag.cli.main import main

sys.exit(main())
