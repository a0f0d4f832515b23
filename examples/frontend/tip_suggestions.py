"""Parallel branches with fork/join: two tips are expanded at the same time, then
summarised. fork() sends the shared text first so both branches reuse its cached KV.

    python examples/frontend/tip_suggestions.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from _common import backend_from_args

from radixserve.lang import Backend, ProgramState, function, gen

TIPS = ["Balanced Diet", "Regular Exercise"]


@function
def tip_suggestion(s, topic):
    s += (
        f"Here are two tips for {topic}: 1. {TIPS[0]}. 2. {TIPS[1]}.\n\n"
        "A good tip explains what to do and why it helps, in two or three sentences.\n\n"
    )
    forks = s.fork(len(TIPS))
    for branch, tip in zip(forks, TIPS, strict=True):
        branch += f"Now, expand the tip '{tip}' into a short paragraph:\n"
        branch += gen("detailed_tip", max_tokens=32, stop="\n\n", temperature=0)
    forks.join()  # the parent's "detailed_tip" becomes the list of both branches' tips
    for i, tip in enumerate(s["detailed_tip"]):
        s += f"Tip {i + 1}: {tip.strip()}\n"
    s += "\nIn summary," + gen("summary", max_tokens=24, stop="\n", temperature=0)


def run(backend: Backend, topic: str = "staying healthy") -> ProgramState:
    return tip_suggestion.run(topic, backend=backend)


if __name__ == "__main__":
    print(run(backend_from_args(__doc__)).text())
