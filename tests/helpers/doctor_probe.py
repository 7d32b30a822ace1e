"""`doctor.probe()` and the GPU verdicts, run in the serve environment with quantpipe loaded from a folder.

<serve env>/bin/python tests/helpers/doctor_probe.py PACKAGE/__init__.py PACKAGE_DIR    prints RESULT {json}
"""

import importlib.util
import json
import sys

spec = importlib.util.spec_from_file_location("quantpipe", sys.argv[1], submodule_search_locations=[sys.argv[2]])
mod = importlib.util.module_from_spec(spec)
sys.modules["quantpipe"] = mod
spec.loader.exec_module(mod)
from quantpipe import doctor  # noqa: E402

scheme = {label: s for label, _, s, _ in doctor.SCHEMES}
gpu = {
    cc: {label: doctor._cuda_verdict(scheme[label], cls, cc)[0] for label, _, _, cls in doctor.SCHEMES if cls}
    for cc in (80, 90)
}
print("RESULT " + json.dumps({"probe": doctor.probe(), "gpu": gpu}))
