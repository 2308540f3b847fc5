"""The shapes the kernel probes measure, defined once: SmolLM2-135M's GEMMs
(the default model's linear layers and LM head)."""

# name -> (out_features, in_features)
SHAPES: dict[str, tuple[int, int]] = {
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
# The GEMMs of one decoder layer (the LM head runs once per step).
LAYER_SHAPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
