"""SUPAWorker and SUPAModelRunner for vLLM's V1 engine."""
