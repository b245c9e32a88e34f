"""The docs cite files of the repository (raw results, benchmarks, tests, modules): each must exist, so a reader
who follows a reference finds what it names."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: A path in backticks that starts at one of the repository's top-level directories.
CITED = re.compile(r"`((?:docs|bench|tests|examples|packages|scripts)/[^`\s*<>{}]+)`")


def test_every_file_the_docs_cite_is_in_the_repository():
    """README.md and docs/*.md name only files (and directories) that exist; docs/benchmarks.md once cited a result
    file that was never committed."""
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for match in CITED.finditer(doc.read_text()):
            cited = match.group(1).split("::")[0].rstrip(".,:;")
            if not (REPO / cited).exists():
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert not missing, "\n".join(missing)
