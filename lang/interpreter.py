"""The stream executor: one worker thread per program state runs its expressions in order.

``submit`` only queues an expression, so gen() and select() do not block the program; a
program blocks only when it reads a variable (``s["x"]``), its text, or joins forks. Forked
states have their own executors (threads), so their generations run in parallel and the
backend batches them.

The executor owns the program's assembled text, its chat messages (one per closed role block)
and its named variables with their meta_info. A failed expression stops the executor; the
error is raised to whoever reads the state afterwards.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from radixserve.lang import ir
from radixserve.lang.backends.base import STREAM_DELTA_KEYS, Backend, ProgramView
from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.sampling import SamplingOptions


class StreamExecutor:
    def __init__(
        self,
        backend: Backend,
        defaults: SamplingOptions | None = None,
        chat_template: ChatTemplate | None = None,
        stream: bool = False,
        use_thread: bool = True,
    ) -> None:
        self.backend = backend
        self.defaults = defaults or SamplingOptions()
        self.chat_template = chat_template or backend.chat_template
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[str] = []  # image(path) arguments, in prompt order
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.role_begin_pos = 0
        self.fork_start_pos = 0
        self.error: BaseException | None = None
        self.finished = False
        self._ended = False
        self.children: list[StreamExecutor] = []
        self.assigned: list[str] = []  # variables this executor set (not inherited by a fork)
        self._done: set[str] = set()  # variables whose value is final
        self._assigning: Counter[str] = Counter()  # queued gen/select per variable, not yet run
        self._partial: dict[str, str] = {}  # streamed variables, as far as they got
        self._pieces: dict[str, list[dict[str, Any]]] = {}  # each streamed piece's meta_info
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue[ir.Expr] = queue.Queue()
        self._thread: threading.Thread | None = None
        if use_thread:
            self._thread = threading.Thread(target=self._work, name="radixserve-lang", daemon=True)
            self._thread.start()

    # -- called from the program's thread ------------------------------------------------------

    def submit(self, expr: ir.Expr) -> None:
        with self._cond:
            if self._ended:
                raise RuntimeError("this program has ended; its state takes no more expressions")
            self._pending += 1
            self._assigning.update(_assigned_names(expr))
        if self._thread is None:
            self._run(expr)
        else:
            self._queue.put(expr)

    def sync(self) -> None:
        """Wait until every submitted expression ran; raise the error if one failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def get_var(self, name: str) -> Any:
        """The variable's value from the last gen/select queued so far that assigns it."""
        with self._cond:
            self._cond.wait_for(lambda: self._final(name) or self._pending == 0)
        self.raise_error()
        if name not in self._done:
            known = ", ".join(sorted(self._done)) or "none"
            raise KeyError(f"the program has no variable {name!r} (variables set: {known})")
        return self.variables[name]

    def put_var(self, name: str, value: Any) -> None:
        """Set a variable from the program, in order: after the queued gen/select that
        assign it (a later one would overwrite it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._assigning[name] == 0)
        self.set_var(name, value, None)

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def fork(self, size: int) -> list[StreamExecutor]:
        """Copies of this state that continue independently; the shared text is sent to the
        backend first (no generation) so its prefix cache holds it for every branch."""
        if size < 1:
            raise ValueError(f"fork needs a size >= 1, got {size}")
        if size > 1:
            self.submit(ir.CommitPrefix())
        self.sync()
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.defaults, self.chat_template, self.stream)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.images_ = list(self.images_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child._done = set(self._done)
            child.cur_role, child.role_begin_pos = self.cur_role, self.role_begin_pos
            child.fork_start_pos = len(self.text_)
            forks.append(child)
        self.children.extend(forks)
        return forks

    def end(self) -> None:
        """No more expressions: stop the worker once the queue drains (children too)."""
        for child in self.children:
            child.end()
        with self._cond:
            if self._ended:
                return
            self._ended = True
        if self._thread is None:
            self._finish()
        else:
            self._queue.put(ir.End())

    def view(self) -> ProgramView:
        role_text = self.text_[self.role_begin_pos :] if self.cur_role else ""
        images = tuple(self.images_)
        return ProgramView(self.text_, list(self.messages_), self.cur_role, role_text, images)

    def stream_chunks(self, name: str | None) -> Iterator[str]:
        """New text of the whole program (``name`` None) or of one variable, as it arrives."""
        for piece, _ in self.stream_chunks_with_meta(name):
            yield piece

    def stream_chunks_with_meta(self, name: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
        """``stream_chunks`` with each chunk's meta_info, as SGLang's frontend gives it: the
        latest event's fields, with the output-side logprob lists holding only the chunk's own
        tokens (events that brought no text are merged into the next chunk)."""
        seen = used = 0

        def ready() -> bool:
            return len(self._current(name)) > seen or self._over(name)

        while True:
            with self._cond:
                self._cond.wait_for(ready)
                text, over = self._current(name), self._over(name)
                pieces = self._pieces.get(name, []) if name is not None else []
                meta = merge_stream_meta(pieces[used:])
                fresh = len(pieces)
            if len(text) > seen:
                yield text[seen:], meta
                seen, used = len(text), fresh
            elif over:
                break
        self.raise_error()
        if name is not None and name not in self._done:
            self.get_var(name)  # raises the unknown-variable error

    # -- the worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if isinstance(expr, ir.End):
                self._finish()
                return
            self._run(expr)

    def _run(self, expr: ir.Expr) -> None:
        try:
            if self.error is None:
                self._execute(expr)
        except Exception as e:  # noqa: BLE001 - kept and raised to the program's reader
            self.error = e
        finally:
            with self._cond:
                self._pending -= 1
                self._assigning.subtract(_assigned_names(expr))
                self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def _final(self, name: str) -> bool:
        """The variable is set and no queued gen/select will assign it again."""
        return name in self._done and self._assigning[name] == 0

    def _current(self, name: str | None) -> str:
        if name is None:
            return self.text_
        if self._final(name):
            return str(self.variables[name])
        if self._assigning[name] > 1:
            return ""  # any partial text is an earlier assignment's; stream the last one
        return self._partial.get(name, "")

    def _over(self, name: str | None) -> bool:
        if self.error is not None or self.finished:
            return True
        return name is not None and self._final(name)

    # -- expressions ---------------------------------------------------------------------------

    def _execute(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.Text):
            self._append(expr.value)
        elif isinstance(expr, ir.ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, ir.Gen):
            self._gen(expr)
        elif isinstance(expr, ir.Select):
            decision = self.backend.select(self.view(), expr.choices, expr.temperature, expr.method)
            self._append(decision.decision)
            self.set_var(expr.name, decision.decision, decision.meta_info)
        elif isinstance(expr, ir.Image):
            self.images_.append(expr.path)
            self._append(self.chat_template.image_token)
        elif isinstance(expr, ir.RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, ir.RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, ir.CommitPrefix):
            if self.text_:
                self.backend.cache_prefix(self.text_)
        elif isinstance(expr, ir.ConcatForks):
            for fork in expr.forks:
                fork.sync()
                self._append(fork.text_[fork.fork_start_pos :])
        else:
            raise TypeError(f"the interpreter cannot execute {type(expr).__name__}")

    def _append(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def set_var(self, name: str | None, value: Any, meta: Any) -> None:
        with self._cond:
            if name is not None:
                if name not in self.assigned:
                    self.assigned.append(name)
                self.variables[name] = value
                self.meta_info[name] = meta
                self._done.add(name)
                self._partial.pop(name, None)
            self._cond.notify_all()

    def _gen(self, expr: ir.Gen) -> None:
        options = expr.options.over(self.defaults).with_stop(self.chat_template.stop_str)
        view = self.view()
        if not self.stream:
            text, meta = self.backend.generate(view, options)
            self._append(text)
            self.set_var(expr.name, text, meta)
            return
        value, pieces = "", []
        for piece, piece_meta in self.backend.generate_stream(view, options):
            with self._cond:
                value += piece
                self.text_ += piece
                pieces.append(piece_meta)
                if expr.name is not None:
                    self._partial[expr.name] = value
                    self._pieces[expr.name] = pieces
                self._cond.notify_all()
        self.set_var(expr.name, value, merge_stream_meta(pieces))

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside the open {self.cur_role!r} block")
        system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and system:
            self._role_begin("system")
            self._append(system)
            self._role_end("system")
        prefix, _ = self.chat_template.prefix_and_suffix(role)
        self._append(prefix)
        self.cur_role, self.role_begin_pos = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends, but the open block is {self.cur_role!r}")
        content = self.text_[self.role_begin_pos :]
        self.messages_.append({"role": role, "content": content.lstrip()})
        self.cur_role = None
        self._append(self.chat_template.prefix_and_suffix(role)[1])


def _assigned_names(expr: ir.Expr) -> list[str]:
    """The variables a gen/select in ``expr`` sets when it runs."""
    if isinstance(expr, ir.ExprList):
        return [name for item in expr.items for name in _assigned_names(item)]
    if isinstance(expr, (ir.Gen, ir.Select)) and expr.name is not None:
        return [expr.name]
    return []


def merge_stream_meta(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """One meta_info for consecutive stream pieces: the last piece's fields, with the delta
    lists of all of them joined."""
    if not pieces:
        return {}
    merged = dict(pieces[-1])
    for key in STREAM_DELTA_KEYS:
        if any(key in p for p in pieces):
            merged[key] = [entry for p in pieces for entry in p.get(key) or []]
    return merged
