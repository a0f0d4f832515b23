"""/start_profile and /stop_profile as SGLang has them: its body fields are checked here, and
torch.profiler runs in the engine process, where the model runs (entrypoints/profiler.py). Traces go
only under the profile directory: --profile-dir, else $RADIXSERVE_TORCH_PROFILER_DIR, else
SGLang's $SGLANG_TORCH_PROFILER_DIR, else /tmp. A request's ``output_dir`` names a directory
inside it (a relative one is taken from it); one that leaves it is a 400 and nothing is written.
The trace is named ``<profile_id>-TP-0.trace.json.gz`` as SGLang names it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints import ipc
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.ipc import PROFILE_ACTIVITIES as ACTIVITIES
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"
DIR_ENV_ALIAS = "RADIXSERVE_TORCH_PROFILER_DIR"  # wins when both are set
# Writing a long trace takes the engine a while; a start answers at once.
STOP_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ProfileDir:
    """The one directory traces are written under (its real path: symlinks resolved)."""

    root: Path

    @classmethod
    def configured(cls, flag: str | None) -> ProfileDir:
        root = flag or os.environ.get(DIR_ENV_ALIAS) or os.environ.get(DIR_ENV) or "/tmp"
        return cls(Path(os.path.realpath(Path(root).expanduser())))

    def resolve(self, output_dir: str | None) -> str:
        """``output_dir`` (None: the root itself) as a real path inside the root; a 400 for
        one that leaves it (``..``, an absolute path elsewhere, a symlink out)."""
        path = Path(os.path.realpath(self.root / (output_dir or ".")))
        if path != self.root and self.root not in path.parents:
            raise ApiError(
                400,
                f"output_dir {output_dir!r:.200} is outside the profile directory {self.root}; "
                "name a directory inside it (set by --profile-dir or $SGLANG_TORCH_PROFILER_DIR)",
                param="output_dir",
            )
        return str(path)


async def start_profile(
    tm: TokenizerManager, body: dict[str, Any], profile_dir: ProfileDir
) -> dict[str, Any]:
    """Start the engine's profiler; 400 when it runs already or a field is bad."""
    fields = _start_fields(body)
    fields["output_dir"] = profile_dir.resolve(fields["output_dir"])
    reply = await tm.client.call(lambda call_id: ipc.ProfileRequest(call_id=call_id, **fields))
    return _answer(reply, "profiling started; the trace will be written to")


async def stop_profile(tm: TokenizerManager) -> dict[str, Any]:
    """Stop the profiler and write the trace; 400 when none runs."""
    reply = await tm.client.call(
        lambda call_id: ipc.ProfileRequest(call_id=call_id, action="stop"), STOP_TIMEOUT_S
    )
    return _answer(reply, "profiling stopped; the trace was written to")


def _answer(reply: ipc.ProfileReply, done: str) -> dict[str, Any]:
    if not reply.ok:
        raise ApiError(400, reply.message)
    return {
        "success": True,
        "message": f"{done} {reply.trace_path} ({reply.message})",
        "trace_path": reply.trace_path,
    }


#: The most steps a profile may count: a trace grows with every step it records, and the
#: profiler holds it in memory until it is written.
MAX_PROFILE_STEPS = 10_000


def _start_fields(body: dict[str, Any]) -> dict[str, Any]:
    output_dir = _path_part(body, "output_dir")
    activities = _optional(body, "activities", list) or list(ACTIVITIES)
    bad = [a for a in activities if a not in ACTIVITIES]
    if bad:
        raise InvalidRequest(f"activities {bad!r:.200} are not supported; use {list(ACTIVITIES)}")
    num_steps = _count(body, "num_steps")
    if _count(body, "start_step") is not None:
        raise InvalidRequest("start_step is not supported; start the profile when it should run")
    if _optional(body, "profile_by_stage", bool):
        raise InvalidRequest("profile_by_stage is not supported; profile without it")
    prefix = _path_part(body, "profile_prefix")
    profile_id = str(body.get("profile_id") or time.time())
    if not profile_id.isprintable():
        raise InvalidRequest(f"profile_id must be printable text, got {profile_id!r:.200}")
    name = f"{prefix + '-' if prefix else ''}{profile_id}-TP-0.trace.json.gz"
    if "/" in name or name.startswith("."):
        raise InvalidRequest(f"profile_prefix and profile_id must not form a path: {name!r:.200}")
    return {
        "action": "start",
        "output_dir": output_dir,
        "file_name": name,
        "activities": activities,
        "num_steps": num_steps,
        # on unless turned off, as SGLang has them
        "record_shapes": _optional(body, "record_shapes", bool) is not False,
        "with_stack": _optional(body, "with_stack", bool) is not False,
    }


def _optional(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise InvalidRequest(f"{key} must be a {kind.__name__}, got {value!r:.200}")
    return value


def _path_part(body: dict[str, Any], key: str) -> str | None:
    """An optional string that becomes part of a file path: no NUL or control characters
    (which no path holds, and which made the engine's mkdir raise)."""
    value = _optional(body, key, str)
    if value is not None and not value.isprintable():
        raise InvalidRequest(f"{key} must be printable text, got {value!r:.200}")
    return value


def _count(body: dict[str, Any], key: str) -> int | None:
    """A positive step count; SGLang's bench client sends it as a string."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PROFILE_STEPS:
        raise InvalidRequest(
            f"{key} must be a positive integer up to {MAX_PROFILE_STEPS}, got {value!r:.200}"
        )
    return value
