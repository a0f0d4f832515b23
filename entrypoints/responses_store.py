"""Finished /v1/responses answers kept in the HTTP process, for GET /v1/responses/{id} and for
a later request's ``previous_response_id``: each response object with its whole conversation
(the chat messages before it and its own answer, instructions left out).

Bounded: past ``max_entries`` responses or ``max_chars`` characters of conversation the oldest
are dropped (a ``previous_response_id`` naming one is then unknown, a 404). A request with
``store: false`` is not kept. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_CHARS = 64 << 20


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # its conversation, as chat messages
    chars: int


class ResponseStore:
    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_chars: int = DEFAULT_MAX_CHARS
    ) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.chars = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        chars = sum(
            len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages
        )
        self.pop(response["id"])
        self._items[response["id"]] = StoredResponse(response, messages, chars)
        self.chars += chars
        while len(self._items) > self.max_entries or (
            self.chars > self.max_chars and len(self._items) > 1
        ):
            self.pop(next(iter(self._items)))

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)  # a conversation in use stays longest
        return item

    def pop(self, response_id: str) -> StoredResponse | None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.chars -= item.chars
        return item
