"""The shortest output a grammar allows, read from its normalized EBNF (xgrammar's printed form).

Two things follow from it before any request runs:
- a rule that can never complete (every way through it needs itself again, as in a JSON
  schema whose required property refers back to its own object) makes jump-forward run forever:
  its forced text is infinite. Such a grammar is refused, naming the rule.
- the output of a grammar needs at least ``floor(bytes) / longest token`` tokens; a request
  whose ``max_new_tokens`` is smaller could only end cut off, invalid, and is refused.

The printed grammar has one rule per line, ``name ::= body`` with an optional lookahead
``(= ...)`` after the body, where a body is alternatives ``|`` of sequences of string literals,
character classes, rule names and parenthesized groups, each optionally repeated with ``*``,
``+``, ``?`` or ``{m, n}``. Lengths are counted in bytes, as a lower bound: an escape or a
character class counts one byte.
"""

from __future__ import annotations

import math
import re
from typing import Union

# The parsed forms: a literal's byte count, a rule reference, a sequence, a choice, a repeat.
Node = Union[int, str, tuple]  # noqa: UP007

_NAME = r"[A-Za-z_][\w.\-]*"
_RULE_START = re.compile(rf"{_NAME} ::= ")
_TAG_DISPATCH = re.compile(rf"({_NAME}) ::= TagDispatch\((.*)\)\s*$")
_DISPATCH_TARGET = re.compile(rf'\(\s*"(?:\\.|[^"\\])*"\s*,\s*({_NAME})\s*\)')


_TOKEN = re.compile(
    r"""\s*(?:
    (?P<string>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<look>\(=)
  | (?P<punct>::=|[()|*+?])
  | (?P<repeat>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  )""",
    re.VERBOSE,
)


class Unparsed(ValueError):
    """The grammar's text is not in the form this module reads (nothing is concluded)."""


def parse_rules(text: str) -> dict[str, Node]:
    """``{rule name: body}`` of a printed grammar; lookaheads are dropped."""
    rules: dict[str, Node] = {}
    for line in _rule_lines(text):
        dispatch = _TAG_DISPATCH.match(line)
        if dispatch is not None:  # structural tags: free text, or any of the tagged rules
            names = _DISPATCH_TARGET.findall(dispatch.group(2))
            rules[dispatch.group(1)] = ("rep", ("alt", names), 0) if names else 0
            continue
        tokens = _tokenize(line)
        if len(tokens) < 3 or tokens[0][0] != "name" or tokens[1] != ("punct", "::="):
            raise Unparsed(f"not a rule: {line[:80]!r}")
        body, pos = _choice(tokens, 2)
        if pos < len(tokens) and tokens[pos] == ("look", "(="):
            _, pos = _choice(tokens, pos + 1)
            pos = _expect(tokens, pos, ")")
        if pos != len(tokens):
            raise Unparsed(f"unexpected {tokens[pos][1]!r} in {line[:80]!r}")
        rules[tokens[0][1]] = body
    return rules


def shortest_outputs(rules: dict[str, Node], root: str = "root") -> dict[str, float]:
    """The fewest bytes each rule reachable from ``root`` can produce (``inf``: it can never
    complete). A fixpoint in dependency order, so it settles in a few rounds."""
    order = _postorder(rules, root)
    best = dict.fromkeys(order, math.inf)
    for _ in range(len(order) + 1):
        changed = False
        for name in order:
            value = _shortest(rules[name], best)
            if value < best[name]:
                best[name], changed = value, True
        if not changed:
            return best
    raise Unparsed("the shortest-output fixpoint did not settle")


def output_floor(text: str, root: str = "root") -> int:
    """The fewest bytes any complete output has. Raises ValueError naming a rule reachable from
    ``root`` that can never complete; Unparsed when the text is in another form."""
    best = shortest_outputs(parse_rules(text), root)
    endless = [name for name, value in best.items() if value == math.inf]
    if endless:
        name = endless[0]  # the first in dependency order: the innermost
        raise ValueError(
            f"the grammar can never finish once it enters rule '{name}': every way through it "
            "needs that rule again, so no finite output completes it (in a JSON schema: a "
            "required property, or a non-empty array's item, that refers back to its own "
            "object). Make the recursion optional"
        )
    return int(best[root])


def _rule_lines(text: str) -> list[str]:
    """One string per rule: a rule may continue over lines (TagDispatch does)."""
    lines: list[str] = []
    for line in text.splitlines():
        if _RULE_START.match(line) or not lines:
            lines.append(line)
        else:
            lines[-1] += " " + line.strip()
    return [line for line in lines if line.strip()]


def _tokenize(line: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(line):
        if line[pos:].isspace():
            break
        m = _TOKEN.match(line, pos)
        if m is None or m.end() == pos:
            raise Unparsed(f"cannot read {line[pos : pos + 20]!r}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _expect(tokens: list[tuple[str, str]], pos: int, text: str) -> int:
    if pos >= len(tokens) or tokens[pos][1] != text:
        raise Unparsed(f"expected {text!r}")
    return pos + 1


def _choice(tokens: list[tuple[str, str]], pos: int) -> tuple[Node, int]:
    options = []
    while True:
        seq, pos = _sequence(tokens, pos)
        options.append(seq)
        if pos < len(tokens) and tokens[pos] == ("punct", "|"):
            pos += 1
            continue
        return (options[0] if len(options) == 1 else ("alt", options)), pos


def _sequence(tokens: list[tuple[str, str]], pos: int) -> tuple[Node, int]:
    items: list[Node] = []
    while pos < len(tokens):
        kind, text = tokens[pos]
        if kind == "string":
            item: Node = _literal_bytes(text[1:-1])
        elif kind == "cls":
            item = 1
        elif kind == "name":
            item = text
        elif (kind, text) == ("punct", "("):
            item, pos = _choice(tokens, pos + 1)
            pos = _expect(tokens, pos, ")") - 1
        else:
            break  # "|", ")", "(=" or the end: the sequence is over
        pos += 1
        while pos < len(tokens) and (tokens[pos][0] == "repeat" or tokens[pos][1] in "*+?"):
            item = ("rep", item, _min_repeats(tokens[pos][1]))
            pos += 1
        items.append(item)
    return (items[0] if len(items) == 1 else ("seq", items)), pos


def _min_repeats(quantifier: str) -> int:
    if quantifier in ("*", "?"):
        return 0
    if quantifier == "+":
        return 1
    return max(int(quantifier.strip("{}").split(",")[0]), 0)


def _literal_bytes(body: str) -> int:
    # An escape counts one byte (a lower bound); other characters their UTF-8 length.
    unescaped = re.sub(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)", "e", body)
    return len(unescaped.encode())


def _shortest(node: Node, best: dict[str, float]) -> float:
    if isinstance(node, int):
        return node
    if isinstance(node, str):
        return best.get(node, math.inf)
    kind = node[0]
    if kind == "seq":
        return sum(_shortest(n, best) for n in node[1])
    if kind == "alt":
        return min(_shortest(n, best) for n in node[1])
    _, inner, low = node  # "rep"
    return 0 if low == 0 else low * _shortest(inner, best)


def _postorder(rules: dict[str, Node], root: str) -> list[str]:
    """Rules reachable from ``root``, each after the rules it uses (where no cycle prevents)."""
    if root not in rules:
        raise Unparsed(f"no rule '{root}'")
    order: list[str] = []
    seen = {root}
    stack = [(root, iter(_refs(rules[root])))]
    while stack:
        name, refs = stack[-1]
        child = next(refs, None)
        if child is None:
            stack.pop()
            order.append(name)
        elif child not in seen:
            if child not in rules:
                raise Unparsed(f"rule '{child}' is used but not defined")
            seen.add(child)
            stack.append((child, iter(_refs(rules[child]))))
    return order


def _refs(node: Node) -> list[str]:
    if isinstance(node, int):
        return []
    if isinstance(node, str):
        return [node]
    if node[0] == "rep":
        return _refs(node[1])
    return [r for n in node[1] for r in _refs(n)]
