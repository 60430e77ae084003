"""The README's examples, as printed, against the embedded model: every fenced ```sh and ```python
block of README.md that talks to the server (it has a URL of 127.0.0.1:8000), and the runnable copies in
docs/examples/. Each request must answer without an error and with some text; one that asks about
France or Paris must answer with "Paris" in it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import MODEL, REPO

pytestmark = pytest.mark.slow

ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
URLS = tuple("http://" + a for a in ADDRESSES)          # a block that only mentions the address is not run
SHELLS, PYTHONS = ("sh", "bash", "shell", "console"), ("python", "py")
ASKS_FOR_PARIS = re.compile(r"France|Paris")
# Each curl in a shell example prints what it asked and how it ended around its answer.
CURL_RECORDER = r"""
curl() {
    local asked="$*"
    printf '\n@@request %s\n' "${asked//$'\n'/ }"
    command curl -sS --fail-with-body "$@"
    local status=$?
    printf '\n@@exit %s\n' "$status"
    return $status
}
"""


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced code block."""
    return [(m.group(1).lower(), m.group(2))
            for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S)]


def server_examples(markdown: str) -> list[tuple[str, str]]:
    return [(language, code) for language, code in fenced_blocks(markdown)
            if language in SHELLS + PYTHONS and any(url in code for url in URLS)]


def collect() -> list:
    params = []
    for i, (language, code) in enumerate(server_examples((REPO / "README.md").read_text())):
        kind = "sh" if language in SHELLS else "python"
        params.append(pytest.param(kind, code, id=f"README.md-block{i}-{kind}"))
    for path in sorted((REPO / "docs" / "examples").iterdir()):
        if path.suffix in (".sh", ".py"):
            params.append(pytest.param("sh" if path.suffix == ".sh" else "python", path.read_text(),
                                       id=str(path.relative_to(REPO))))
    return params


def answer_text(output: str) -> str:
    """The generated text of a JSON answer or of a stream of server-sent events (TGI or OpenAI)."""
    events = [line[5:].strip() for line in output.splitlines() if line.startswith("data:")]
    if not events:
        body = json.loads(output)
        if "generated_text" in body:
            return body["generated_text"]
        choice = body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    parts = []
    for event in events:
        if event == "[DONE]":
            continue
        body = json.loads(event)
        assert "error" not in body, body
        if "token" in body:
            parts.append(body["token"]["text"])
        elif body["choices"]:
            choice = body["choices"][0]
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return "".join(parts)


@pytest.fixture(scope="module")
def address(live_server) -> str:
    if MODEL != "default":
        pytest.skip("the examples' answers are those of the embedded model")
    return live_server.removeprefix("http://")


def at(code: str, address: str) -> str:
    for printed in ADDRESSES:
        code = code.replace(printed, address)
    return code


def test_the_readme_shows_both_apis_and_the_python_client():
    examples = server_examples((REPO / "README.md").read_text())
    shells = "\n".join(code for language, code in examples if language in SHELLS)
    assert "/generate" in shells and "/v1/" in shells
    assert any(language in PYTHONS and "OpenAI(" in code for language, code in examples)


@pytest.mark.parametrize("kind, code", collect())
def test_each_example_answers_sensibly(address, kind, code):
    if kind == "sh":
        run = subprocess.run(["bash", "-c", CURL_RECORDER + at(code, address)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        requests = run.stdout.split("\n@@request ")[1:]
        assert requests, run.stdout
        for request in requests:
            asked, _, rest = request.partition("\n")
            output, _, status = rest.rpartition("\n@@exit ")
            assert status.strip() == "0", request
            answer = answer_text(output.strip())
            assert answer.strip(), f"an empty answer to {asked}"
            if ASKS_FOR_PARIS.search(asked):
                assert "Paris" in answer, f"{asked}\nanswered: {answer!r}"
    else:
        run = subprocess.run([sys.executable, "-c", at(code, address)], capture_output=True, text=True,
                             timeout=300, cwd=REPO)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip(), "the example printed nothing"
        if ASKS_FOR_PARIS.search(code):
            assert "Paris" in run.stdout, run.stdout
