"""Test models made the plain way, without quantpipe: a LoRA merged by peft, or a one-shot llm-compressor scheme.

python tests/helpers/tiny_artifacts.py merge BASE ADAPTER OUT
python tests/helpers/tiny_artifacts.py quantize SRC OUT SCHEME      (e.g. W8A16, W4A16)
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

what, *args = sys.argv[1:]
if what == "merge":
    base, adapter, out = args
    from peft import PeftModel

    m = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    PeftModel.from_pretrained(m, adapter).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
elif what == "quantize":
    src, out, scheme = args
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    m = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    m.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
else:
    sys.exit(f"unknown command {what!r}: merge or quantize")
