"""quantpipe's stages, each a plain function `run(inp, src, out, upstream) -> metrics` (a JSON-able dict for run.json;
see stages/contract.py). The runner owns caching, locking, logging and atomic commits; stages know nothing about them
and never import each other (what they share is in quantpipe.common). Heavy imports live inside the functions."""


class StageError(Exception):
    """The stage refuses its input; the message says what is wrong and how to fix it."""
