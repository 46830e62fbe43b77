"""The two sides of every comparison: the rollout engine (vLLM) and the HF reference scorer.

Each adapter imports its heavy dependency (vllm, transformers) only when used.
"""
