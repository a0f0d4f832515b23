"""The forced tool of the agent-API tests (test_http_anthropic.py, test_http_responses.py):
enums and a bounded integer, so even the random tiny model's forced call ends quickly."""

from __future__ import annotations

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
QUESTION = "What is the weather like in Paris?"
