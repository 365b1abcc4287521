"""Every relative markdown link in README.md, docs/*.md and the lab notebook resolves (issue 59, item 3).

A link ``[text](path)`` or ``![alt](path)`` outside fenced code must name a file or folder that
exists, relative to the page that holds it; a ``#anchor`` (alone, or after a ``.md`` path) must be a
heading of that page, spelled as GitHub spells heading anchors (lower case, punctuation dropped,
spaces to ``-``, ``-1`` / ``-2`` for repeats). External links (``http(s)://``, ``mailto:``) are not
fetched. Pure Python; no GPU, no engine.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/research/NOTEBOOK.md"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(page: Path) -> list[tuple[int, str]]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def broken(page: Path) -> list[str]:
    out = []
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line}: ({target})"
        if not dest.exists():
            out.append(f"{where} names {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}, which does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}")
    return out


def test_slug_spells_anchors_as_github_does():
    assert slug("Dead or stuck peer") == "dead-or-stuck-peer"
    assert slug("Per-rank speed on one GPU: `--emulate`") == "per-rank-speed-on-one-gpu---emulate"
    assert slug("The sm_90a CUDA GEMMs (research code: `benchmarks/research/cuda_gemms/`)") == \
        "the-sm_90a-cuda-gemms-research-code-benchmarksresearchcuda_gemms"


def test_the_finder_sees_links():
    """A finder that sees nothing would pass everything: the README links docs pages."""
    assert any(target.startswith("docs/") for _, target in links(ROOT / "README.md"))


def test_a_broken_link_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [here](#title) [nowhere](#no-such-heading)\n"
                    "```\n[in code](not-checked.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = broken(page)
    finally:
        ROOT = saved
    assert len(found) == 2 and "missing.md" in found[0] and "#no-such-heading" in found[1]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), page
    problems = broken(page)
    assert not problems, "\n".join(problems)
