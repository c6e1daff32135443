"""Every link into the documentation resolves: relative markdown links and ``docs/<file>.md#anchor`` citations.

Code comments and docs cite documentation by path and GitHub heading anchor (``docs/design.md#tuf-roles``).
A renamed heading or a moved page silently breaks such a citation; this test finds it.  Anchors are computed
as GitHub renders them: lower case, punctuation dropped, spaces to hyphens, repeats numbered.
"""

from __future__ import annotations

import re
from pathlib import Path

SELF = Path(__file__).resolve()
ROOT = SELF.parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
CITING_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".txt"}
CITING_NAMES = {"Makefile"}

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)\s*=\s*["']([^"']+)["']""")
INLINE_LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A citation by path from the repository root: docs/<name>.md, optionally with #anchor.
CITATION = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)(#[\w-]+)?")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, punctuation dropped, lower case, spaces to hyphens."""
    text = INLINE_LINK.sub(r"\1", heading).lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def _lines_outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines, fenced = [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((lineno, line))
    return lines


def anchors(markdown: str) -> set[str]:
    """Every anchor a markdown page defines: its headings (repeats get -1, -2, ...) and HTML name/id anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _lines_outside_fences(markdown):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def _walk(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if any(p.is_symlink() for p in (root / Path(*rel.parts[: i + 1]) for i in range(len(rel.parts)))):
            continue  # patchswarm/ links to the package folders: scanned once, under their real names
        if path == SELF:
            continue  # its planted examples are broken on purpose
        if path.is_file() and (path.suffix in CITING_SUFFIXES or path.name in CITING_NAMES):
            out.append(path)
    return out


class _Anchors:
    def __init__(self) -> None:
        self._cache: dict[Path, set[str]] = {}

    def of(self, page: Path) -> set[str]:
        if page not in self._cache:
            self._cache[page] = anchors(page.read_text(encoding="utf-8"))
        return self._cache[page]


def _check(target: Path, anchor: str, where: str, cache: _Anchors, broken: list[str]) -> None:
    if not target.exists():
        broken.append(f"{where}: {target.name} does not exist")
    elif anchor and target.suffix == ".md" and anchor not in cache.of(target):
        broken.append(f"{where}: {target.name} has no heading for #{anchor}")


def broken_links(root: Path) -> list[str]:
    """Each broken link under ``root`` as "file:line: why"; an empty list when every link resolves."""
    cache = _Anchors()
    broken: list[str] = []
    for path in _walk(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root)
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{lineno}"
            for m in CITATION.finditer(line):
                _check(root / m.group(1), (m.group(2) or "#")[1:], where, cache, broken)
        if path.suffix != ".md":
            continue
        for lineno, line in _lines_outside_fences(text):
            for target in MD_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                page = (path.parent / file_part).resolve() if file_part else path
                _check(page, anchor, f"{rel}:{lineno} (link {target})", cache, broken)
    return broken


def test_every_documentation_link_in_the_repository_resolves() -> None:
    assert broken_links(ROOT) == []


def test_anchors_follow_githubs_rules() -> None:
    assert github_anchor("Trust after TUF") == "trust-after-tuf"
    assert github_anchor("7. Engine payloads (`daemon/payloads.py`)") == "7-engine-payloads-daemonpayloadspy"
    assert github_anchor("a) Patch size on a [real](x.md) trajectory") == "a-patch-size-on-a-real-trajectory"
    assert anchors('# Title\n## Same\n## Same\n```\n# not a heading\n```\n<a name="here"></a>\n') == {
        "title",
        "same",
        "same-1",
        "here",
    }


def test_a_planted_broken_link_is_found(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "design.md").write_text("# Design\n\n## TUF roles\n\nSee [the other page](other.md#missing).\n")
    (docs / "other.md").write_text("# Other\n\n[back](design.md#tuf-roles), [away](https://example.com/x.md#y)\n")
    (tmp_path / "mod.py").write_text(
        '"""Cites docs/design.md#tuf-roles (fine), docs/design.md#tuf-rollback and docs/gone.md."""\n'
    )
    found = broken_links(tmp_path)
    assert found == [
        "docs/design.md:5 (link other.md#missing): other.md has no heading for #missing",
        "mod.py:1: design.md has no heading for #tuf-rollback",
        "mod.py:1: gone.md does not exist",
    ]
