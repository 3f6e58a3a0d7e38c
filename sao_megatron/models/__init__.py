"""Megatron-Core models: actor (GPT MoE), critic (value head), logprobs, HF name mapping."""
