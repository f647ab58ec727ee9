"""What a request's output must match (vLLM's structured-output parameters), as plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. `grammar` is Lark (llguidance's dialect) or GBNF (`::=` rules,
    as xgrammar takes them). With `after_token_id`, the constraint starts after the output
    produced that token (the end of a reasoning block); until then the output is free."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]  # fmt: skip
        if sum(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"
