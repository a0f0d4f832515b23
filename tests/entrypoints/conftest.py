"""A real server on loopback over a tiny random Llama, shared by the HTTP test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from model_gate import install_plugin
from radixserve_test_drafters import DRAFT_TOKENS
from radixserve_test_drafters import NAME as TEST_DRAFTER
from server_process import (
    TINY_API_KEY,
    TINY_CONTEXT,
    RunningServer,
    start_server,
    stop_server,
    tiny_server_args,
)
from tiny_models import make_tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 2048-token context, so a long generation can be cut short."""
    out = tmp_path_factory.mktemp("tiny-llama-2k")
    return make_tiny_llama_dir(out, max_position_embeddings=TINY_CONTEXT)


@pytest.fixture(scope="session")
def server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    running = start_server(tiny_server_args(tiny_long_llama_dir), log, TINY_API_KEY, timeout=300)
    yield running
    code = stop_server(running)
    # --debug-leak-check makes the engine fail (and the server exit non-zero) on a KV leak.
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


@pytest.fixture(scope="session")
def overlap_server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The shared server's settings with overlap scheduling forced on (the CPU default is off),
    so load and disconnect tests also cover steps committed one step late."""
    log = tmp_path_factory.mktemp("overlap-server-log") / "server.log"
    args = [*tiny_server_args(tiny_long_llama_dir), "--enable-overlap-schedule"]
    running = start_server(args, log, TINY_API_KEY, timeout=300)
    info = requests.get(running.url + "/get_server_info", headers=running.headers, timeout=30)
    assert info.json()["enable_overlap_schedule"] is True, info.text
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


@pytest.fixture(params=["sync", "overlap"])
def any_server(request: pytest.FixtureRequest) -> RunningServer:
    """The shared server, then the same with overlap scheduling."""
    return request.getfixturevalue("server" if request.param == "sync" else "overlap_server")


@pytest.fixture(scope="session")
def spec_server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The shared server's settings with speculative decoding on: the test drafter
    (tests/support/radixserve_test_drafters.py) installed as a third-party plugin and chosen
    with SGLang's flags."""
    tmp = tmp_path_factory.mktemp("spec-server")
    env = install_plugin(tmp / "site", "radixserve_test_drafters")
    args = [*tiny_server_args(tiny_long_llama_dir), "--speculative-algorithm", TEST_DRAFTER]
    # SGLang's --speculative-num-draft-tokens counts the verified token too
    args += ["--speculative-num-draft-tokens", str(DRAFT_TOKENS + 1)]
    args += ["--speculative-disable-batch-size", "64"]  # every request (the CPU's cut-off: 2)
    # every step drafts (no pausing for drafts that do not pay): exact token accounting
    args += ["--speculative-disable-pause"]
    running = start_server(args, tmp / "server.log", TINY_API_KEY, timeout=300, env=env)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


# A Qwen3-like template: enable_thinking=false closes an empty think block in the prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def parser_server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The shared server's settings with SGLang's --tool-call-parser llama3 and
    --reasoning-parser qwen3, and a template that renders chat_template_kwargs' enable_thinking
    (tests force the model's output with a regex)."""
    tmp = tmp_path_factory.mktemp("parser-server")
    (tmp / "template.jinja").write_text(THINKING_TEMPLATE)
    args = [*tiny_server_args(tiny_long_llama_dir), "--chat-template", str(tmp / "template.jinja")]
    args += ["--tool-call-parser", "llama3", "--reasoning-parser", "qwen3"]
    running = start_server(args, tmp / "server.log", TINY_API_KEY, timeout=300)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"
