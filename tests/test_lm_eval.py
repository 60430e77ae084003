"""lm-evaluation-harness's own ``local-completions`` model against a live server, on a small
multiple-choice task whose data this test writes: the harness scores each choice with
``echo: true, logprobs: 1, max_tokens: 1`` over token-id prompts, several per request when its
batch size is above 1, and reads the prompt positions' ``token_logprobs`` and ``top_logprobs``."""

import json

import httpx
import pytest

from models.loader import converted_gguf_folder
from models.sources import embedded_gguf_path

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

# Questions a 135M-parameter model answers far better than chance, and wrong choices far off.
DOCS = [             # the harness puts its target delimiter, a space, between question and choice
    ("The capital of France is", ["Paris", "a banana", "purple"], 0),
    ("One, two, three, four,", ["carrot", "five", "the"], 1),
    ("The sun rises in the", ["fork", "spoon", "east"], 2),
    ("Monday, Tuesday,", ["Wednesday", "elephant", "seven"], 0),
    ("Water is made of hydrogen and", ["oxygen", "cheese", "music"], 0),
    ("The opposite of hot is", ["cold", "blue", "chair"], 0),
]

TASK = """task: flashdecode_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (folder / "flashdecode_mc.yaml").write_text(TASK.format(data=data))
    return folder


def evaluate(url: str, task_dir, batch_size: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    model_args = {"base_url": f"{url}/v1/completions", "model": "default", "tokenizer_backend": "huggingface",
                  "tokenizer": str(converted_gguf_folder(embedded_gguf_path())), "num_concurrent": 1,
                  "max_retries": 1, "tokenized_requests": True}
    return simple_evaluate(model="local-completions", model_args=model_args, tasks=["flashdecode_mc"],
                           batch_size=batch_size, task_manager=TaskManager(include_path=str(task_dir)),
                           log_samples=True)


def scores(results) -> list[list[float]]:
    return [[resp[0][0] for resp in sample["resps"]] for sample in results["samples"]["flashdecode_mc"]]


def test_lm_eval_local_completions_scores_a_multiple_choice_task(live_server, task_dir):
    one = evaluate(live_server, task_dir, batch_size=1)
    four = evaluate(live_server, task_dir, batch_size=4)
    assert one["results"]["flashdecode_mc"]["acc,none"] >= 5 / 6
    assert four["results"]["flashdecode_mc"]["acc,none"] == one["results"]["flashdecode_mc"]["acc,none"]
    by_one, by_four = scores(one), scores(four)
    assert all(x == pytest.approx(y, abs=1e-3) for a, b in zip(by_one, by_four) for x, y in zip(a, b))
    # each score is the sum of the continuation tokens' log-probabilities the server reports
    doc = one["samples"]["flashdecode_mc"][0]
    context, continuation = doc["arguments"][0]
    with httpx.Client(base_url=live_server, timeout=120) as http:
        context_ids, continuation_ids = (
            http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
            for text in (context, continuation))
        body = {"model": "default", "prompt": context_ids + continuation_ids, "max_tokens": 0, "echo": True,
                "logprobs": 1}
        reported = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert by_one[0][0] == pytest.approx(sum(reported[len(context_ids):]), abs=1e-3)
