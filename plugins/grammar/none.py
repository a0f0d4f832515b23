"""Grammar backend ``none``: constrained decoding off. Requests asking for a grammar get a clear
error instead of unconstrained output."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend


class NoGrammarBackend(GrammarBackend):
    def __init__(
        self, tokenizer: object = None, vocab_size: int = 0, stop_token_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer

    def compile(self, kind: str, spec: str) -> Grammar:
        raise ValueError(
            f"constrained decoding ({kind}) needs a grammar backend; the selected one is 'none' "
            "(choose one with --plugin grammar=NAME; see `radixserve plugins`)"
        )


@hookimpl
def register_grammar_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("none", NoGrammarBackend, description="no constrained decoding")
