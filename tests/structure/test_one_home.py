"""One home each, read from the source with `ast` (nothing is imported): the lookup -> encode -> put loop over a
segment source is written once (`runtime.get_or_encode.SegmentEntries.get_or_encode`; the sources only store), and a
`Scheduler` is constructed in one place (`session.new_scheduler`, behind `ModelSession.scheduler`)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

from test_package_structure import modules

LOOKUP, STORE = "get_many", "put_many"
"""The storage calls a get-or-encode loop makes in one function: look entries up, then put the ones it made."""
THE_LOOP = {"hypic_rag.runtime.get_or_encode.SegmentEntries.get_or_encode"}
THE_SCHEDULER_SITE = {"hypic_rag.pipeline.session.new_scheduler"}


def own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, its nested functions and classes left out (they are checked on their own)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def functions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function in `tree`, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node
            yield from functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}.{node.name}")


def get_or_encode_loops(source: str, module: str) -> set[str]:
    """Functions of `source` that look entries up and then put entries, in their own body: get-or-encode loops (a
    benchmark that puts entries and then reads them back is not one)."""
    found = set()
    for name, function in functions(ast.parse(source), module):
        lines: dict[str, list[int]] = {LOOKUP: [], STORE: []}
        for node in own_nodes(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in lines:
                lines[node.func.attr].append(node.lineno)
        if lines[LOOKUP] and lines[STORE] and min(lines[LOOKUP]) <= max(lines[STORE]):
            found.add(name)
    return found


def encode_callbacks(source: str, module: str) -> set[str]:
    """Functions of `source` taking an encode callback (a parameter named `encode...`)."""
    return {name for name, function in functions(ast.parse(source), module)
            for argument in [*function.args.args, *function.args.kwonlyargs] if argument.arg.startswith("encode")}


def scheduler_constructions(source: str, module: str) -> set[str]:
    """Functions of `source` (or `module` itself, at its top level) that call `Scheduler(...)`."""
    tree = ast.parse(source)
    sites = set()
    for name, function in [(module, tree), *functions(tree, module)]:
        for node in own_nodes(function):
            if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id == "Scheduler")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "Scheduler")
            ):
                sites.add(name)
    return sites


def package_sites(find: Callable[[str, str], set[str]]) -> set[str]:
    """What `find` finds in every module of the installed package."""
    return set().union(*(find(path.read_text(encoding="utf-8"), module) for module, path in modules()))


def test_the_get_or_encode_loop_is_written_once() -> None:
    assert package_sites(get_or_encode_loops) == THE_LOOP


def test_the_segment_sources_take_no_encode_callback() -> None:
    """The stores only store: nothing in the cache or the runtime's source protocol is handed a way to encode."""
    stores = [(module, path) for module, path in modules()
              if module.startswith("hypic_rag.cache") or module == "hypic_rag.runtime.segment_source"]
    assert set().union(*(encode_callbacks(path.read_text(encoding="utf-8"), module) for module, path in stores)) == set()


def test_a_scheduler_is_constructed_in_one_place() -> None:
    assert package_sites(scheduler_constructions) == THE_SCHEDULER_SITE


def test_the_one_home_checks_can_fail() -> None:
    """A second loop (a method looking up and putting, as the cache's stores did with an encode callback) and a
    second construction site (a pipeline building its own scheduler) are both found."""
    second_loop = '''
class Store:
    def get_or_encode_many(self, namespace, lists, encode_many):
        found = self.get_many(namespace, lists)
        return self.put_many(namespace, [ids for ids, e in zip(lists, found) if e is None], encode_many(lists))
'''
    assert get_or_encode_loops(second_loop, "m") == {"m.Store.get_or_encode_many"}
    assert get_or_encode_loops(second_loop.replace("put_many", "stored"), "m") == set()
    assert encode_callbacks(second_loop, "m") == {"m.Store.get_or_encode_many"}
    second_site = '''
from hypic_rag.runtime.scheduler import Scheduler
import hypic_rag.runtime.scheduler as scheduling
class Pipeline:
    def __init__(self, session):
        self.scheduler = Scheduler(session.engine)
        self.other = scheduling.Scheduler(session.engine)
top = Scheduler(None)
'''
    assert scheduler_constructions(second_site, "m") == {"m", "m.Pipeline.__init__"}
