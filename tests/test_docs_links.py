"""Every relative link in the repository's Markdown files (images and files) names something git tracks.

CI runs on a clean clone, where tracked = present: a README figure that ``.gitignore`` hides (``*.png``)
or that was never added is a broken link there even though it shows on the author's machine. Links
to ``http(s)://`` / ``mailto:`` and in-page anchors are not checked; code (fenced blocks and inline
spans) is not Markdown, so paths written there are not links.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# [text](target "title"), ![alt](target), <img src="target">, and reference definitions "[id]: target".
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
HTML_SRC = re.compile(r"<(?:img|source|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\S\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:", "#", "data:")


def links(markdown: str) -> list[str]:
    """The link targets of a Markdown text, code removed, in order of appearance per kind."""
    text = INLINE_CODE.sub("", FENCE.sub("", markdown))
    return [m.group(1) for pattern in (INLINE, HTML_SRC, REFERENCE) for m in pattern.finditer(text)]


def broken_links(markdown_files: dict[str, str], tracked: set[str]) -> list[tuple[str, str]]:
    """(file, target) for each relative link in ``markdown_files`` ({repo path: text}) whose target (resolved
    against the file's folder, anchor and query dropped) is neither a tracked file nor a folder holding one."""
    folders = set()
    for path in tracked:
        parts = path.split("/")[:-1]
        folders.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    out = []
    for name, text in markdown_files.items():
        for target in links(text):
            if target.startswith(EXTERNAL):
                continue
            path = target.split("#")[0].split("?")[0]
            # "/x" is relative to the repository's root (as GitHub renders it), anything else to the file's folder.
            resolved = posixpath.normpath(path[1:] if path.startswith("/") else posixpath.join(posixpath.dirname(name), path))
            if resolved not in tracked and resolved not in folders:
                out.append((name, target))
    return out


def test_the_checker_finds_untracked_targets_and_ignores_code_urls_and_anchors():
    tracked = {"README.md", "docs/guide.md", "docs/img/a.png", "bench/run.py"}
    files = {
        "README.md": "![ok](docs/img/a.png) ![gone](docs/img/b.png) [dir](bench/) [site](https://x.org/y.png)\n"
                     "[anchor](#setup) [doc](docs/guide.md#part) `![code](nope.png)`\n"
                     "```bash\ncat ![fenced](nope2.png)\n```\n"
                     "<img src=\"docs/img/c.png\" width=40>\n[ref]: bench/missing.py\n",
        "docs/guide.md": "![up](../docs/img/a.png) ![here](img/a.png) ![rel-miss](a.png)",
    }
    assert broken_links(files, tracked) == [("README.md", "docs/img/b.png"), ("README.md", "docs/img/c.png"),
                                            ("README.md", "bench/missing.py"), ("docs/guide.md", "a.png")]


def test_every_markdown_link_names_a_tracked_file():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what git tracks is unknown")
    tracked = set(subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split("\0")) - {""}
    markdown = {p: (ROOT / p).read_text(encoding="utf-8") for p in tracked if p.endswith(".md") and (ROOT / p).is_file()}
    assert "README.md" in markdown
    assert broken_links(markdown, tracked) == []
