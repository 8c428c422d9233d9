"""The gateway: where a harness's model calls cross into training.

A harness is handed a base URL and nothing else changes for it. Every OpenAI or Anthropic
call it makes is forwarded to an inference engine with exact token ids and log-probs
requested, answered exactly as the API would, and captured as a ModelCall event.
"""
