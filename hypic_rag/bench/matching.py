"""How long finding known chunks in a prompt takes (`hypic_rag.prompting.matching.SegmentMatcher.find`), as JSON.

    python -m hypic_rag.bench.matching [--output matching.json]

Synthetic chunks of 150 words (about 1 KB) from a 5000-word vocabulary; prompts paste k of them joined by blank
lines. Rows: known chunks x pasted chunks, each with the prompt's characters, the median time of `find` and the
matches found (all k expected). The time should grow with the prompt, not with the number of known chunks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from hypic_rag.prompting.matching import SegmentMatcher


def measure(known_counts: tuple[int, ...] = (1_000, 10_000, 50_000), pasted: tuple[int, ...] = (4, 16, 64),
            repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """The rows described in the module docstring."""
    rng = random.Random(seed)
    words = [f"w{number}" for number in range(5000)]
    chunks = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(max(known_counts))]
    rows = []
    for known in known_counts:
        matcher = SegmentMatcher()
        began = time.perf_counter()
        for text in chunks[:known]:
            matcher.add_chunk(text, text + "\n")
        add_seconds = time.perf_counter() - began
        for count in pasted:
            prompt = "Context:\n" + "\n\n".join(rng.sample(chunks[:known], count)) + "\nQuestion: which?\nAnswer:"
            found = matcher.find(prompt)  # the first call also builds the anchor array
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                matcher.find(prompt)
                times.append(time.perf_counter() - began)
            rows.append({"known_chunks": known, "pasted_chunks": count, "prompt_chars": len(prompt),
                         "matches": len(found), "find_ms": round(statistics.median(times) * 1000, 3),
                         "add_seconds": round(add_seconds, 3)})
    return {"benchmark": "segment matching", "chunk_words": 150, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="write the JSON here (default: print it)")
    args = parser.parse_args(argv)
    text = json.dumps(measure(), indent=1)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
