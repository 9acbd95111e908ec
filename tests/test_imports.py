"""Imports flow one way in src/forge: the module-level imports between forge's modules form no cycle, no import
inside a function closes one (an import hidden there to dodge a cycle), and no comment speaks of import order.

Importing `forge.a.b` first runs `forge/__init__.py` and `forge/a/__init__.py`, so an import is also an edge to
each package above its target, except the packages above the importer (they are already running by then).
"""

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

ORDER_WORDS = re.compile(
    r"circular|\bcycle|\border\b|\bfirst\b|before (forge|import)|each other|imports (this|it)\b", re.I
)
"""In a comment that mentions an import: words about which module must come first, or about a circular import."""


def is_order_comment(comment: str) -> bool:
    return "import" in comment.lower() and ORDER_WORDS.search(comment) is not None


@dataclass(frozen=True)
class Import:
    importer: str
    line: int
    targets: frozenset[str]
    in_function: bool


def module_names(src: Path) -> dict[str, Path]:
    """Every module of the forge package under `src`, by dotted name (a package by its __init__.py)."""
    names = {}
    for path in sorted((src / "forge").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def packages_above(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every executed import statement, with whether it runs inside a function (`if TYPE_CHECKING:` never runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from (item for child in node.orelse for item in _import_nodes(ast.Module([child], []), in_function))
        else:
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _import_nodes(node, inner)


def forge_imports(src: Path) -> list[Import]:
    """The imports of forge modules that each module of `src/forge` makes, with the packages they run."""
    modules = module_names(src)
    imports = []
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _import_nodes(tree):
            if isinstance(node, ast.Import):
                named = {alias.name for alias in node.names}
            else:
                module = _absolute(node, importer, path.name == "__init__.py")
                named = {module} | {f"{module}.{alias.name}" for alias in node.names}
            explicit = {name for name in named if name in modules}
            implicit = {pkg for name in explicit for pkg in packages_above(name)} - packages_above(importer)
            targets = frozenset((explicit | (implicit & modules.keys())) - {importer})
            if targets:
                imports.append(Import(importer, node.lineno, targets, in_function))
    return imports


def module_level_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set())
        if not imp.in_function:
            graph[imp.importer] |= imp.targets
    return graph


def path_between(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The modules from `start` to `goal` along module-level imports (breadth first), or None."""
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, ())):
                if target in came_from:
                    continue
                came_from[target] = module
                if target == goal:
                    path = [goal]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                following.append(target)
        frontier = following
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of module-level imports, as [a, b, ..., a], or None."""
    for module in sorted(graph):
        for target in sorted(graph[module]):
            back = path_between(graph, target, module) if target != module else [module]
            if back is not None:
                return [module, *back]
    return None


def cycle_dodging_imports(imports: list[Import]) -> list[str]:
    """Each import inside a function of M whose target reaches M through module-level imports."""
    graph = module_level_graph(imports)
    found = []
    for imp in imports:
        if not imp.in_function:
            continue
        for target in sorted(imp.targets):
            back = path_between(graph, target, imp.importer)
            if back is not None:
                found.append(f"{imp.importer}:{imp.line} imports {target} in a function: {' -> '.join(back)}")
    return found


def import_order_comments(src: Path) -> list[str]:
    found = []
    for path in sorted((src / "forge").rglob("*.py")):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.COMMENT and is_order_comment(token.string):
                found.append(f"{path.relative_to(src)}:{token.start[0]}: {token.string}")
    return found


def test_every_forge_module_is_seen():
    modules = module_names(SRC)
    assert {"forge", "forge.config", "forge.config.validate", "forge.models.llama.transformer"} <= modules.keys()
    graph = module_level_graph(forge_imports(SRC))
    assert "forge.models.common.feed_forward" in graph["forge.models.llama.transformer"]
    assert "forge.config" in graph["forge.parallel.mesh"]  # through forge.config.degrees: the package runs first


def test_module_level_imports_form_no_cycle():
    cycle = find_cycle(module_level_graph(forge_imports(SRC)))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_import_inside_a_function_dodges_a_cycle():
    dodges = cycle_dodging_imports(forge_imports(SRC))
    assert not dodges, "imports that would close a cycle at module level:\n" + "\n".join(dodges)


def test_no_comment_about_import_order():
    comments = import_order_comments(SRC)
    assert not comments, "comments about import order:\n" + "\n".join(comments)


def test_order_comment_pattern():
    assert is_order_comment("# Imported here: a module-level import would be a circular import")
    assert is_order_comment("# noqa: F401  (first: forge.parallel.degrees and forge.config import each other)")
    assert is_order_comment("# before forge.parallel.degrees: the config package imports it")
    assert is_order_comment("# the moe package imports this module")
    assert not is_order_comment("# imported late: it brings torch.distributed.checkpoint")
    assert not is_order_comment("# here a config error is refused before the trainer's heavy imports")
