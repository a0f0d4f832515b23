"""EngineBackend: programs run against an in-process radixserve Engine (no HTTP).

It hands the same native request bodies RuntimeEndpoint sends to ``Engine.generate``, so
select() scoring, prefix caching and results match the server's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixserve.lang.backends.base import BackendError
from radixserve.lang.backends.native import Body, NativeBackend
from radixserve.lang.chat_template import get_chat_template, template_for_model
from radixserve.lang.sampling import REQUEST_FIELDS

if TYPE_CHECKING:
    from radixserve.entrypoints.engine import Engine

# Native fields the in-process engine has no use for.
_DROPPED_PARAMS = ("spaces_between_special_tokens",)


class EngineBackend(NativeBackend):
    """``EngineBackend(engine)`` wraps a running Engine; ``EngineBackend(model_path=...)``
    (or no argument: the default model) starts one and shuts it down in ``shutdown()``."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        model_path: str | None = None,
        chat_template: str | None = None,
        **engine_settings: Any,
    ) -> None:
        self._owns_engine = engine is None
        if engine is None:
            from radixserve.entrypoints.engine import Engine

            engine = Engine(model_path, **engine_settings)
        self.engine = engine
        name = model_path or str(engine.model_dir)
        self.chat_template = (
            get_chat_template(chat_template)
            if chat_template
            else template_for_model(name, engine.tokenizer.chat_template)
        )

    def get_model_name(self) -> str:
        return str(self.engine.model_dir)

    def post(self, body: Body) -> Any:
        return self._generate(body, stream=False)

    def post_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        for event in self._generate(body, stream=True):
            _raise_if_aborted(event)
            yield event

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()

    def _generate(self, body: Body, stream: bool) -> Any:
        from radixserve.core.request import InvalidRequest
        from radixserve.entrypoints.engine import EngineDeadError

        params = {
            k: None if v == [] and k not in ("stop", "stop_token_ids") else v
            for k, v in (body.get("sampling_params") or {}).items()
            if k not in _DROPPED_PARAMS
        }
        extra = {k: body[k] for k in (*REQUEST_FIELDS, "image_data") if body.get(k) is not None}
        try:
            out = self.engine.generate(
                body.get("text"), params, input_ids=body.get("input_ids"), stream=stream, **extra
            )
        except (InvalidRequest, EngineDeadError) as e:
            raise BackendError(f"the engine refused the request: {e}") from e
        if not stream:
            for item in out if isinstance(out, list) else [out]:
                _raise_if_aborted(item)
        return out


def _raise_if_aborted(result: dict[str, Any]) -> None:
    reason = result.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"the engine aborted the request: {reason.get('message')}")
