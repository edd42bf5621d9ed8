"""RuleError: what is wrong with a rule, where (1-based line and column), and a caret excerpt."""

from __future__ import annotations

from typing import Any


class RuleError(ValueError):
    """A rule text that is not a valid rule; the only exception parsing raises."""

    def __init__(self, message: str, line: int = 1, column: int = 1, text: str = "") -> None:
        self.message = message
        self.line = max(1, line)
        self.column = max(1, column)
        self.excerpt = _excerpt(text, self.line, self.column)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        head = f"line {self.line}, column {self.column}: {self.message}"
        return f"{head}\n{self.excerpt}" if self.excerpt else head

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "line": self.line, "column": self.column}


def _excerpt(text: str, line: int, column: int, width: int = 100) -> str:
    lines = text.split("\n")
    if not text or line > len(lines):
        return ""
    source = lines[line - 1].rstrip("\r")
    # long lines: a window around the column, so the caret stays on screen
    start = max(0, min(column - 1 - width // 2, len(source) - width))
    shown = source[start : start + width]
    # tabs and other control characters would misplace the caret
    shown = "".join(ch if ch.isprintable() else " " for ch in shown)
    return f"  {shown}\n  {' ' * (column - 1 - start)}^"
