def test_moe_default_capture(tiny_qwen3_moe_dir):
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(tiny_qwen3_moe_dir), dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    cc = llm.llm_engine.vllm_config.compilation_config
    print("\nCAPTURE", cc.cudagraph_capture_sizes[-5:], cc.cudagraph_mode, llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    print("TOKENS", llm.generate(["hello"], SamplingParams(max_tokens=5))[0].outputs[0].token_ids)
