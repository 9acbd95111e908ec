"""Code the docs quote as a body of the source is that body: the parallel plan's order on its page is
`parallelize`'s, line for line (its trailing comments aside), so the page cannot drift from the code."""

import ast
import re

from tests.conftest import ROOT
from tests.docs.pages import DOCS

COMMENT = re.compile(r"\s+#.*$")


def quoted_python(page: str) -> list[str]:
    """The lines of the page's first ```python block."""
    text = (DOCS / page).read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start : text.index("```", start)].splitlines()


def function_body(path: str, name: str) -> list[str]:
    """The source lines of function `name`'s body in `path`, dedented, without its docstring."""
    source = (ROOT / path).read_text()
    function = next(
        node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef) and node.name == name
    )
    body = function.body[1:] if isinstance(function.body[0], ast.Expr) else function.body
    lines = source.splitlines()[body[0].lineno - 1 : body[-1].end_lineno]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return [line[indent:] for line in lines]


def test_the_parallel_plans_order_is_parallelizes_body():
    quoted = [COMMENT.sub("", line) for line in quoted_python("concepts/parallel-plan.md")]
    body = [COMMENT.sub("", line) for line in function_body("src/forge/parallel/plan.py", "parallelize")]
    # the page shows the transforms: the body between the list it fills and the line that returns it
    first = body.index(quoted[0])
    assert body[first : first + len(quoted)] == quoted
    assert body[first + len(quoted)].startswith("return ")
