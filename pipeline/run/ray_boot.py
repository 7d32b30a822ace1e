"""Sent to Ray's workers by value (its code travels with the task): on the node, load quantpipe from the checkout at
the driver's path, as `worker.py` does for a stage, then call the node side (`run/ray_node.py`). So the Python that
started a node needs Ray and quantpipe's light dependencies, not quantpipe installed.

    ray.remote(call).remote("/opt/quantpipe/pipeline", "run_stage", job)
"""


def call(package_dir: str, name: str, job: dict):
    import importlib
    import importlib.util
    import socket
    import sys
    from pathlib import Path

    init = Path(package_dir) / "__init__.py"
    if "quantpipe" not in sys.modules:
        if not init.is_file():
            raise RuntimeError(
                f"no quantpipe checkout at {package_dir} on {socket.gethostname()}: every node needs the driver's "
                "checkout at the same path (docs/cluster.md)"
            )
        spec = importlib.util.spec_from_file_location("quantpipe", init, submodule_search_locations=[package_dir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["quantpipe"] = mod
        spec.loader.exec_module(mod)
    return getattr(importlib.import_module("quantpipe.run.ray_node"), name)(job)
