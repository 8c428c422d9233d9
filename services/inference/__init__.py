"""The inference engine: a vLLM-compatible OpenAI server on transformers (CPU or CUDA).

It is what the gateway talks to in development and tests, and the contract vLLM meets in
production: exact prompt and completion token ids, processed log-probs, and the policy
version that served each response.
"""
