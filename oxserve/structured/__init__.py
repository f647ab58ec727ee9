"""Structured outputs: constraints on what a request may generate, enforced by a token mask.

    StructuredOutputs (params.py)   what the request asked for: a JSON schema, a regex, ...
        | GrammarCompiler.grammar() (grammar.py): checked once, when the request arrives
        v
    llguidance grammar (a string) -> one matcher per request, owned by the runner
        | BatchMasks.apply() (masks.py): one bitmask for the batch, each step, before sampling
        v
    logits of disallowed tokens = -inf; the sampled token advances the matcher
"""

from oxserve.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
