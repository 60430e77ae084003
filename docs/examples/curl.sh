#!/usr/bin/env bash
# The README's curl examples against a server on 127.0.0.1:8000 (`make run`). A chat (`messages`)
# is rendered with the model's chat template; a raw `inputs` text is continued as it stands.
set -euo pipefail

# TGI-style, streamed as server-sent events, one event per token (greedy unless sampling is asked for)
curl -N http://127.0.0.1:8000/generate_stream -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}],
       "parameters": {"max_new_tokens": 32}}'

# a raw text is continued, not answered: give it the start of the answer
curl http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
  -d '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}'

# sampling: temperature and top_p, and a seed to draw the same text again
curl http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Write a short poem about Paris."}],
       "parameters": {"max_new_tokens": 48, "temperature": 0.7, "top_p": 0.9, "seed": 1}}'

# OpenAI-compatible, streamed; temperature 0 is greedy (OpenAI's default, 1, rambles on a small model)
curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "stream": true, "temperature": 0,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
