"""quantpipe's stages. Each is a plain function `run(inp, src, out, upstream) -> metrics`: `inp` is the
stage's typed slice of the recipe (stages/contract.py), `src` its input folder, `out` the folder it writes
everything to, `upstream` the records of the other stages it reads; it returns a JSON-able dict of metrics
for run.json. The runner owns caching, locking, logging and atomic commits; stages know nothing about them
and never import each other (what they share is in quantpipe.common). Heavy imports live inside the functions.
"""


class StageError(Exception):
    """The stage refuses its input; the message says what is wrong and how to fix it."""
