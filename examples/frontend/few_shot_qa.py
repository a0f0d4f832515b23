"""Few-shot question answering: worked examples, then the question; the answer stops at the
end of its line.

    python examples/frontend/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from _common import backend_from_args

from radixserve.lang import Backend, ProgramState, function, gen

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
]


@function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + gen("answer", max_tokens=16, stop="\n", temperature=0)


def run(backend: Backend, question: str = "What is the capital of Spain?") -> ProgramState:
    return few_shot_qa.run(question, backend=backend)


if __name__ == "__main__":
    state = run(backend_from_args(__doc__))
    print(state.text())
    print("answer:", state["answer"].strip())
