"""Text -> Rule: the lark grammar (grammar.lark), then checks that name what would be right."""

from __future__ import annotations

import difflib
import functools
import math
import re
from importlib.resources import files

from lark import Lark, Token, Tree
from lark.exceptions import (
    LarkError,
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
)

from .errors import RuleError
from .model import (
    COMPARATORS,
    DEFAULT_SEVERITY,
    METRICS,
    SEVERITIES,
    UNIT_SPELLINGS,
    Action,
    And,
    Comparator,
    Condition,
    Expr,
    Not,
    Or,
    Rule,
)

MAX_NESTING = 32  # parentheses and NOTs; deeper trees are refused, never a RecursionError
#: one rule's text (the panel's rule box, parse_rule) and each line of a rules file
MAX_RULE_CHARS = 4096
#: a whole rules text (parse_rules: an admin's rules, a server's rule set)
MAX_RULES_TEXT_CHARS = 64 * 1024
#: conditions (comparisons) in one rule: evaluation cost per sample stays small
MAX_CONDITIONS = 32
MAX_DURATION_SECONDS = 30 * 86400
ACTIONS = ("alert",)
ALERT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?\Z")

_TERMINALS = {
    "NAME": "a name",
    "COMPARATOR": "a comparison (>, >=, <, <=, ==, !=)",
    "NUMBER": "a number",
    "UNIT": "a unit",
    "DURATION": "a duration (e.g. 30s, 5m, 1h30m)",
    "STRING": 'a quoted string ("...")',
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "EQUAL": "'='",
    "_IF": "IF",
    "_THEN": "THEN",
    "_AND": "AND",
    "_OR": "OR",
    "NOT": "NOT",
    "_FOR": "FOR",
    "_NL": "end of line",
    "$END": "end of input",
}
_ORDER = list(_TERMINALS)


@functools.cache
def _lark() -> Lark:
    grammar = (files(__package__) / "grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="contextual", maybe_placeholders=False)


def parse_rules(text: str) -> list[Rule]:
    """Every rule of a text (one per line, '#' comments); RuleError on the first bad one."""
    if not isinstance(text, str):
        raise RuleError(f"a rule text is a string, not {type(text).__name__}")
    _check_size(text, MAX_RULES_TEXT_CHARS)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text) from None
    except (LarkError, RecursionError) as e:  # pragma: no cover - defensive: lark internals
        raise RuleError(f"cannot parse the rule: {e}", 1, 1, text) from None
    return [_Builder(text).rule(child) for child in tree.children if isinstance(child, Tree)]


def _check_size(text: str, limit: int) -> None:
    """Refuse texts over `limit` characters and lines over MAX_RULE_CHARS before lark sees them
    (its time and memory grow with the input; no excerpt of a huge text is echoed)."""
    if len(text) > limit:
        raise RuleError(f"the rule text is {len(text)} characters long; at most {limit} are read")
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_RULE_CHARS:
            raise RuleError(
                f"line {number} is {len(line)} characters long; a rule has at most "
                f"{MAX_RULE_CHARS}",
                number,
                MAX_RULE_CHARS + 1,
                text,
            )


def parse_rule(text: str) -> Rule:
    """Exactly one rule (surrounding blank lines and comments are fine)."""
    if isinstance(text, str):
        _check_size(text, MAX_RULE_CHARS)
    rules = parse_rules(text)
    if len(rules) != 1:
        if not rules:
            line, column = _end(text)
            raise RuleError(
                'expected a rule: IF <condition> THEN alert("NAME")', line, column, text
            )
        second = _second_rule_line(text)
        raise RuleError(
            f"expected one rule, found {len(rules)} (one rule per call; parse_rules reads many)",
            second,
            1,
            text,
        )
    return rules[0]


# -- syntax errors -----------------------------------------------------------------------------


def _describe(names: set[str] | frozenset[str] | list[str]) -> str:
    known = sorted({n for n in names if n in _TERMINALS}, key=_ORDER.index)
    words = [_TERMINALS[n] for n in known]
    if not words:
        return ""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _end(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _second_rule_line(text: str) -> int:
    seen = 0
    for i, line in enumerate(text.split("\n"), 1):
        if line.strip() and not line.strip().startswith("#"):
            seen += 1
            if seen == 2:
                return i
    return 1


def _open_paren(text: str, token: Token) -> bool:
    """Whether a '(' is open on the token's line before it (LALR's expected sets merge states)."""
    lines = text.split("\n")
    if token.type == "$END" or token.line is None or token.column is None:
        before = lines[-1]
    else:
        before = lines[token.line - 1][: token.column - 1]
    before = re.sub(r'"(?:[^"\\\\]|\\\\.)*"|\'(?:[^\'\\\\]|\\\\.)*\'', "", before)
    return before.count("(") > before.count(")")


def _syntax_error(e: UnexpectedInput, text: str) -> RuleError:
    if isinstance(e, UnexpectedCharacters):
        pos = e.pos_in_stream or 0
        char = text[pos] if 0 <= pos < len(text) else ""
        if char == "=":
            return RuleError("'=' is not a comparison: use == (or >=, <=)", e.line, e.column, text)
        what = "unterminated string" if char in "\"'" else f"unexpected character {char!r}"
        expected = _describe(e.allowed or set())
        msg = f"{what} (expected {expected})" if expected and char not in "\"'" else what
        return RuleError(msg, e.line, e.column, text)
    if isinstance(e, UnexpectedToken):
        token = e.token
        expected_names = set(e.expected)
        if token.type == "EQUAL" and "COMPARATOR" in expected_names:
            msg = "'=' is not a comparison: use == (or >=, <=)"
            return RuleError(msg, token.line or 1, token.column or 1, text)
        if "RPAR" in expected_names and not _open_paren(text, token):
            expected_names.discard("RPAR")
        expected = _describe(expected_names)
        if token.type == "$END":
            line, column = _end(text)
            found = "end of input"
        else:
            line, column = token.line or 1, token.column or 1
            found = "end of line" if token.type == "_NL" else repr(str(token))
        msg = f"unexpected {found}"
        if expected:
            msg += f" (expected {expected})"
        return RuleError(msg, line, column, text)
    if isinstance(e, UnexpectedEOF):
        line, column = _end(text)
        expected = _describe([str(t) for t in e.expected])
        return RuleError(
            "unexpected end of input" + (f" (expected {expected})" if expected else ""),
            line,
            column,
            text,
        )
    return RuleError(str(e), getattr(e, "line", 1), getattr(e, "column", 1), text)


# -- the tree -> Rule, with the checks ---------------------------------------------------------


class _Builder:
    def __init__(self, text: str) -> None:
        self.text = text
        self.conditions = 0  # in the rule being built

    def error(self, msg: str, token: Token) -> RuleError:
        return RuleError(msg, token.line or 1, token.column or 1, self.text)

    def rule(self, tree: Tree[Token]) -> Rule:
        expr, action = tree.children
        assert isinstance(expr, Tree) and isinstance(action, Tree)
        self.conditions = 0
        return Rule(self.expr(expr, 0), self.action(action))

    def expr(self, tree: Tree[Token], depth: int) -> Expr:
        if depth > MAX_NESTING:
            first = next(iter(tree.scan_values(lambda v: isinstance(v, Token))), None)
            msg = f"the condition is nested too deeply (at most {MAX_NESTING} levels)"
            if isinstance(first, Token):
                raise self.error(msg, first)
            raise RuleError(msg, 1, 1, self.text)
        kids = [c for c in tree.children if isinstance(c, Tree)]
        if tree.data == "condition":
            return self.condition(tree)
        if tree.data == "group":
            return self.expr(kids[0], depth + 1)
        if tree.data == "negation":
            return Not(self.expr(kids[0], depth + 1))
        operands = tuple(self.expr(k, depth + 1) for k in kids)
        if tree.data == "and_expr":
            return And(operands)
        if tree.data == "or_expr":
            return Or(operands)
        raise RuleError(f"unexpected {tree.data}", 1, 1, self.text)  # pragma: no cover

    def condition(self, tree: Tree[Token]) -> Condition:
        tokens = [c for c in tree.children if isinstance(c, Token)]
        metric_tok, op_tok, number_tok = tokens[:3]
        self.conditions += 1
        if self.conditions > MAX_CONDITIONS:
            raise self.error(f"a rule has at most {MAX_CONDITIONS} conditions", metric_tok)
        unit_tok = next((t for t in tokens[3:] if t.type == "UNIT"), None)
        duration_tok = next((t for t in tokens[3:] if t.type == "DURATION"), None)

        metric = str(metric_tok).lower()
        if metric not in METRICS:
            close = difflib.get_close_matches(metric, list(METRICS), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise self.error(
                f"unknown metric {str(metric_tok)!r} (expected one of {', '.join(METRICS)}{hint})",
                metric_tok,
            )
        op = str(op_tok)
        assert op in COMPARATORS
        value = float(str(number_tok))
        if not math.isfinite(value):
            raise self.error(f"the threshold {str(number_tok)[:20]}... is too large", number_tok)
        allowed = METRICS[metric]
        units = ", ".join(allowed)
        example = f"{number_tok}{allowed[0]}"
        if unit_tok is None:
            raise self.error(
                f"missing unit after {number_tok}: {metric} takes {units} (e.g. {example})",
                number_tok,
            )
        unit = UNIT_SPELLINGS.get(str(unit_tok).lower())
        if unit is None:
            raise self.error(
                f"unknown unit {str(unit_tok)!r}: {metric} takes {units} (e.g. {example})",
                unit_tok,
            )
        if unit not in allowed:
            raise self.error(
                f"unit {str(unit_tok)!r} does not fit {metric}: it takes {units} (e.g. {example})",
                unit_tok,
            )
        if unit == "%" and value > 100:
            raise self.error(f"{number_tok}% is more than 100%", number_tok)
        for_seconds = 0 if duration_tok is None else self.duration(duration_tok)
        return Condition(metric, _comparator(op), value, unit, for_seconds)

    def duration(self, token: Token) -> int:
        raw = str(token).lower()
        m = _DURATION.match(raw)
        if not raw or m is None or not any(m.groups()):
            raise self.error(
                f"bad duration {str(token)!r}: write whole numbers with d, h, m, s, largest unit"
                " first (e.g. 30s, 5m, 1h30m)",
                token,
            )
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        seconds = d * 86400 + h * 3600 + mi * 60 + s
        if seconds > MAX_DURATION_SECONDS:
            raise self.error(f"duration {str(token)!r} is longer than 30d", token)
        return seconds

    def action(self, tree: Tree[Token]) -> Action:
        name_tok = tree.children[0]
        assert isinstance(name_tok, Token)
        if str(name_tok).lower() not in ACTIONS:
            raise self.error(
                f'unknown action {str(name_tok)!r} (expected alert("NAME", severity=..., message=...))',
                name_tok,
            )
        args = [c for c in tree.children if isinstance(c, Tree)]
        positional = [a for a in args if a.data == "positional"]
        keywords = [a for a in args if a.data == "keyword"]
        rpar = tree.children[-1]
        assert isinstance(rpar, Token)
        if not positional:
            raise self.error('alert needs the alert name first, e.g. alert("HIGH_LOAD")', rpar)
        if len(positional) > 1 or args[0].data != "positional":
            bad = positional[1] if args[0].data == "positional" else positional[0]
            tok = bad.children[0]
            assert isinstance(tok, Token)
            raise self.error(
                'alert takes one name, first; then severity="..." and message="..."', tok
            )
        name_str = positional[0].children[0]
        assert isinstance(name_str, Token)
        name = _unquote(str(name_str))
        if not ALERT_NAME.match(name):
            raise self.error(
                f"alert name {name!r} must be a letter or _ then letters, digits or _"
                " (it becomes the Prometheus alert name)",
                name_str,
            )
        severity, message = DEFAULT_SEVERITY, None
        seen: set[str] = set()
        for kw in keywords:
            key_tok, _eq, value_tok = kw.children
            assert isinstance(key_tok, Token) and isinstance(value_tok, Token)
            key = str(key_tok).lower()
            if key not in ("severity", "message"):
                raise self.error(
                    f"unknown argument {str(key_tok)!r} (expected severity or message)", key_tok
                )
            if key in seen:
                raise self.error(f"{key} is given twice", key_tok)
            seen.add(key)
            value = _unquote(str(value_tok))
            if key == "severity":
                if value.lower() not in SEVERITIES:
                    raise self.error(
                        f"unknown severity {value!r} (expected {' or '.join(SEVERITIES)})",
                        value_tok,
                    )
                severity = value.lower()
            else:
                message = value
        return Action(name, severity, message)


_UNESCAPE = {"n": "\n", "r": "\r", "t": "\t"}


def _unquote(raw: str) -> str:
    body = raw[1:-1]
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(1)), body, flags=re.S)


_COMPARATORS: dict[str, Comparator] = {c: c for c in COMPARATORS}


def _comparator(op: str) -> Comparator:
    return _COMPARATORS[op]  # pragma: no cover - the grammar only lexes these
