"""The README's Python examples run as printed ("Using it from Python")."""

from __future__ import annotations

import contextlib
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python_blocks(section: str = "## Using it from Python") -> list[str]:
    """The ```python blocks of a README section (up to the next "## " heading)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    body = text[text.index(section + "\n"):]
    body = body[:body.find("\n## ", len(section))]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_the_numpy_example_runs():
    code = python_blocks()[0]
    assert "kvsift.Cache(" in code and len(code.splitlines()) <= 14
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    # 4,096 tokens in 16-token pages per KV head; 5% of them: 12 pages per KV head.
    chosen, stored = re.match(r"(\d+) of (\d+) pages;", printed.getvalue()).groups()
    assert (int(chosen), int(stored)) == (2 * 12, 2 * 256)
