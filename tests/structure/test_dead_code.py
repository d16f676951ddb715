"""Nothing speculative left in the package, read from the source (nothing is imported but `HybridModel`): every
member of `HybridModel` is used by the package, and no code cites an issue number (the history lives in git)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hypic_rag.runtime.model import HybridModel

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "hypic_rag").rglob("*.py"))


def test_every_member_of_hybrid_model_is_used_by_the_package() -> None:
    members = {field.name for field in dataclasses.fields(HybridModel)}
    members |= {name for name, value in vars(HybridModel).items()
                if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    text = "\n".join(path.read_text(encoding="utf-8") for path in SOURCES)
    unused = sorted(name for name in members if not re.search(rf"\.{name}\b", text))
    assert unused == [], f"HybridModel members nothing in hypic_rag uses: {unused}"


def test_no_issue_numbers_in_the_package() -> None:
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in SOURCES
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if re.search(r"\bissue #?\d+|\(item \d+\)", line, flags=re.IGNORECASE)]
    assert cited == []
