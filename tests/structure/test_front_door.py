"""The front door: `from hypic_rag import ...` gives every name a user needs, importing `hypic_rag` loads no torch
(each name is imported on first use), and the README's Python snippets and the examples use only front-door names
(`hypic_rag`, and `hypic_rag.integrations.llama_index` for LlamaIndex), never `hypic_rag.testing`. Whether they run
as written is `tests/e2e/test_docs_and_examples.py`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import hypic_rag

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "hypic_rag" / "__init__.py"
FRONT_DOORS = {"hypic_rag", "hypic_rag.integrations.llama_index"}
"""The modules a user imports from: the package, and the LlamaIndex integration (which needs llama-index)."""


def readme_python_blocks(text: str | None = None) -> list[str]:
    """The ```python blocks of the README, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8") if text is None else text
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def hypic_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every import of a `hypic_rag` module in `source` (`import hypic_rag.x`: (module, ""))."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hypic_rag":
            found.extend((node.module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names if alias.name.split(".")[0] == "hypic_rag")
    return found


def off_the_front_door(source: str) -> list[str]:
    """The imports in `source` that do not come through a front door, or name what it does not export."""
    offenders = []
    for module, name in hypic_imports(source):
        if module not in FRONT_DOORS:
            offenders.append(f"{module}.{name}" if name else module)
        elif module == "hypic_rag" and name not in hypic_rag.__all__:
            offenders.append(f"hypic_rag.{name}")
    return offenders


def test_importing_the_package_loads_no_torch_and_no_transformers() -> None:
    code = ("import sys, hypic_rag; heavy = [m for m in ('torch', 'transformers', 'fastapi', 'faiss') if m in sys.modules]; "
            "print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_every_front_door_name_resolves_and_is_listed_for_type_checkers() -> None:
    """`__all__`, the lazy table and the TYPE_CHECKING imports name the same things, and each resolves to an object
    defined in the module the table names (a name moved or renamed fails here, not in a user's import)."""
    names = set(hypic_rag.__all__) - {"__version__"}
    homes = hypic_rag._HOMES
    assert set(homes) == names
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {(node.module, alias.asname or alias.name) for node in checked.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert typed == {(homes[name], name) for name in names}
    for name in sorted(names):
        value = getattr(hypic_rag, name)
        assert value is getattr(sys.modules[homes[name]], name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert set(dir(hypic_rag)) >= names


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        hypic_rag.NoSuchThing  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("hypic_rag.NoSuchThing resolved")


def test_readme_and_examples_use_only_front_door_names() -> None:
    blocks = readme_python_blocks()
    assert blocks, "the README has no ```python block"
    sources = {f"README.md block {number}": block for number, block in enumerate(blocks, start=1)}
    sources.update({str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
                    for path in sorted((ROOT / "examples").glob("*.py"))})
    assert len(sources) > len(blocks)
    assert all(hypic_imports(source) for source in sources.values()), "a snippet or example imports nothing of ours"
    assert {name: off for name, source in sources.items() if (off := off_the_front_door(source))} == {}


def test_the_front_door_check_finds_a_deep_import() -> None:
    """The check above can fail: a deep import, a testing helper and a name the package does not export are named."""
    source = ("from hypic_rag.runtime.engine import Engine\nimport hypic_rag.testing\n"
              "from hypic_rag import Engine, NotExported\nfrom hypic_rag.integrations.llama_index import HypicLLM\n")
    assert off_the_front_door(source) == ["hypic_rag.runtime.engine.Engine", "hypic_rag.testing", "hypic_rag.NotExported"]
    assert readme_python_blocks("a\n```python\nx = 1\n```\n```bash\ny\n```\n") == ["x = 1\n"]
