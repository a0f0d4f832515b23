"""Who may call the admin routes (those that change the server's state): with --admin-api-key,
whoever sends that key; without one, only loopback clients. Keys may come from a file or the
environment, out of `ps`.

The access rules run in GuardMiddleware, in front of a real app: ASGI requests whose client
address is set (the tests may only use loopback sockets), and one real server whose admin key
comes from the environment."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from hardening import own_server
from server_process import RunningServer

from radixserve.entrypoints.http_errors import GuardMiddleware, install_error_handlers
from radixserve.entrypoints.routes_admin import ADMIN_PATHS
from radixserve.entrypoints.server_args import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    ServerArgs,
    parse_server_args,
)

API_KEY, ADMIN_KEY = "sk-user", "sk-admin"
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "127.8.9.10")
REMOTE = ("10.1.2.3", "192.168.0.7", "2001:db8::1", "::ffff:10.1.2.3")
NORMAL = "/generate"


def _app(api_key: str | None, admin_key: str | None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=1 << 20,
        admin_key=admin_key,
        admin_paths=ADMIN_PATHS,
    )
    install_error_handlers(app)
    for path in [*ADMIN_PATHS, NORMAL, "/health"]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST"])
    return app


def _statuses(app: FastAPI, client: str, key: str | None, paths: list[str]) -> set[int]:
    async def run() -> set[int]:
        transport = httpx.ASGITransport(app=app, client=(client, 4321))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as c:
            return {(await c.post(p, headers=headers)).status_code for p in paths}

    return asyncio.run(run())


ADMIN = sorted(ADMIN_PATHS)


def test_without_an_admin_key_admin_routes_answer_only_loopback() -> None:
    app = _app(None, None)
    for client in LOOPBACK:
        assert _statuses(app, client, None, ADMIN) == {200}, client
    for client in REMOTE:
        assert _statuses(app, client, None, ADMIN) == {403}, client
        assert _statuses(app, client, None, [NORMAL, "/health"]) == {200}, client


def test_without_an_admin_key_loopback_still_needs_the_api_key() -> None:
    app = _app(API_KEY, None)
    assert _statuses(app, "127.0.0.1", None, ADMIN) == {401}
    assert _statuses(app, "127.0.0.1", API_KEY, ADMIN) == {200}
    assert _statuses(app, "10.1.2.3", API_KEY, ADMIN) == {403}  # the API key opens no admin route
    assert _statuses(app, "10.1.2.3", API_KEY, [NORMAL]) == {200}


@pytest.mark.parametrize("api_key", [None, API_KEY])
def test_the_admin_key_opens_admin_routes_from_anywhere(api_key: str | None) -> None:
    app = _app(api_key, ADMIN_KEY)
    for client in (*LOOPBACK, *REMOTE):
        assert _statuses(app, client, ADMIN_KEY, ADMIN) == {200}, client
        assert _statuses(app, client, None, ADMIN) == {401}, client
        assert _statuses(app, client, "sk-wrong", ADMIN) == {401}, client
        # the admin key is a superset: it also works where the API key does
        assert _statuses(app, client, ADMIN_KEY, [NORMAL]) == {200}, client
    if api_key:
        assert _statuses(app, "10.1.2.3", API_KEY, ADMIN) == {401}
        assert _statuses(app, "10.1.2.3", API_KEY, [NORMAL]) == {200}
        assert _statuses(app, "10.1.2.3", None, [NORMAL]) == {401}


def test_keys_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    args = parse_server_args(["--api-key-file", str(key_file)])
    assert args.api_key == "sk-from-file"
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "sk-admin-env")
    args = parse_server_args([])
    assert (args.api_key, args.admin_api_key) == ("sk-from-env", "sk-admin-env")
    assert parse_server_args(["--api-key", "sk-flag"]).api_key == "sk-flag"  # the flag wins
    assert args.to_json()["admin_api_key"] == "***" and args.to_json()["api_key"] == "***"
    for argv, fragment in [
        (["--admin-api-key-file", str(tmp_path / "missing")], "cannot read the key file"),
        (["--api-key", " "], "empty key"),
    ]:
        with pytest.raises(SystemExit):
            parse_server_args(argv)
        assert fragment in capsys.readouterr().err
    key_file.write_text("\n")
    with pytest.raises(SystemExit):
        parse_server_args(["--api-key-file", str(key_file)])
    assert "empty key" in capsys.readouterr().err


def test_server_args_default_has_no_keys() -> None:
    assert ServerArgs.__dataclass_fields__["admin_api_key"].default is None


@pytest.fixture(scope="module")
def keyed(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("admin-key")
    env = {ADMIN_API_KEY_ENV: ADMIN_KEY}
    with own_server(tiny_long_llama_dir, tmp / "server.log", env=env) as running:
        yield running


def test_a_real_server_takes_the_admin_key_from_the_environment(keyed: RunningServer) -> None:
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes()
    assert ADMIN_KEY.encode() not in cmdline  # not visible in `ps`
    url = keyed.url + "/flush_cache"
    assert httpx.post(url, headers=keyed.headers, timeout=60).status_code == 401  # API key: no
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(url, headers=admin, timeout=60).status_code == 200
    r = httpx.post(keyed.url + "/abort_request", json={"abort_all": True}, timeout=60)
    assert r.status_code == 401
    assert "need --admin-api-key" in keyed.log()
