"""RuntimeEndpoint's wire format against a scripted HTTP server (no model): the exact bodies
SGLang's client sends (PROTOCOL.md), select's three steps and scores, SSE, and errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from server_process import free_port

from radixserve.lang import BackendError, RuntimeEndpoint, function, gen, select
from radixserve.lang.backends.base import ProgramView
from radixserve.lang.choices import METHODS
from radixserve.lang.sampling import SamplingOptions

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def char_logprob(ch: str) -> float:
    """The scripted "model": each character is a token with a fixed logprob."""
    return -((ord(ch) % 7) + 1) / 10


def entries(text: str, start: int) -> list[list[Any]]:
    out = [[char_logprob(c), ord(c), c] for c in text[start:]]
    if start == 0 and out:
        out[0][0] = None  # nothing predicts the first token
    return out


class Handler(BaseHTTPRequestHandler):
    log: list[tuple[str, str, dict[str, str], Any]]

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.log.append(("GET", self.path, dict(self.headers), None))
        if self.path == "/get_model_info":
            self._json(200, {"model_path": MODEL, "is_generation": True})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.log.append(("POST", self.path, dict(self.headers), body))
        params = body.get("sampling_params", {})
        if "bad" in str(body.get("text")):
            self._json(400, {"error": {"message": "sampling_params.regex is not supported"}})
        elif body.get("stream"):
            self._stream(["He", "Hell", "Hello!"])
        elif "input_ids" in body:
            texts = ["".join(chr(i) for i in ids) for ids in body["input_ids"]]
            self._json(200, [self._item(t, 0, body) for t in texts])
        elif isinstance(body["text"], list):
            start = body.get("logprob_start_len", 0)
            self._json(200, [self._item(t, start, body) for t in body["text"]])
        else:
            text = "" if params.get("max_new_tokens") == 0 else " reply"
            self._json(200, {"text": text, "meta_info": self._meta(body["text"])})

    def _item(self, text: str, start: int, body: dict[str, Any]) -> dict[str, Any]:
        meta = {**self._meta(text), "output_token_logprobs": []}
        meta["input_token_logprobs"] = entries(text, start) if body.get("return_logprob") else []
        return {"text": "", "meta_info": meta}

    @staticmethod
    def _meta(text: str) -> dict[str, Any]:
        return {"prompt_tokens": len(text), "completion_tokens": 0, "cached_tokens": 0}

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, texts: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in texts:
            self.wfile.write(f"data: {json.dumps({'text': t, 'meta_info': {}})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[tuple[str, list[Any]]]:
    log: list[Any] = []
    handler = type("H", (Handler,), {"log": log})
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", log
    httpd.shutdown()
    httpd.server_close()


def test_model_info_by_get_with_the_key_then_generate_by_post(server: Any) -> None:
    url, log = server
    backend = RuntimeEndpoint(url + "/", api_key="sk-1")
    assert backend.chat_template.name == "smollm2" and backend.get_model_name() == MODEL
    method, path, headers, body = log[0]
    assert (method, path, body) == ("GET", "/get_model_info", None)
    assert headers["Authorization"] == "Bearer sk-1"

    @function
    def prog(s):
        s += "Hi" + gen("x", max_tokens=4, temperature=0, return_logprob=True)

    state = prog.run(backend=backend)
    assert state["x"] == " reply"
    _, path, headers, body = log[-1]
    assert path == "/generate" and headers["Authorization"] == "Bearer sk-1"
    assert body == {
        "text": "Hi",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["<|im_end|>"]},
        "return_logprob": True,
    }


def test_select_sends_sglangs_three_requests_and_scores_them(server: Any) -> None:
    url, log = server
    backend = RuntimeEndpoint(url)

    @function
    def pick(s, method):
        s += "Answer: " + select("c", ["yes", "no way"], choices_method=method)

    for name in METHODS:
        del log[:]
        state = pick.run(name, backend=backend)
        prefix = "Answer: "
        head, scored = log[0][3], log[1][3]
        assert head == {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
        assert scored == {
            "text": [prefix + "yes", prefix + "no way"],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": len(prefix) - 2,
        }
        # The first scored entry ("r", the prefix's 2nd-to-last token) is not the end of the
        # prefix, so it stays; manual scores over ": " + choice, as SGLang's client computes.
        rows = [entries(prefix + c, len(prefix) - 2) for c in ("yes", "no way")]
        means = [sum(e[0] for e in r) / len(r) for r in rows]
        meta = state.get_meta_info("c")
        assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
        if name == "unconditional_likelihood_normalized":
            alone = log[2][3]
            assert alone == {
                "input_ids": [[e[1] for e in r] for r in rows],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
            }
            expected = [
                sum(e[0] - (0.0 if i == 0 else e[0]) for i, e in enumerate(r)) / len(r)
                for r in rows
            ]
            assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(expected)
            assert state["c"] == ["yes", "no way"][expected.index(max(expected))]
        else:
            assert len(log) == 2
        if name == "token_length_normalized":
            assert state["c"] == ["yes", "no way"][means.index(max(means))]


def test_select_drops_a_first_entry_that_is_still_prefix_text(server: Any) -> None:
    url, log = server

    @function
    def pick(s):
        s += "aa" + select("c", ["b", "cc"])  # entry 0 is "a", which ends the prefix

    state = pick.run(backend=RuntimeEndpoint(url))
    rows = [entries("aa" + c, 0)[1:] for c in ("b", "cc")]
    assert state.get_meta_info("c")["input_token_logprobs"] == rows


def test_stream_reassembles_cumulative_text(server: Any) -> None:
    url, log = server

    @function
    def prog(s):
        s += "Say hello:" + gen("x")

    backend = RuntimeEndpoint(url)
    pieces = [p for p, _ in backend.generate_stream(ProgramView("Say hello:"), SamplingOptions())]
    assert pieces == ["He", "ll", "o!"]
    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter("x")) == "Hello!" == state["x"]
    assert log[-1][3]["stream"] is True


def test_errors_name_the_route_status_and_message(server: Any) -> None:
    url, log = server

    @function
    def prog(s, text):
        s += text + gen("x")

    with pytest.raises(BackendError, match="/generate answered 400: sampling_params.regex"):
        prog.run("bad", backend=RuntimeEndpoint(url))

    @function
    def hot_select(s):
        s += "x" + select("c", ["a", "b"], temperature=0.7)

    with pytest.raises(ValueError, match="temperature must be 0"):
        hot_select.run(backend=RuntimeEndpoint(url))


def test_a_server_that_is_down_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BackendError, match=f"cannot reach the server at {url}"):
        RuntimeEndpoint(url)
