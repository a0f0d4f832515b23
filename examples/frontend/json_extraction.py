"""JSON extraction constrained by a regex: the server's grammar engine only lets the model
write text that matches, so the result always parses.

    python examples/frontend/json_extraction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import json

from _common import backend_from_args

from radixserve.lang import Backend, ProgramState, function, gen

CITY_REGEX = (
    r"\{\n"
    r'  "name": "[\w ]{1,24}",\n'
    r'  "country": "[\w ]{1,24}",\n'
    r'  "population_millions": [0-9]{1,3}\n'
    r"\}"
)

DOCUMENT = (
    "Paris is the capital and largest city of France, with about 2 million residents in the "
    "city proper and 11 million in its metropolitan area."
)


@function
def extract_city(s, document):
    s += "Extract the city described in the document as JSON.\n\n"
    s += f"Document: {document}\n\nJSON:\n"
    s += gen("json", max_tokens=64, regex=CITY_REGEX, temperature=0)


def run(backend: Backend, document: str = DOCUMENT) -> ProgramState:
    return extract_city.run(document, backend=backend)


if __name__ == "__main__":
    state = run(backend_from_args(__doc__))
    print(json.dumps(json.loads(state["json"]), indent=2))
