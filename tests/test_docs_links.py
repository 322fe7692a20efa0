"""The docs say what is true: every relative link and every repository path they name resolves,
no doc points outside the repository (a user has no `shared/` design notes), docs/data.md lists
exactly the checkpoint metadata a run writes, and the README states the Python the package
requires."""

from __future__ import annotations

import glob
import os
import re

import pytest

from streamsched.interp.checkpoint import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TOP = ("src/", "docs/", "examples/", "tests/", "benchmarks/", ".ci/")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def references(rel: str) -> list[str]:
    """What a doc points at: markdown links and images `[..](target)` that are relative, every
    `*.md` document named, and every inline-code path under a top-level folder of the repository
    (`examples/mlp_digits.sched`, `src/streamsched/interp/data.py`), outside code blocks for the
    `*.md` names (a command's `--md table.md` is an output), each as a path from the doc's
    folder or from the repository root."""
    text = _read(rel)
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1).split("#")[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):
            out.append(target)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # a command's output file is no reference
    out += re.findall(r"(?<![\w/.-])([\w./-]*[A-Za-z]\w*\.md)\b", prose)
    for code in re.findall(r"`([^`\s]+)`", text):
        if code.startswith(TOP) and re.fullmatch(r"[\w./-]+", code):
            out.append(code)
    return out


def _resolves(rel: str, target: str) -> bool:
    here = os.path.dirname(os.path.join(ROOT, rel))
    return any(os.path.exists(os.path.join(base, target)) for base in (here, ROOT, os.path.join(ROOT, "docs")))


@pytest.mark.parametrize("rel", DOCS)
def test_every_reference_resolves(rel):
    missing = [t for t in references(rel) if not _resolves(rel, t)]
    assert not missing, f"{rel} points at files the repository does not have: {missing}"


def test_the_checker_catches_a_missing_file(tmp_path, monkeypatch):
    doc = "see [the guide](guide.md), `examples/nowhere.sched` and ARCHITECTURE.md"
    assert references_of_text(doc) == ["guide.md", "guide.md", "ARCHITECTURE.md", "examples/nowhere.sched"]
    assert not _resolves("README.md", "examples/nowhere.sched") and _resolves("README.md", "examples/mlp_digits.sched")


def references_of_text(text: str) -> list[str]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".md", dir=ROOT, delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        return references(os.path.relpath(f.name, ROOT))
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("rel", DOCS)
def test_no_doc_points_outside_the_repository(rel):
    assert "../shared" not in _read(rel) and "shared/design" not in _read(rel)


def test_data_md_lists_the_checkpoint_metadata_a_run_writes(tmp_path, capsys):
    from test_robustness import project, run_tiny

    sched = project(tmp_path)
    ck = tmp_path / "ck.npz"
    assert run_tiny(capsys, sched, "--epochs", "1", "--save", ck)[0] == 0
    _, meta = load_checkpoint(ck)
    text = _read("docs/data.md")
    section = text.split("## Checkpoints", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(documented) == sorted(meta), (sorted(documented), sorted(meta))
    lr_fields = set(re.findall(r"`(\w+)`", section.split("| `lr` |", 1)[1].split("\n", 1)[0]))
    assert set(meta["lr"]) <= lr_fields


def test_readme_states_the_python_the_package_requires():
    req = re.search(r'requires-python = ">=(\d+\.\d+)"', _read("pyproject.toml")).group(1)
    assert f"Python {req} or newer" in _read("README.md")
