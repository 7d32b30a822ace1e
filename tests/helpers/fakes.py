"""Model, adapter and task folders for the input-check tests: just enough files (config.json, safetensors
headers, a task YAML) for quantpipe's checks, with no real weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
metric_list:
  - metric: exact_match
"""


def safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A real safetensors file of zeros (bf16) with these shapes."""
    header, off = {}, 0
    for k, shape in tensors.items():
        n = 2
        for s in shape:
            n *= s
        header[k] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * off)
