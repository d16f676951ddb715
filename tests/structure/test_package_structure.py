"""How the package's parts and modules depend on each other, read from the source with `ast` (nothing is imported):
the top-level parts of `hypic_rag` import only parts below them (`LAYERS`), so without a cycle, and the runtime never
imports the cache; no two modules import each other, directly or around a circle; no module imports a package it
lies in (an arrow back up to an ancestor's `__init__`); the entry format is one leaf module, and nothing outside the
cache reaches into a cache's store.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy import still ties
the two modules together) and under `if TYPE_CHECKING:` (a type-only import is still an arrow a reader follows and
a refactoring must keep; a circle through one is broken by moving the shared type to a leaf module, as
`server/task_context.py` and `server/events.py` were)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hypic_rag"
SOURCE_DIRS = {"hypic_rag": PACKAGE}
"""Where each installed package's source lives."""


def modules(source_dirs: dict[str, Path] | None = None) -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) of every module of the installed package (or of the packages `source_dirs` maps:
    dotted name -> folder)."""
    for package, directory in (SOURCE_DIRS if source_dirs is None else source_dirs).items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([package, *parts]), path


def imported_modules(name: str, path: Path) -> set[str]:
    """Every module `name` imports anywhere (top level, inside functions, under TYPE_CHECKING), made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def part_of(module: str) -> str | None:
    """The top-level part of `hypic_rag` a module belongs to: `hypic_rag.runtime`, `hypic_rag.entry`, ..."""
    pieces = module.split(".")
    if pieces[0] != "hypic_rag" or len(pieces) < 2:
        return None
    return ".".join(pieces[:2])


def import_graph() -> dict[str, set[str]]:
    """Top-level part -> the other top-level parts its modules import."""
    known = {module for module, _ in modules()}
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        source = part_of(module)
        if source is None:
            continue
        targets = graph.setdefault(source, set())
        for imported in imported_modules(module, path):
            target = part_of(imported)
            if target is not None and target != source and (imported in known or target in known):
                targets.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def module_graph(sources: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """Module -> the modules of `sources` it imports (anywhere in it, TYPE_CHECKING included), each import resolved
    to the module it names: `from a.b import c` is the module `a.b.c` when there is one, else `a.b` itself (its
    `__init__`); `import a.b.c` is `a.b.c`. A module's import of itself is left out."""
    known = {module for module, _ in sources}
    graph: dict[str, set[str]] = {}
    for module, path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(_known_prefix(alias.name, known) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    name = f"{target}.{alias.name}"
                    found.add(name if name in known else _known_prefix(target, known))
        graph[module] = {name for name in found if name and name != module}
    return graph


def _known_prefix(name: str, known: set[str]) -> str:
    """The longest prefix of dotted `name` that is a module of `known` ('' when none is: an outside import)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """'module -> package' for every module that imports a package it lies in (the package's `__init__`, which
    runs before the module and usually imports it: a circle in waiting)."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if module.startswith(target + "."))


def module_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between modules, as a path, or None. Imports of an ancestor package are left to
    `arrows_back_up` (a package's `__init__` importing its own modules is how packages are built)."""
    return find_cycle({module: {target for target in targets if not module.startswith(target + ".")}
                       for module, targets in graph.items()})


def test_the_runtime_imports_nothing_from_the_cache() -> None:
    offenders = {
        module: sorted(imported for imported in imported_modules(module, path)
                       if imported == "hypic_rag.cache" or imported.startswith("hypic_rag.cache."))
        for module, path in modules()
        if module.startswith("hypic_rag.runtime")
    }
    assert {module: found for module, found in offenders.items() if found} == {}


def test_no_import_cycle_between_the_top_level_parts() -> None:
    graph = import_graph()
    assert {"hypic_rag.runtime", "hypic_rag.cache", "hypic_rag.retrieval", "hypic_rag.server"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a graph with a cycle is reported, with the cycle's path."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


LAYERS: list[set[str]] = [
    {"errors", "version"},
    {"entry"},
    {"utils"},
    {"kernels"},
    {"runtime"},
    {"cache", "prompting", "demo"},
    {"retrieval"},
    {"pipeline"},
    {"calibration"},
    {"server", "integrations"},
    {"distributed", "testing"},
    {"bench"},
    {"cli"},
    {"__main__"},
]
"""The top-level parts of `hypic_rag` from the bottom up (docs/development.md, "Repository layout"): a part imports
only parts of the layers below its own. The leaves (errors, the entry format, utilities, kernels) at the bottom; the
runtime (model, engine, ops, scheduler, checkpoint reading) above them and below the cache, so it never imports the
cache; the pipeline (session, answering, precompute) on runtime, cache, prompting and retrieval; the ways in
(service, integrations, Ray, benchmarks, the CLI) on top."""


def layering_breaches(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """'part -> part' for every import of a part from its own layer or one above it (by `part_of`'s last name)."""
    level = {part: index for index, parts in enumerate(layers) for part in parts}
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if level[target.rpartition(".")[2]] >= level[source.rpartition(".")[2]])


def test_every_top_level_part_imports_only_the_layers_below_it() -> None:
    graph = import_graph()
    parts = {part.rpartition(".")[2] for part in graph} | {
        target.rpartition(".")[2] for targets in graph.values() for target in targets}
    assert parts == set().union(*LAYERS), f"parts not in LAYERS: {sorted(parts - set().union(*LAYERS))}"
    assert layering_breaches(graph, LAYERS) == []


def test_the_layering_check_finds_an_import_from_above() -> None:
    """The check above can fail: the runtime importing the cache (a layer above) is named; importing the entry
    format (below) is not."""
    graph = {"hypic_rag.runtime": {"hypic_rag.entry", "hypic_rag.cache"}, "hypic_rag.cache": {"hypic_rag.entry"}}
    assert layering_breaches(graph, LAYERS) == ["hypic_rag.runtime -> hypic_rag.cache"]
    assert layering_breaches({"hypic_rag.cache": {"hypic_rag.prompting"}}, LAYERS) == [
        "hypic_rag.cache -> hypic_rag.prompting"]  # one layer, still a breach


def test_no_import_cycle_between_modules() -> None:
    """No two modules of the package import each other, directly or around a circle (every import counted, see the
    module docstring)."""
    graph = module_graph(list(modules()))
    assert {"hypic_rag.cache.codec", "hypic_rag.server.worker", "hypic_rag.distributed.serve_front"} <= set(graph)
    cycle = module_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_no_module_imports_a_package_it_lies_in() -> None:
    """No arrow back up: a module imports its siblings' and cousins' modules, never an ancestor package's
    `__init__` (`__version__` is `hypic_rag.version`, the test kit is `hypic_rag.testing.tiny`)."""
    graph = module_graph(list(modules()))
    assert "hypic_rag.version" in graph["hypic_rag.server.app"]
    assert arrows_back_up(graph) == []


def write_tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write `files` (path under `root` -> source) and return `modules`' source map for the package `pkg`."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return {"pkg": root / "pkg"}


def test_the_module_checks_find_a_cycle_and_an_arrow_back_up(tmp_path: Path) -> None:
    """The two checks above can fail: in a temporary package, a circle closed by an import inside a function and
    one closed under TYPE_CHECKING are found, and so is a module importing its package's `__init__`; importing a
    sibling module through the package (`from pkg.sub import other`) is not an arrow back up."""
    source_dirs = write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from pkg.sub.a import A\n",
        "pkg/sub/a.py": "from pkg.sub import other\nA = 1\n\ndef f():\n    from pkg.sub.b import B\n",
        "pkg/sub/b.py": "from pkg.sub.a import A\nB = 2\n",
        "pkg/sub/other.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.typed import T\n",
        "pkg/typed.py": "from pkg.sub.other import *\nT = int\n",
        "pkg/up.py": "from pkg import VERSION\n",
    })
    graph = module_graph(list(modules(source_dirs)))
    assert graph["pkg.sub.a"] == {"pkg.sub.other", "pkg.sub.b"}
    assert module_cycle(graph) in (["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"], ["pkg.sub.b", "pkg.sub.a", "pkg.sub.b"])
    del graph["pkg.sub.b"]
    assert module_cycle(graph) == ["pkg.sub.other", "pkg.typed", "pkg.sub.other"]
    assert arrows_back_up(graph) == ["pkg.up -> pkg"]
    graph["pkg.typed"] = set()
    assert module_cycle(graph) is None


def test_the_entry_format_is_one_leaf_module_that_both_sides_import() -> None:
    entry_module = PACKAGE / "entry" / "schema.py"
    own = {imported for imported in imported_modules("hypic_rag.entry.schema", entry_module) if part_of(imported)}
    assert own == set(), f"hypic_rag/entry/schema.py must import nothing from hypic_rag, imports {sorted(own)}"
    importers = {
        module for module, path in modules()
        if any(imported == "hypic_rag.entry.schema" or imported.startswith("hypic_rag.entry.schema.")
               for imported in imported_modules(module, path))
    }
    for user in ("hypic_rag.entry.compression", "hypic_rag.cache.synthetic", "hypic_rag.cache.segment_cache",
                 "hypic_rag.runtime.encode", "hypic_rag.runtime.stack", "hypic_rag.runtime.engine",
                 "hypic_rag.retrieval.encoding_pool", "hypic_rag.bench.measure", "hypic_rag.bench.cache_bytes"):
        assert user in importers, f"{user} does not use hypic_rag.entry.schema"


def test_entry_names_and_sizes_are_defined_only_in_the_entry_module() -> None:
    """`Entry` is declared once, and only the entry module (and the decode state's own size) multiply a tensor's
    element count by its element size."""
    for module, path in modules():
        if module == "hypic_rag.entry.schema":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assert not any(isinstance(t, ast.Name) and t.id == "Entry" for t in targets), f"{module} declares Entry"
            if isinstance(node, ast.Attribute) and node.attr == "element_size":
                assert module == "hypic_rag.runtime.state", f"{module} computes tensor bytes itself"


def test_nothing_outside_the_cache_reaches_into_a_cache_store() -> None:
    """Only the cache's own modules touch `SegmentCache.store`; the rest goes through `SegmentCache` methods."""
    offenders = []
    for module, path in modules():
        if module.startswith("hypic_rag.cache"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "store":
                if isinstance(node.value, ast.Name) and node.value.id == "tl":  # triton.language.store in kernels
                    continue
                offenders.append(f"{module}:{node.lineno}")
    assert offenders == []


def test_the_integrations_import_nothing_from_the_server() -> None:
    """The LlamaIndex integration shares helpers with the service through neutral modules (`hypic_rag.prompting.segments`,
    `hypic_rag.pipeline.usage`), never by importing `hypic_rag.server`."""
    offenders = {
        module: sorted(imported for imported in imported_modules(module, path)
                       if imported == "hypic_rag.server" or imported.startswith("hypic_rag.server."))
        for module, path in modules()
        if module.startswith("hypic_rag.integrations")
    }
    assert {"hypic_rag.integrations.llama_index", "hypic_rag.integrations.llama_index.llm"} <= set(offenders)
    assert {module: found for module, found in offenders.items() if found} == {}


def test_the_llama_index_integration_is_a_package_of_one_class_kind_per_module() -> None:
    """Each public class lives in its own module, which lists it in `__all__`; the package re-exports them all."""
    package = PACKAGE / "integrations" / "llama_index"
    assert package.is_dir() and not (PACKAGE / "integrations" / "llama_index.py").exists()
    declared: dict[str, list[str]] = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
        exported = next(
            (ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)),
            None,
        )
        assert exported is not None, f"{path.name} has no __all__"
        assert set(classes) <= set(exported), f"{path.name}: {classes} not all in __all__ {exported}"
        declared[path.stem] = classes
    assert all(len(classes) <= 1 for classes in declared.values()), declared
    public = {name for classes in declared.values() for name in classes}
    assert public == {
        "HypicCacheTransformation", "HypicCondensePlusContextChatEngine", "HypicContextChatEngine", "HypicEmbedding",
        "HypicLLM", "HypicQueryEngine", "HypicRuntime", "HypicSynthesizer",
    }
    init = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    exported = next(ast.literal_eval(node.value) for node in init.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    assert public <= set(exported)


def kernel_importers(sources: list[tuple[str, Path]]) -> dict[str, list[str]]:
    """module -> the `hypic_rag.kernels` modules it imports, for every module outside `hypic_rag.runtime.ops` and
    the kernels package itself."""
    found = {}
    for module, path in sources:
        if module.startswith(("hypic_rag.runtime.ops.", "hypic_rag.kernels")) or module == "hypic_rag.runtime.ops":
            continue
        imported = sorted(name for name in imported_modules(module, path)
                          if name == "hypic_rag.kernels" or name.startswith("hypic_rag.kernels."))
        if imported:
            found[module] = imported
    return found


def test_only_the_ops_import_the_kernels() -> None:
    """The GPU kernels are reached through one dispatch per op in `hypic_rag/runtime/ops/` (stack, layers, mixers
    and the GPU benchmark included), never imported directly."""
    sources = list(modules())
    names = {module for module, _ in sources}
    assert {"hypic_rag.bench.gpu", "hypic_rag.runtime.stack", "hypic_rag.runtime.layers"} <= names
    assert {"hypic_rag.runtime.ops.compose.fold", "hypic_rag.runtime.ops.rope.rotate", "hypic_rag.runtime.ops.registry"} <= names
    assert kernel_importers(sources) == {}


def test_the_kernel_import_check_finds_an_importer(tmp_path: Path) -> None:
    """The check above can fail: a module outside the ops importing the kernels (even inside a function) is named."""
    outside = tmp_path / "outside.py"
    outside.write_text("def f():\n    from hypic_rag.kernels.compose import compose_affine\n")
    inside = tmp_path / "inside.py"
    inside.write_text("from hypic_rag.kernels import triton_enabled\n")
    found = kernel_importers([("hypic_rag.bench.outside", outside), ("hypic_rag.runtime.ops.rope.inside", inside)])
    assert found == {"hypic_rag.bench.outside": ["hypic_rag.kernels.compose", "hypic_rag.kernels.compose.compose_affine"]}


def runtime_module_graph() -> dict[str, set[str]]:
    """Module -> the modules of `hypic_rag.runtime` it imports (anywhere in it), for the modules of the runtime."""
    known = {module for module, _ in modules()}
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        if module == "hypic_rag.runtime" or not module.startswith("hypic_rag.runtime."):
            continue
        graph[module] = {
            imported for imported in imported_modules(module, path)
            if imported in known and imported.startswith("hypic_rag.runtime.") and imported != module
            and not module.startswith(imported + ".")  # a package's own `__init__` (run first, not a cycle)
        }
    return graph


def test_no_import_cycle_inside_the_runtime() -> None:
    """The runtime's modules import each other in one order (top level, inside functions and under TYPE_CHECKING
    alike): layers below mixers below blocks and families, the stack pass below the engine, and so on."""
    graph = runtime_module_graph()
    assert {"hypic_rag.runtime.stack", "hypic_rag.runtime.layers", "hypic_rag.runtime.engine"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_retrieval_package_does_not_import_the_pipeline() -> None:
    """Retrieval (chunking, indexing, the encoding workers) is below the pipeline and its session: what it shares
    with them (encoding tasks and batches) lives in the runtime's get-or-encode module."""
    offenders = {
        module: sorted(imported for imported in imported_modules(module, path)
                       if imported == "hypic_rag.pipeline" or imported.startswith("hypic_rag.pipeline."))
        for module, path in modules()
        if module.startswith("hypic_rag.retrieval")
    }
    assert "hypic_rag.retrieval.encoding_pool" in offenders
    assert {module: found for module, found in offenders.items() if found} == {}


GET_OR_ENCODE = "hypic_rag.runtime.get_or_encode"


def test_one_home_of_the_get_or_encode_step() -> None:
    """Only `runtime/get_or_encode.py` encodes segments with the model (`runtime.encode.encode_segments`), and the
    step is defined once: no other module defines a `get_or_encode`, `keep` of entries, or encoding batches (the
    lookup -> encode -> put loop itself: `test_one_home.py`)."""
    definers: dict[str, set[str]] = {}
    for module, path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in (
                "get_or_encode", "encoding_batches", "plan_encode_batches", "fill_steps", "SegmentTask", "_keep",
            ):
                definers.setdefault(node.name, set()).add(module)
    model_encoders = {module for module, path in modules() if "hypic_rag.runtime.encode" in imported_modules(module, path)
                      and "hypic_rag.runtime.encode.encode_segments" in imported_modules(module, path)}
    assert model_encoders == {GET_OR_ENCODE}
    assert definers.get("_keep", set()) == set(), f"a second keep of encoded entries: {definers.get('_keep')}"
    assert definers["get_or_encode"] == {GET_OR_ENCODE}
    assert definers["encoding_batches"] == definers["SegmentTask"] == {GET_OR_ENCODE}
    assert definers["plan_encode_batches"] == {"hypic_rag.runtime.encode"}
    assert definers["fill_steps"] <= {GET_OR_ENCODE, "hypic_rag.pipeline.session"}


def test_the_checks_above_can_fail() -> None:
    """The runtime graph finder sees a real edge, and the cycle finder a cycle between two of its modules."""
    graph = runtime_module_graph()
    assert "hypic_rag.runtime.layers" in graph["hypic_rag.runtime.stack"]
    graph["hypic_rag.runtime.layers"] = graph["hypic_rag.runtime.layers"] | {"hypic_rag.runtime.stack"}
    assert find_cycle(graph) is not None
