"""The playground's files and route, without a browser: what GET / serves, that it needs
nothing from elsewhere, that it stays reachable behind an API key, and that the package ships it."""

import hashlib
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from server import routes_playground
from tests.test_http_app import FakeEngine, client_for

REPO = Path(__file__).resolve().parents[1]
PLAYGROUND = REPO / "server" / "playground"
# markdown-it 15.0.3 from npm, dist/browser/markdown-it.umd.min.js, unchanged.
MARKDOWN_IT_SHA256 = "391f2aa638e75e6c7859d0a5c5650ef0956722a45998f17e05b83bc655778e1e"


def referenced_assets(html: str) -> list[str]:
    return re.findall(r'<(?:script|link)\b[^>]*?\b(?:src|href)="([^"]+)"', html)


def test_root_serves_the_page_and_every_file_it_references():
    with client_for() as client:
        r = client.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        assets = [a for a in referenced_assets(r.text) if not a.startswith("data:")]
        assert set(assets) == {"/playground/app.css", "/playground/vendor/markdown-it.min.js",
                               "/playground/app.js"}
        for path in assets:
            asset = client.get(path)
            assert asset.status_code == 200, path
            expected = "text/css" if path.endswith(".css") else "text/javascript"
            assert asset.headers["content-type"].startswith(expected), path
        assert client.get("/playground/nope.js").status_code == 404
        assert client.get("/playground/../app.py").status_code == 404


def test_the_page_loads_nothing_from_elsewhere():
    for name in ("index.html", "app.js", "app.css"):
        text = (PLAYGROUND / name).read_text()
        assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", text), name
        assert "@import" not in text and "fetch(\"http" not in text, name
    assert not re.search(r"<script>(?!</script>)", (PLAYGROUND / "index.html").read_text())


def test_the_playground_stays_reachable_behind_an_api_key():
    with client_for(api_key="s3cret") as client:
        for path in routes_playground.PATHS:
            assert client.get(path).status_code == 200, path
        for path in ("/metrics", "/v1/models", "/v1/chat/completions"):
            assert client.get(path).status_code in (401,), path
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/metrics", headers=ok).status_code == 200
        paths = client.get("/openapi.json", headers=ok).json()["paths"]
        assert not set(paths) & routes_playground.PATHS


def test_the_package_ships_every_playground_file():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server"]
    files = [p.relative_to(REPO / "server").as_posix() for p in PLAYGROUND.rglob("*") if p.is_file()]
    assert files
    for f in files:
        assert any(fnmatch(f, g) and f.count("/") == g.count("/") for g in globs), f
    for name, _ in routes_playground.ASSETS.values():
        assert (PLAYGROUND / name).is_file(), name


def test_the_vendored_renderer_is_the_pinned_release_with_its_licences():
    vendored = (PLAYGROUND / "vendor" / "markdown-it.min.js").read_bytes()
    assert hashlib.sha256(vendored).hexdigest() == MARKDOWN_IT_SHA256
    licence = (PLAYGROUND / "vendor" / "markdown-it.LICENSE.txt").read_text()
    for bundled in ("markdown-it 15.0.3", "entities 8.1.0", "linkify-it 6.1.0", "mdurl 2.1.0",
                    "punycode.js 2.3.1", "uc.micro 3.0.0"):
        assert f"==== {bundled} ====" in licence, bundled


@pytest.mark.parametrize("sampled", [0, 7])
def test_metrics_export_the_live_token_counter(sampled):
    engine = FakeEngine()

    class Stats:
        running, waiting, kv_blocks_total, kv_blocks_used, sampled_tokens = 0, 0, 10, 0, sampled

    engine.stats = lambda: Stats()
    with client_for(engine) as client:
        text = client.get("/metrics").text
    assert f"llm_sampled_tokens_total {float(sampled)}" in text
