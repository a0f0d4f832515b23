"""bench/serving.py reports latency statistics as SGLang's bench_serving computes them."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # for bench/common.py
    try:
        spec = importlib.util.spec_from_file_location("bench_serving", BENCH / "serving.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_percentiles_interpolate_like_numpy(serving: ModuleType) -> None:
    values = [(i * 37 % 64 + 1) / 1000 for i in range(64)]  # 1..64 ms, shuffled
    st = serving._stats(values)
    cuts = statistics.quantiles([v * 1000 for v in values], n=100, method="inclusive")
    assert st["p99"] == pytest.approx(cuts[98]) and st["p99"] < 64.0  # not the maximum
    assert st["p90"] == pytest.approx(cuts[89]) and st["p95"] == pytest.approx(cuts[94])
    assert st["median"] == pytest.approx(32.5) and st["mean"] == pytest.approx(32.5)
    assert st["std"] == pytest.approx(statistics.pstdev(v * 1000 for v in values))
    assert set(serving._stats([])) == set(serving.STAT_KEYS)


def test_native_itl_spreads_a_chunk_over_its_tokens(serving: ModuleType) -> None:
    counts = [1, 3, 3, 4]  # the second chunk brings two tokens, the third none

    def handler(request: httpx.Request) -> httpx.Response:
        events = [{"text": "x" * c, "meta_info": {"completion_tokens": c}} for c in counts]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body)

    async def go() -> object:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            args = argparse.Namespace(backend="native")
            return await serving.send(client, args, "m", serving.Request([1, 2], 4))

    result = asyncio.run(go())
    assert result.ok and result.output_tokens == 4
    assert len(result.itl) == 3  # one gap per token after the first
    assert result.itl[0] == result.itl[1]
