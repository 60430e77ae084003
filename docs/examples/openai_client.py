"""The README's Python example: the `openai` client against a server on 127.0.0.1:8000."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
answer = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", temperature=0,   # greedy: the default of 1 rambles on a 135M model
    messages=[{"role": "user", "content": "What is the capital of France?"}])
print(answer.choices[0].message.content)           # The capital of France is Paris.
