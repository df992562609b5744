"""Prefill worker: computes prompts in batches, samples the first token, ships the KV to a decode worker."""
