"""Every feature id that the code and docs cite is defined in docs/spec.md, and defined there once.

Comments, docstrings, tests and docs name the feature a line serves by its id (`SPEC J12`, `(S6)`,
`J15:`, `M2–M4`). An id cited but defined nowhere leaves its reader nowhere to look, so the code base is
scanned here for every id it cites, and each must have its heading in docs/spec.md.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC_PAGE = ROOT / "docs" / "spec.md"

# Ids are cited anywhere in the repository: code, tests, benchmarks, deployment files, examples, docs,
# the README and the Makefile. Every text file is read, so a folder added or moved is read too, except
# hidden folders (version control, the virtual environment, tool caches, the local stack's state) and
# these, which hold builds and caches of what is read anyway, or nothing of ours.
SKIPPED_FOLDERS = frozenset({"__pycache__", "build", "node_modules", "vendor"})  # vendor: libraries copied as they are

# The letters of the spec's areas: J job, L launching, S scheduling, O operations, M monitoring,
# D data, A autoscaler, R runs, X platform, B beyond the platform documents.
AREAS = "JLSOMDARXB"
_NUMBER = "[1-9][0-9]?"
# An id is an area's letter and a number of one or two digits without a leading zero, as a whole word
# and in capitals. That shape already keeps out what else looks like one in this tree: boards (A100,
# V100, H100: three digits; T4: not an area), lint codes (B017: a leading zero), the C0 and C1
# control characters and percentiles (P95: not areas), versions (`v2`: lower case), and letters
# inside words, hex digests and identifiers (`0xD1`, `VAR_S3`: no word boundary before the letter).
CITED_ID = re.compile(rf"\b[{AREAS}]{_NUMBER}\b")
# `M2–M4` cites M3 too. Both ends name the same area; the dash is an en dash or a hyphen.
CITED_RANGE = re.compile(rf"\b([{AREAS}])({_NUMBER})\s*[–-]\s*\1({_NUMBER})\b")
# A definition is a heading of docs/spec.md: `### J2 — Access for others in the project`.
DEFINITION = re.compile(rf"^#+[ \t]+([{AREAS}]{_NUMBER})[ \t]+—[ \t]+\S", re.MULTILINE)

# Tokens of an id's shape that name something else, each with why it is not an id. None today; add
# one here (rather than loosening the pattern) when, say, the X Window System is mentioned by its
# version, which is an X and a number.
NOT_IDS: dict[str, str] = {}


def cited_ids(text: str) -> set[str]:
    """The feature ids a text cites, ranges spelled out."""
    ids = set(CITED_ID.findall(text))
    for range_match in CITED_RANGE.finditer(text):
        area, first, last = range_match.group(1), int(range_match.group(2)), int(range_match.group(3))
        ids.update(f"{area}{number}" for number in range(first, last + 1))
    return ids - NOT_IDS.keys()


def defined_ids(page: str) -> list[str]:
    """The ids docs/spec.md defines, in page order and with any repeats."""
    return DEFINITION.findall(page)


def _skipped(folder: str) -> bool:
    return folder.startswith(".") or folder in SKIPPED_FOLDERS or folder.endswith(".egg-info")


def citing_files() -> Iterator[Path]:
    """Every file of the repository that may cite an id, in path order."""
    for folder, subfolders, files in os.walk(ROOT):
        # Pruned in place, so that os.walk never descends into the virtual environment or .git.
        subfolders[:] = sorted(name for name in subfolders if not _skipped(name))
        for name in sorted(files):
            path = Path(folder) / name
            if path.is_file():
                yield path


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (images, archives)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def citations() -> dict[str, str]:
    """Each cited id, with the first file and line that cites it (as `path:line`)."""
    first_citation: dict[str, str] = {}
    for path in citing_files():
        text = read_text(path)
        if text is None:
            continue
        for line_number, line in enumerate(text.splitlines(), start=1):
            for feature_id in cited_ids(line):
                first_citation.setdefault(feature_id, f"{path.relative_to(ROOT)}:{line_number}")
    return first_citation


def _in_spec_order(feature_id: str) -> tuple[int, int]:
    return AREAS.index(feature_id[0]), int(feature_id[1:])


def test_every_cited_id_is_defined() -> None:
    cited = citations()
    assert cited, "the scan found no feature ids at all: are the scanned folders still there?"
    defined = set(defined_ids(SPEC_PAGE.read_text(encoding="utf-8")))
    undefined = sorted(cited.keys() - defined, key=_in_spec_order)
    assert not undefined, "cited but not defined in docs/spec.md:\n" + "\n".join(
        f"  {feature_id} (cited in {cited[feature_id]})" for feature_id in undefined
    )


def test_no_id_is_defined_twice() -> None:
    counts = Counter(defined_ids(SPEC_PAGE.read_text(encoding="utf-8")))
    repeated = sorted((feature_id for feature_id, count in counts.items() if count > 1), key=_in_spec_order)
    assert not repeated, f"defined more than once in docs/spec.md: {', '.join(repeated)}"


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("checked against the job's access (J2).", {"J2"}),
        ('"""SPEC X2: message types."""', {"X2"}),
        ("# J15: the debug terminal", {"J15"}),
        ("J12's settings, and S10", {"J12", "S10"}),
        ("Resume (J12, M2–M4, M6).", {"J12", "M2", "M3", "M4", "M6"}),
        ("the rules of L2-L4", {"L2", "L3", "L4"}),
        ("boards: A100, V100, H100, T4", set()),
        ("# noqa: B017", set()),
        ("schema v2, 0xD1, VAR_S3, sha256:9f1c0d4e2a77, port 4222", set()),
        ("the C0 and C1 controls; P95 latency", set()),
    ],
)
def test_what_counts_as_a_citation(text: str, ids: set[str]) -> None:
    assert cited_ids(text) == ids


def test_definitions_are_headings_with_a_title() -> None:
    page = "### J2 — Access for others\n\nJ2 is cited here, not defined.\n## S — Scheduling\n#### S6 — Prediction\n"
    assert defined_ids(page) == ["J2", "S6"]
