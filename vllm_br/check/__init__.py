"""``vllm-br check``: conformance checks a SUPA machine owner runs and sends
back (docs/check.md).

Groups, each a module: ``ops`` (every registered op but attention against a
float64 formula, float32 and bfloat16), ``attention`` (paged attention with
block size 128, the KV-cache write, encoder attention, MLA), ``graphs``
(capture and replay), ``memory`` (the accounting that sizes the KV cache),
``collectives`` (the plugin's communicator across devices, one process
each) and ``e2e`` (a tiny random Llama through vLLM against HF
transformers). ``runner`` runs them, ``report`` prints them, ``command`` is
the CLI. Importing this package imports nothing heavy.
"""
