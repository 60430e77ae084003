"""The documents stay short and point at things that exist.

Every Markdown file under docs/ has at most 300 lines and the README at most 200. In those and in
docker/README.md, every relative link resolves (to a file, and to a heading where it names one),
every repository path they name exists (globs must match something), and every dotted name of one
of the repository's packages (``python -m benchmarks.kernel_bench``, ``kernels.read_kv``) is a
module, or a name that module defines.
"""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
DOCUMENTS = [ROOT / "README.md", ROOT / "docker" / "README.md", *DOCS]
LINE_LIMITS = {ROOT / "README.md": 200, **{doc: 300 for doc in DOCS}}

PACKAGES = ("server", "models", "kernels", "load_tests", "benchmarks", "tests")
# the repository's top-level names; a path is checked when its first part is one of them
TOP_LEVEL = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(".git") and p.name not in
                   (".venv", ".cache", "results", "build", ".pytest_cache", ".hypothesis", ".whl"))
# a path whose first part is a folder inside a package (csrc/, engine/, results/) is checked
# against each package when it names a file of one of these kinds
# where commands write their output (git ignores it): `--out results/engine.json` names no file
GENERATED = ("results",)
FILE_KINDS = ("py", "md", "cu", "cuh", "h", "cpp", "json", "txt", "sh", "toml", "yml", "yaml", "conf", "png")

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w.$/~:-])(\.?[A-Za-z_][\w.-]*(?:/[\w.*{},-]+)+/?)")
DOTTED = re.compile(r"(?<![\w./:-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
FENCE = re.compile(r"^(```|~~~)")


def headings(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def path_exists(candidate: str) -> bool:
    return all(glob.glob(str(ROOT / p)) for p in expand_braces(candidate))


def named_paths(text: str) -> list[str]:
    """The repository paths a text names, as written (trailing punctuation dropped)."""
    found = []
    for raw in PATH.findall(URL.sub(" ", text)):
        path = raw.rstrip(".,:;")
        first = path.split("/")[0]
        if first in TOP_LEVEL:
            found.append(path)
        elif (first not in GENERATED and path.rsplit(".", 1)[-1] in FILE_KINDS
              and any((ROOT / pkg / first).is_dir() for pkg in PACKAGES)):
            found.append(path)
    return found


def resolves(path: str) -> bool:
    if path.split("/")[0] in TOP_LEVEL:
        return path_exists(path)
    return any(path_exists(f"{pkg}/{path}") for pkg in PACKAGES)


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines(source: str, name: str) -> bool:
    n = re.escape(name)
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{n}\b|^\s*{n}\s*[:=]|\bimport\b[^\n]*\b{n}\b"
                     rf"|^\s+{n}\s*[,)]", source, re.M) is not None


def dotted_resolves(name: str) -> bool:
    """A module of the repository, or a module followed by a name it defines (methods beyond it
    are not checked)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = module_file(parts[:i])
        if module is None:
            continue
        return i == len(parts) or defines(module.read_text(), parts[i])
    return False


def named_modules(text: str) -> list[str]:
    found = []
    for name in DOTTED.findall(URL.sub(" ", text)):
        parts = name.split(".")
        if len(parts) == 2 and parts[1] in FILE_KINDS:     # a file name such as "kernels.md"
            continue
        found.append(name)
    return found


@pytest.mark.parametrize("doc", list(LINE_LIMITS), ids=lambda p: str(p.relative_to(ROOT)))
def test_document_is_short(doc):
    lines = len(doc.read_text().splitlines())
    assert lines <= LINE_LIMITS[doc], f"{doc.relative_to(ROOT)} has {lines} lines, the limit is {LINE_LIMITS[doc]}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if URL.match(target) or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in headings(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_and_modules_exist(doc):
    text = doc.read_text()
    missing = [p for p in named_paths(text) if not resolves(p)]
    missing += [m for m in named_modules(text) if not dotted_resolves(m)]
    assert not missing, f"{doc.relative_to(ROOT)} names what the repository lacks: {sorted(set(missing))}"


def test_the_checks_catch_what_moved_or_never_was():
    # names that must not resolve: a benchmark's old place, a missing file, an undefined name
    text = ("`python -m kernels.bench`, `kernels/bench.py`, kernels/results/h200_bench.json, "
            "`kernels.no_such_function`, [x](docs/absent.md)")
    assert [p for p in named_paths(text) if not resolves(p)] == [
        "kernels/bench.py", "kernels/results/h200_bench.json", "docs/absent.md"]
    assert [m for m in named_modules(text) if not dotted_resolves(m)] == ["kernels.bench", "kernels.no_such_function"]
    # and names that must: a moved benchmark, a glob, braces, a folder, a package-relative path
    text = ("`python -m benchmarks.kernel_bench`, `kernels.read_kv`, `server.engine.EngineConfig`, "
            "tests/gpu/*.sh, load_tests/results/, `csrc/merge.cuh`, server/{cli,app}.py, 9/3/64, q/k/v, tok/s")
    assert all(resolves(p) for p in named_paths(text)) and len(named_paths(text)) == 4
    assert all(dotted_resolves(m) for m in named_modules(text)) and len(named_modules(text)) == 3
    assert "health-and-shutdown-servershutdownpy-serverclipy" in {
        re.sub(r"[^\w\- ]", "", "Health and shutdown (`server/shutdown.py`, `server/cli.py`)".lower()).replace(" ", "-")}
