"""The expression objects a program appends to its state (``s += ...``).

Expressions are plain values; the interpreter (interpreter.py) executes them in order. ``+``
joins expressions (and strings) into an ``ExprList``, so ``s += "Q: " + gen("a")`` works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.lang.choices import ChoicesMethod
from radixserve.lang.sampling import SamplingOptions

if TYPE_CHECKING:
    from radixserve.lang.interpreter import StreamExecutor


class Expr:
    """Base of every expression; ``a + b`` concatenates."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr]

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.items, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), *self.items])


@dataclass(eq=False)
class Gen(Expr):
    """Generate text; the result is stored under ``name`` (when given)."""

    name: str | None
    options: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(eq=False)
class Image(Expr):
    """An image (a file path, a data: URL or base64 text) at this point of the prompt: the
    chat template's image token in the text, the image sent beside it."""

    path: str


@dataclass(eq=False)
class Select(Expr):
    """Append the choice the backend scores best; stored under ``name`` (when given)."""

    name: str | None
    choices: list[str]
    temperature: float
    method: ChoicesMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class CommitPrefix(Expr):
    """Send the text so far to the backend with no generation, so its prefix cache holds it."""


@dataclass(eq=False)
class ConcatForks(Expr):
    """Append, in order, the text each fork added after it was forked."""

    forks: list[StreamExecutor]


@dataclass(eq=False)
class End(Expr):
    """The program is finished; the executor's worker stops after this."""


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (list, tuple)):
        return ExprList([to_expr(v) for v in value])
    raise TypeError(
        f"a program state takes text or gen/select/role expressions, got {type(value).__name__}"
    )
