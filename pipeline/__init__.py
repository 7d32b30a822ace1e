"""quantpipe: measured, repeatable builds of quantized LLM artifacts.

    quantpipe run recipes/demo.yaml

merge LoRA adapters (peft) -> quantize (llm-compressor) -> validate (lm-eval + your own set)
-> benchmark (vLLM) -> package + report. See README.md.
"""

__version__ = "0.1.0"
