"""quantpipe's stages. Each is a plain function `run(recipe, src, out, **refs) -> metrics`:
read the input folder `src` (and named reference folders), write everything to `out`, return a
JSON-able dict of metrics for run.json. The runner owns caching, locking, logging and atomic
commits; stages know nothing about them. Heavy imports live inside the functions.
"""


class StageError(Exception):
    """The stage refuses its input; the message says what is wrong and how to fix it."""
