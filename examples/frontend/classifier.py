"""A select()-based sentiment classifier over a batch of reviews (run_batch): the model's
likelihood of each label decides, nothing is sampled.

    python examples/frontend/classifier.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from _common import backend_from_args

from radixserve.lang import Backend, ProgramState, function, select

REVIEWS = [
    "An absolute delight from start to finish. I loved every minute of it!",
    "Terrible. Boring plot, awful acting, a complete waste of money.",
    "Wonderful food and friendly staff; we will definitely come back.",
    "The product broke after one day and support never answered. Awful.",
]


@function
def classify(s, review):
    s += f"Review: {review}\nSentiment (positive or negative): "
    s += select("sentiment", ["positive", "negative"])


def run(backend: Backend, reviews: list[str] = REVIEWS) -> list[ProgramState]:
    return classify.run_batch([{"review": r} for r in reviews], backend=backend)


if __name__ == "__main__":
    for review, state in zip(REVIEWS, run(backend_from_args(__doc__)), strict=True):
        print(f"{state['sentiment']:>8}  {review}")
