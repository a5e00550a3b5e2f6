"""The README and every docs/ page: each relative link reaches a file that exists (and a
heading, where it names one, as GitHub slugs headings), and the README links every docs/ page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target): markdown's inline links, no titles used here
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's headings' slugs (a repeated one numbered, as GitHub does) and its `<a id=...>`s."""
    text = FENCE.sub("", page.read_text())
    heads = re.findall(r"^#{1,6} (.+)$", text, re.M)
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for h in heads:
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_slugs_are_githubs():
    assert slug("Quality: KL divergence from the exact model") == "quality-kl-divergence-from-the-exact-model"
    assert slug("Performance against llama.cpp") == "performance-against-llamacpp"
    assert slug("`--kv-disk-dir`: a disk tier") == "--kv-disk-dir-a-disk-tier"


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page():
    readme = ROOT / "README.md"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme.read_text())}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
