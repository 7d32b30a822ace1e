"""A stage's output as llm-compressor writes it: a log line, then a progress bar redrawn with \\r, 1.5 s apart."""

import sys
import time

w = sys.stdout.write
w(
    "2026-12-01T21:59:05.6384 | compress_module_list | INFO - Quantizing 1 module(s): ['model.layers.1.self_attn.v_proj']\n"
)
for n in (4, 20):
    w(f"(3/5): Calibrating:  31%|###       | {n}/64 [00:08<00:17,  2.56it/s]\r")
    sys.stdout.flush()
    time.sleep(1.5)
w("\n")
