#!/usr/bin/env python
"""Train the bundled default model (same as `python -m hypic_rag.training`); see docs/default_model.md.

    OMP_WAIT_POLICY=PASSIVE python scripts/train_default_model.py train --run-dir runs/default
    python scripts/train_default_model.py export --run-dir runs/default --out hypic_rag/assets/default_model
"""

from hypic_rag.training.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
