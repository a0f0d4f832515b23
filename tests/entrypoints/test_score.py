"""SGLang's /v1/score against the shared server: each item's label-token probabilities equal
those computed with transformers from the logits after query + item (or item + query)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch
from server_process import RunningServer

QUERY = "The quick brown fox"
ITEMS = [" jumps over", " is lazy. The quick brown fox jumps over the lazy dog", "!"]
LABELS = [5, 17, 42, 100]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_long_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_long_llama_dir, torch_dtype=torch.float32)


def reference(hf_model, ids: list[int], labels: list[int], softmax: bool) -> list[float]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    if softmax:
        return torch.softmax(logits[labels], dim=-1).tolist()
    return torch.softmax(logits, dim=-1)[labels].tolist()


def tokenize(server: RunningServer, texts: list[str]) -> list[list[int]]:
    r = requests.post(server.url + "/tokenize", json={"prompt": texts}, headers=server.headers)
    return r.json()["tokens"]


def score(server: RunningServer, **body) -> requests.Response:  # type: ignore[no-untyped-def]
    return requests.post(server.url + "/v1/score", json=body, headers=server.headers, timeout=60)


def assert_rows_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < TOL, (g, w)


@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_scores_equal_transformers(
    server: RunningServer, hf_model, softmax: bool, item_first: bool
) -> None:  # type: ignore[no-untyped-def]
    r = score(
        server, query=QUERY, items=ITEMS, label_token_ids=LABELS,
        apply_softmax=softmax, item_first=item_first,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring"
    texts = [i + QUERY if item_first else QUERY + i for i in ITEMS]
    prompts = tokenize(server, texts)
    want = [reference(hf_model, ids, LABELS, softmax) for ids in prompts]
    assert_rows_close(out["scores"], want)
    if softmax:
        assert all(abs(sum(row) - 1.0) < 1e-5 for row in out["scores"])
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_token_id_scores_with_labels_per_item(server: RunningServer, hf_model) -> None:  # type: ignore[no-untyped-def]
    query, items = [7, 8, 9, 10], [[11, 12], [13], [14, 15, 16]]
    labels = [[1, 2], [3, 4, 5], [6]]
    r = score(server, query=query, items=items, label_token_ids=labels, apply_softmax=True)
    assert r.status_code == 200, r.text
    want = [
        reference(hf_model, query + item, lab, True)
        for item, lab in zip(items, labels, strict=True)
    ]
    assert_rows_close(r.json()["scores"], want)


def test_empty_items_give_no_scores(server: RunningServer) -> None:
    r = score(server, query=QUERY, items=[], label_token_ids=LABELS)
    assert r.status_code == 200 and r.json()["scores"] == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"query": QUERY, "label_token_ids": LABELS}, "items"),
        ({"query": "a\ud800", "items": ITEMS, "label_token_ids": LABELS}, "surrogate"),
        ({"query": QUERY, "items": ITEMS}, "label_token_ids"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": []}, "label_token_ids"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [10**9]}, "label_token_ids"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [-1]}, "label_token_ids"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [3, 3]}, "repeat"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [[1], [2]]}, "one per item"),
        ({"query": [1, 2], "items": ITEMS, "label_token_ids": LABELS}, "both"),
        ({"query": QUERY, "items": [[1]], "label_token_ids": LABELS}, "both"),
        ({"query": "", "items": [""], "label_token_ids": LABELS}, "empty"),
        ({"items": ITEMS, "label_token_ids": LABELS, "temperature": 0.5}, "apply_softmax"),
        ({"items": ITEMS, "label_token_ids": LABELS, "temperature": 0}, "temperature"),
        ({"items": [[10**9]], "label_token_ids": LABELS}, "vocabulary"),
        ({"items": ITEMS, "label_token_ids": LABELS, "apply_softmax": "yes"}, "apply_softmax"),
    ],
)
def test_bad_score_requests_are_400(server: RunningServer, body: dict, needle: str) -> None:
    r = score(server, **body)
    assert r.status_code == 400, r.text
    assert needle in r.text
