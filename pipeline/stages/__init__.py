"""quantpipe's stages, each a plain function `run(inp, src, out, upstream) -> metrics` (a JSON-able dict for run.json;
see stages/contract.py). The runner owns caching, locking, logging and atomic commits; stages know nothing about them
and never import each other (what they share is in quantpipe.common). Heavy imports live inside the functions."""


class StageError(Exception):
    """The stage refuses its input; the message says what is wrong and how to fix it."""


class HostFault(StageError):
    """The stage failed for a reason of the host at that moment (out of memory, a killed or hung server, a taken port or
    GPU), not a verdict on its input: nothing of it is cached, and the next run (or, on a shared GPU, the same run with the
    GPU to itself) tries it again."""

    fault = True
