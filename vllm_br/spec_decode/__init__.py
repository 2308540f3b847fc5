"""Speculative decoding on SUPA: vLLM's proposers run unchanged through
SUPAModelRunner; this package holds the plain-torch versions of their Triton
kernels and the start-up check of the speculative configuration."""
