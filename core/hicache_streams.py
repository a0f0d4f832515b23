"""The order of HiCache's host copies against the compute stream (``--hicache-io-backend``).

``direct``: the copies run on the compute stream, in its order; nothing to wait for on the
device. ``kernel`` (CUDA): backups and loads run on two copy streams, each first waiting for
the compute stream's queued work (the KV a backup reads is written; the slots a load writes
are free). The compute stream waits for a load before its next kernels (a step reads the
loaded pages), or for each layer of a per-layer load before that layer's attention, but not
for a backup: a backup's event is what the cache passes to ``fence``
before the backed-up device slots are freed (a step writes them only after they were read),
and to ``load`` for the host slots it wrote (a load reads them only after they were written).
A backup waits for the last load queued (a host slot a load reads may be freed and reused).

With pinned host buffers (CUDA) the copies are asynchronous in either mode: the events after
the last backup and the last load are what host-side readers and writers of the host buffers
wait for (``wait``). Every line past ``direct`` on a CPU pool is CUDA's: the gpu-marked tests
of tests/core/test_hicache_pool.py check the waits, each against a stream held up by a sleep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class CopyStreams:
    def __init__(self, device: torch.device, io_backend: str) -> None:
        self.device = device
        kernel = io_backend == "kernel"
        self.backup_stream: Any = torch.cuda.Stream(device) if kernel else None
        self.load_stream: Any = torch.cuda.Stream(device) if kernel else None
        self.asynchronous = device.type == "cuda"  # pinned host buffers
        self.pending_backup: Any = None  # CUDA events after the last queued backup and load
        self.pending_load: Any = None

    @contextmanager
    def backup(self) -> Iterator[None]:
        """The block's copies as a backup (on the backup stream, if any; the compute stream
        does not wait for them)."""
        with _on(self.backup_stream, (self.pending_load,), compute_waits=False):
            yield
            self.pending_backup = self._event()

    def backup_event(self) -> Any:
        """The last backup's event to fence with and to pass to ``load``; None when the copies
        run in the compute stream's order."""
        return self.pending_backup if self.backup_stream is not None else None

    @contextmanager
    def load(self, backups: tuple[Any, ...]) -> Iterator[None]:
        """The block's copies as a load, after the backups ``backups`` (events; None ones are
        done already); the compute stream waits for it."""
        with _on(self.load_stream, backups, compute_waits=True):
            yield
            self.pending_load = self._event()

    @contextmanager
    def load_layers(self, backups: tuple[Any, ...]) -> Iterator[Callable[[], Any]]:
        """The block's copies as a load the compute stream does not wait for as a whole: the
        yielded ``mark()`` records an event after the copies so far (one per layer) and
        returns it, for the compute stream to wait on layer by layer (``KVPool.wait_layer``);
        it returns None where the copies are in the compute stream's order."""
        stream = self.load_stream
        with _on(stream, backups, compute_waits=False):
            yield (lambda: None) if stream is None else self._event
            self.pending_load = self._event()

    def fence(self, backup: Any) -> None:
        """Make the compute stream wait (on the device) for ``backup``'s copies."""
        if backup is not None:
            torch.cuda.current_stream(self.device).wait_event(backup)

    def wait(self) -> None:
        """Block until the copies queued so far (backups and loads) ran."""
        for pending in (self.pending_backup, self.pending_load):
            if pending is not None:
                pending.synchronize()
        self.pending_backup = self.pending_load = None

    def _event(self) -> Any:
        if not self.asynchronous:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


@contextmanager
def _on(stream: Any, after: tuple[Any, ...], compute_waits: bool) -> Iterator[None]:
    """With a copy stream: the block on it after the compute stream's queued work and the
    events ``after``; with ``compute_waits``, the compute stream waits for it afterwards.
    Without one: the block as it is."""
    if stream is None:
        yield
        return
    compute = torch.cuda.current_stream(stream.device)
    stream.wait_stream(compute)
    for event in after:
        if event is not None:
            stream.wait_event(event)
    with torch.cuda.stream(stream):
        yield
    if compute_waits:
        compute.wait_stream(stream)
