"""torch.profiler around engine steps, started and stopped from the server (/start_profile,
/stop_profile as in SGLang). Runs in the engine process, where the model does; the trace is a
Chrome trace (``export_chrome_trace``; gzipped when the name ends in .gz)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve.entrypoints.ipc import PROFILE_ACTIVITIES

logger = logging.getLogger(__name__)


class ProfilerError(ValueError):
    """A start or stop the profiler refuses; the message says why (the server answers 400)."""


def supported_activities() -> tuple[str, ...]:
    """The activities this machine can record: GPU only where CUDA is present."""
    return PROFILE_ACTIVITIES if torch.cuda.is_available() else ("CPU",)


class EngineProfiler:
    """One profile at a time. ``after_step`` counts engine steps and ends a profile started
    with ``num_steps`` by itself."""

    def __init__(self) -> None:
        self._prof: profile | None = None
        self.trace_path = ""
        self.activities: list[str] = []  # what the profile records
        self._steps_left: int | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(
        self,
        output_dir: str,
        file_name: str,
        activities: list[str],
        num_steps: int | None = None,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> str:
        """Start profiling; return the path the trace will be written to."""
        if self._prof is not None:
            raise ProfilerError("profiling is already in progress; call /stop_profile first")
        usable = supported_activities()
        chosen = [a for a in activities if a in usable]
        if not chosen:
            raise ProfilerError(
                f"cannot record activities {activities} here; this machine records {list(usable)}"
            )
        directory = Path(output_dir).expanduser()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise ProfilerError(f"cannot create output_dir {output_dir!r}: {e}") from None
        # The server checked ``output_dir`` as a real path inside the profile directory; a
        # symlink put in its place since (before the mkdir above) would lead elsewhere.
        if os.path.realpath(directory) != str(directory.absolute()):
            raise ProfilerError(f"output_dir {output_dir!r} changed into a link; not written")
        kinds = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
        prof = profile(
            activities=[kinds[a] for a in chosen],
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        prof.start()
        self._prof = prof
        self.activities = chosen
        self.trace_path = str(directory / file_name)
        self._steps_left = num_steps
        logger.warning("profiling %s; the trace goes to %s", chosen, self.trace_path)
        return self.trace_path

    def after_step(self) -> str | None:
        """Count one engine step; when the profile's ``num_steps`` are done, stop it and
        return the trace's path."""
        if self._prof is None or self._steps_left is None:
            return None
        self._steps_left -= 1
        return self.stop() if self._steps_left <= 0 else None

    def stop(self) -> str:
        """Stop profiling and write the trace; return its path."""
        prof = self._prof
        if prof is None:
            raise ProfilerError("profiling is not in progress; call /start_profile first")
        self._prof = None
        prof.stop()
        _export_without_following(prof, self.trace_path)
        logger.warning("profile written to %s", self.trace_path)
        return self.trace_path


def _export_without_following(prof: Any, path: str) -> None:
    """Write the trace beside ``path`` under a fresh name, then rename it over ``path``: a
    rename replaces a symlink at ``path`` instead of writing through it (a link planted in
    the profile directory must not turn the trace into a write to any file)."""
    directory, name = os.path.split(path)
    # the same ending: torch compresses a trace whose name ends in .gz
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=f"-{name}", dir=directory)
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
