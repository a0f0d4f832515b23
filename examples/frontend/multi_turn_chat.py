"""A multi-turn chat: role blocks become the model's chat template on the client side, and
each assistant turn stops at the template's end-of-turn marker.

    python examples/frontend/multi_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from _common import backend_from_args

from radixserve.lang import Backend, ProgramState, assistant, function, gen, system, user


@function
def multi_turn_chat(s, question_1, question_2):
    s += system("You are a helpful assistant. Answer briefly.")
    s += user(question_1)
    s += assistant(gen("answer_1", max_tokens=32, temperature=0))
    s += user(question_2)
    s += assistant(gen("answer_2", max_tokens=32, temperature=0))


def run(
    backend: Backend,
    question_1: str = "What is the capital of France?",
    question_2: str = "What is a famous tower in that city?",
) -> ProgramState:
    return multi_turn_chat.run(question_1, question_2, backend=backend)


if __name__ == "__main__":
    for message in run(backend_from_args(__doc__)).messages():
        print(f"{message['role']:>9}: {message['content']}")
