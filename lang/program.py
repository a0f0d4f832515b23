"""A program: a Python function decorated with ``@function``, run once or over a batch."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backends.base import Backend
from radixserve.lang.interpreter import StreamExecutor
from radixserve.lang.sampling import SAMPLING_FIELDS, SamplingOptions
from radixserve.lang.state import ProgramState
from radixserve.lang.tracer import shared_prefix

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs use when ``run`` is not given one."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Function:
    """``@function``-decorated program: ``fn.run(*args, **kwargs)`` or
    ``fn.run_batch([kwargs or args, ...])``. Keyword arguments named like sampling options
    (``max_new_tokens``, ``temperature``, ``stop``, ...) that are not parameters of the program
    become defaults for every gen() in it."""

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        self.func = func
        self.bound = dict(bound or {})
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters)
        if not params:
            raise TypeError(f"{func.__name__} must take the program state as its first argument")
        self.arg_names = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some arguments fixed."""
        return Function(self.func, {**self.bound, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any
    ) -> ProgramState:
        """Run the program; returns its state (with ``stream=True`` at once, while it runs).
        An error inside the program is raised here (without ``stream``)."""
        backend = _backend(backend)
        defaults, kwargs = self._split(kwargs)
        call = self._bind(args, kwargs)
        executor = StreamExecutor(backend, defaults, stream=stream)
        state = ProgramState(executor)
        if stream:
            threading.Thread(
                target=self._execute, args=(state, call), name="radixserve-program", daemon=True
            ).start()
            return state
        self._execute(state, call, raise_errors=True)
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[Mapping[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per item (a dict of keyword arguments or a list/tuple of
        positional ones), ``num_threads`` at a time; states come back in input order. Errors
        stay in each state (``state.error()``; reading it raises). The text all runs share up
        to their first argument or generation is sent to the backend first (no generation) so
        its prefix cache holds it."""
        backend = _backend(backend)
        defaults, extra = self._split(sampling)
        if extra:
            raise TypeError(f"run_batch got unknown keyword arguments: {', '.join(extra)}")
        items = [self._bind_batch_item(i, item) for i, item in enumerate(batch_kwargs)]
        if len(items) > 1:
            prefix = shared_prefix(self.func, backend.chat_template)
            if prefix:
                backend.cache_prefix(prefix)
        states = [ProgramState(StreamExecutor(backend, defaults)) for _ in items]
        threads = _thread_count(num_threads, len(items))
        bar = _progress(len(items)) if progress_bar else None
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futures = [pool.submit(self._execute, s, a) for s, a in zip(states, items, strict=True)]
            for future in futures:
                future.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def _split(self, kwargs: dict[str, Any]) -> tuple[SamplingOptions, dict[str, Any]]:
        """(gen defaults, program arguments) from run()'s keyword arguments."""
        options = {
            k: kwargs.pop(k)
            for k in list(kwargs)
            if k in SAMPLING_FIELDS and k not in self.arg_names
        }
        return SamplingOptions(**options), kwargs

    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(None, *args, **{**self.bound, **kwargs})
        except TypeError as e:
            raise TypeError(f"{self.__name__}: {e}") from None

    def _bind_batch_item(self, index: int, item: Any) -> inspect.BoundArguments:
        if isinstance(item, Mapping):
            return self._bind((), dict(item))
        if isinstance(item, (list, tuple)):
            return self._bind(item, {})
        raise TypeError(
            f"{self.__name__}.run_batch: item {index} is a {type(item).__name__}; give a dict "
            "of keyword arguments or a list/tuple of positional arguments"
        )

    def _execute(
        self, state: ProgramState, call: inspect.BoundArguments, raise_errors: bool = False
    ) -> None:
        try:
            state.ret_value = self.func(state, *call.args[1:], **call.kwargs)
            state.executor.sync()
        except Exception as e:
            if state.executor.error is None:
                state.executor.error = e
            if raise_errors:
                raise
        finally:
            state.executor.end()


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator: ``@function`` turns ``def prog(s, question): s += ...`` into a program."""
    if func is None:
        return function
    return Function(func)


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise RuntimeError(
            "no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))"
        )
    return chosen


def _thread_count(num_threads: int | str, n: int) -> int:
    if num_threads == "auto":
        return max(1, min(n, 64))  # threads mostly wait on the backend, which batches
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return min(num_threads, max(n, 1))


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total)
