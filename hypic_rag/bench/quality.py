"""Answer quality (exact match) of the bundled default model under each mode, for `hypic-rag bench`.

Runs the held-out evaluation (`bench/eval_default_model.py`: real retriever, k chunks, a seed never used in
training) in a subprocess and keeps its per-mode exact match. Skipped with a note when the model is missing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

QUALITY_MODES = ("full", "hypic", "transition_rope", "transition", "addition")
EVAL_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "eval_default_model.py"


def default_model_quality(config: Any, top_k: int = 8) -> dict[str, Any]:
    from hypic_rag.default_model import default_model_path

    if not (default_model_path() / "config.json").is_file() or not EVAL_SCRIPT.is_file():
        logger.warning("default model or %s missing: no quality figures", EVAL_SCRIPT)
        return {"questions": 0, "top_k": top_k, "modes": {}, "skipped": "default model not available"}
    command = [
        sys.executable, str(EVAL_SCRIPT), "--context", "retriever", "--questions", str(config.quality_questions),
        "--k", str(top_k), "--modes", ",".join(QUALITY_MODES), "--seam-tokens", str(config.seam_tokens),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(completed.stdout)
    return {
        "questions": report["questions"],
        "top_k": top_k,
        "gold_recall": report["gold_recall"],
        "modes": {
            mode: {
                "exact_match": row["exact_match"],
                "two_hop_exact_match": row.get("two_hop_exact_match"),
                "exact_match_when_gold_retrieved": row.get("exact_match_when_gold_retrieved"),
            }
            for mode, row in report["modes"].items()
        },
    }
