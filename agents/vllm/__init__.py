"""vLLM's CPU build as a kvprefetch node engine: install checks, a tiny local model, and a
real ``vllm`` OpenAI server process beside the node's ``lmcache server``.

Nothing here imports vLLM at import time; the server runs in its own process.
"""
