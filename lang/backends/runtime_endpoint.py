"""RuntimeEndpoint: a radixserve (or SGLang) server through its native HTTP API.

It speaks the wire contract of SGLang's own client (PROTOCOL.md): GET when there is no body,
POST with JSON when there is, ``Authorization: Bearer`` when a key is given, any status but
200 is an error, streams are SSE events with cumulative ``text`` ending in ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from radixserve.lang.backends.base import BackendError
from radixserve.lang.backends.native import Body, NativeBackend
from radixserve.lang.chat_template import get_chat_template, template_for_model

# Forks and run_batch threads share one session; keep a connection for each.
_POOL_SIZE = 64


class RuntimeEndpoint(NativeBackend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: str | None = None,
        timeout: float | None = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_SIZE)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.model_info: dict[str, Any] = self._request("/get_model_info").json()
        model_path = str(self.model_info.get("model_path", ""))
        self.chat_template = (
            get_chat_template(chat_template) if chat_template else template_for_model(model_path)
        )

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def get_server_info(self) -> dict[str, Any]:
        return self._request("/get_server_info").json()

    def flush_cache(self) -> None:
        self._request("/flush_cache", {"empty_cache": True})

    def post(self, body: Body) -> Any:
        return self._request("/generate", body).json()

    def post_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        with self._request("/generate", body, stream=True) as response:
            for raw in response.iter_lines():
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def shutdown(self) -> None:
        self.session.close()

    def _request(self, path: str, body: Body | None = None, stream: bool = False) -> Any:
        url = self.base_url + path
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            if body is None:
                response = self.session.get(url, headers=headers, timeout=self.timeout)
            else:
                response = self.session.post(
                    url, json=body, headers=headers, timeout=self.timeout, stream=stream
                )
        except requests.ConnectionError as e:
            raise BackendError(f"cannot reach the server at {self.base_url}: {e}") from e
        except requests.Timeout as e:
            raise BackendError(f"{url} did not answer within {self.timeout} s") from e
        if response.status_code != 200:
            raise BackendError(f"{path} answered {response.status_code}: {_error_text(response)}")
        return response


def _error_text(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)[:500]
