"""ProgramState: the ``s`` a program appends to; ProgramStateGroup: the result of fork(n)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from radixserve.lang import ir
from radixserve.lang.interpreter import StreamExecutor


class ProgramState:
    """The state of one running program: ``s += text | gen(...) | select(...) | role block``;
    ``s["name"]`` waits for a variable, ``s["name"] = value`` sets one; ``s.text()`` and
    ``s.messages()`` wait for all."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        self.executor.submit(ir.to_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        """Whether the program has set variable ``name`` (waits for submitted work)."""
        self.sync()
        return name in self.executor.variables

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set variable ``name`` to ``value`` (no text is added; its meta_info is None),
        after any queued gen/select that assigns it."""
        self.executor.put_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """What the backend reported for variable ``name`` (cached_tokens, scores, ...)."""
        return self.executor.get_meta_info(name)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self.executor.variables)

    def text(self) -> str:
        self.sync()
        return self.executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The closed role blocks as OpenAI-style messages."""
        self.sync()
        return list(self.executor.messages_)

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        """The error that stopped the program, or None (waits for submitted work)."""
        try:
            self.executor.sync()
        except Exception as e:  # noqa: BLE001 - returned, not swallowed
            return e
        return None

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup(self, [ProgramState(e) for e in self.executor.fork(size)])

    # -- roles ---------------------------------------------------------------------------------

    def system(self, expr: Any = None) -> AbstractContextManager[None] | None:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> AbstractContextManager[None] | None:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> AbstractContextManager[None] | None:
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> AbstractContextManager[None] | None:
        if expr is not None:
            self += ir.ExprList([ir.RoleBegin(role), ir.to_expr(expr), ir.RoleEnd(role)])
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(ir.RoleBegin(role))
        yield
        self.executor.submit(ir.RoleEnd(role))

    # -- streaming -----------------------------------------------------------------------------

    def text_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> Iterator[Any]:
        """The program's text (or one variable) piece by piece as it is generated; without
        ``stream=True`` a single piece, once complete. With ``return_meta_data`` (a variable
        only) each piece comes as ``(text, meta_info)``, the output logprob lists holding that
        piece's own tokens, as in SGLang's frontend."""
        if return_meta_data and var_name is None:
            raise ValueError("return_meta_data needs a variable name")
        if not self.executor.stream:
            if var_name is None:
                yield self.text()
            elif return_meta_data:
                yield str(self[var_name]), self.get_meta_info(var_name)
            else:
                yield str(self[var_name])
            return
        if return_meta_data:
            yield from self.executor.stream_chunks_with_meta(var_name)
        else:
            yield from self.executor.stream_chunks(var_name)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio code: waits in a worker thread, not on the event loop."""
        chunks = self.text_iter(var_name, return_meta_data)
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, next, chunks, None)
            if piece is None:
                return
            yield piece

    def __repr__(self) -> str:
        return f"ProgramState({self.executor.text_!r})"  # no waiting: what is there so far


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: ``forks[i] += ...`` or ``forks += ...`` (an expression
    for all, a list with one per branch, or a function of the branch index), then ``join()``."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        self.parent = parent
        self.states = states

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        if state is not self.states[i]:  # `forks[i] += x` stores the same state back
            raise TypeError("a fork's branch cannot be replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        elif callable(other):
            fn: Callable[[int], Any] = other
            for i, state in enumerate(self.states):
                state += fn(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable``: each variable the branches set becomes
        a list (one value per branch) in the parent. ``concate_and_append``: the text each
        branch added is appended to the parent, in branch order."""
        executors = [s.executor for s in self.states]
        if mode == "gather_variable":
            for e in executors:
                e.sync()
            names = list(dict.fromkeys(n for e in executors for n in e.assigned))
            parent = self.parent.executor
            parent.sync()
            for name in names:
                values = [e.variables.get(name) for e in executors]
                parent.set_var(name, values, [e.meta_info.get(name) for e in executors])
        elif mode == "concate_and_append":
            self.parent += ir.ConcatForks(executors)
            self.parent.sync()
        else:
            raise ValueError(
                f"unknown join mode {mode!r}; use gather_variable or concate_and_append"
            )
        for e in executors:
            e.end()
