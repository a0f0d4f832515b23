"""Shared command line for the frontend examples: ``--url`` of a running server."""

from __future__ import annotations

import argparse

from radixserve.lang import RuntimeEndpoint

DEFAULT_URL = "http://127.0.0.1:30000"  # `make serve`


def backend_from_args(description: str, argv: list[str] | None = None) -> RuntimeEndpoint:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server URL (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    args = parser.parse_args(argv)
    return RuntimeEndpoint(args.url, api_key=args.api_key)
