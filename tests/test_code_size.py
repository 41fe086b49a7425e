"""Files near 300 lines and functions near 60 (docs/style.md): past that, look for the second idea
hiding inside. A file or function may stay longer when it says why, where a reader sees it:

- a file: a line of its module docstring (or of the comment block it opens with) that starts
  with `Long because`, e.g. `Long because the three kernels share one tiling and must change
  together.`
- a function: a `# long: <reason>` comment on its `def` line (or any line of its signature).

Lines are physical lines, docstrings and comments included; a function counts from its `def` to
its last line, decorators excluded.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "router", "workers", "kvtransfer")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60
FILE_MARKER = "Long because"
FUNCTION_MARKER = "# long:"


def source_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts]


def says_why_long(text: str, tree: ast.Module) -> bool:
    """Whether the module docstring, or the comment block before the code, has a line
    starting with `Long because`."""
    lines = (ast.get_docstring(tree) or "").splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            break
        if tok.type == tokenize.COMMENT:
            lines.append(tok.string.lstrip("#"))
    return any(line.strip().startswith(FILE_MARKER) for line in lines)


def long_functions(text: str, tree: ast.Module) -> list[tuple[str, int, int]]:
    """(name, def line, length) of each function over the limit without a `# long:` reason."""
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        signature = lines[node.lineno - 1:max(node.lineno, node.body[0].lineno - 1)]
        if length > MAX_FUNCTION_LINES and not any(FUNCTION_MARKER in s for s in signature):
            found.append((node.name, node.lineno, length))
    return found


def test_files_stay_near_300_lines_or_say_why() -> None:
    offenders = []
    for path in source_files():
        text = path.read_text()
        num_lines = len(text.splitlines())
        if num_lines > MAX_FILE_LINES and not says_why_long(text, ast.parse(text)):
            offenders.append(f"{path.relative_to(ROOT)}: {num_lines} lines")
    print("\n".join(offenders))
    assert not offenders, (f"files over {MAX_FILE_LINES} lines without a '{FILE_MARKER}' line "
                           "in their docstring:\n  " + "\n  ".join(offenders))


def test_functions_stay_near_60_lines_or_say_why() -> None:
    offenders = []
    for path in source_files():
        text = path.read_text()
        for name, line, length in long_functions(text, ast.parse(text)):
            offenders.append(f"{path.relative_to(ROOT)}:{line} {name}: {length} lines")
    print("\n".join(offenders))
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines without a "
                           f"'{FUNCTION_MARKER}' comment on their def line:\n  "
                           + "\n  ".join(offenders))


def test_the_markers_are_read_where_the_reader_sees_them() -> None:
    body = "\n".join(["    x = 1"] * MAX_FUNCTION_LINES)
    text = (f'"""Records.\n\n{FILE_MARKER} the wire format is one table."""\n'
            f"def f(a,  # long: one state machine, read top to bottom\n      b):\n{body}\n"
            f"def g():\n{body}\n")
    tree = ast.parse(text)
    assert says_why_long(text, tree)
    assert long_functions(text, tree) == [("g", MAX_FUNCTION_LINES + 6, MAX_FUNCTION_LINES + 1)]
    commented = f"# {FILE_MARKER} it holds the generated tables.\nimport os\n"
    assert says_why_long(commented, ast.parse(commented))
    assert not says_why_long('"""Short."""\n# Long because\n', ast.parse('"""Short."""\n'))
