"""The promise table (``conformance/PROMISES.md``, issue #42): every promise the contract
documents make is held by a conformance law that exists, or is untested for a reason that can
only be "it cannot be observed through the protocol" together with how a user notices a
breach. Rows still marked ``MISSING`` or ``weak`` are gaps, counted exactly (``OPEN_GAPS``): the
count only goes down, as each proposed law lands and its row names it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import asyncflow_conformance
import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "conformance" / "PROMISES.md"

SOURCES: tuple[str, ...] = (
    "asyncflow_core/contracts/protocols.py",
    "docs/logprobs.md",
    "docs/writing-an-adapter.md",
    "docs/agents.md",
    "conformance/asyncflow_conformance/agent.py",
)
"""The documents whose promises the table must cover, one section each."""

CLASSES: tuple[str, ...] = (
    "InferenceEngineConformance",
    "TrainEngineConformance",
    "WeightSyncConformance",
    "EnginePairConformance",
    "WorkflowConformance",
    "AgentLoopConformance",
    "ChatFormatConformance",
    "DataStoreConformance",
    "SchedulerConformance",
)
"""The conformance classes a law of the table may belong to."""

LAW = re.compile(
    r"`(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.(?P<method>test_[A-Za-z0-9_]+)(?P<param>\[[^\]`]+\])?`"
)
"""A law's name in a cell: `Class.test_name`, or `Class.test_name[case]` for one case."""
_ONE_LAW = r"`[A-Za-z_][A-Za-z0-9_]*\.test_[A-Za-z0-9_]+(?:\[[^\]`]+\])?`"
LAW_LIST = re.compile(rf"^{_ONE_LAW}(?:, {_ONE_LAW})*$")
"""A covered row's law column: one or more law names, comma-separated, nothing else."""
UNTESTED = "untested because it cannot be observed through the protocol:"
NOTICED = "a user notices it by"
MAX_PROMISE_WORDS = 25
SUMMARY = re.compile(
    r"^Summary: (\d+) promises: (\d+) covered, (\d+) weak, (\d+) missing, (\d+) untested\.$"
)

Kind = Literal["covered", "weak", "missing", "untested", "malformed"]


@dataclass(frozen=True, slots=True)
class Law:
    cls: str
    method: str
    param: str

    @property
    def name(self) -> str:
        return f"{self.cls}.{self.method}{self.param}"


@dataclass(frozen=True, slots=True)
class Row:
    source: str
    line: int
    id: str
    where: str
    promise: str
    law: str

    @property
    def kind(self) -> Kind:
        text = self.law
        if text.startswith("MISSING: proposed "):
            return "missing"
        if text.startswith("weak: ") and "; proposed " in text:
            return "weak"
        if text.startswith("untested because"):
            return "untested"
        return "covered" if LAW_LIST.match(text) else "malformed"

    @property
    def existing(self) -> list[Law]:
        """The laws the row says exist (a weak row's, before "proposed")."""
        if self.kind == "covered":
            return _laws(self.law)
        if self.kind == "weak":
            return _laws(self.law.split("; proposed ", 1)[0])
        return []

    @property
    def proposed(self) -> list[Law]:
        if self.kind in ("missing", "weak"):
            return _laws(self.law.split("proposed ", 1)[1])
        return []

    def describe(self) -> str:
        return f"{self.id} (PROMISES.md:{self.line}, {self.where}): {self.promise}"


def _laws(text: str) -> list[Law]:
    return [Law(m["cls"], m["method"], m["param"] or "") for m in LAW.finditer(text)]


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip().replace("\\|", "|") for p in parts[1:-1]]


@dataclass(frozen=True, slots=True)
class Table:
    rows: tuple[Row, ...]
    sections: tuple[str, ...]
    summary: str | None
    gaps: str


def read_table(path: Path = TABLE) -> Table:
    """The rows of every per-document section, the sections' documents, the summary line and
    the text of the "Gaps" section."""
    rows: list[Row] = []
    sections: list[str] = []
    summary: str | None = None
    gaps: list[str] = []
    source: str | None = None
    in_gaps = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("Summary:"):
            summary = line.strip()
        if line.startswith("## "):
            heading = line[3:].strip()
            in_gaps = heading == "Gaps"
            document = re.fullmatch(r"`([^`]+)`", heading)
            source = document[1] if document else None
            if source is not None:
                sections.append(source)
            continue
        if in_gaps:
            gaps.append(line)
            continue
        if source is None or not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[:1] == ["#"] or all(set(c) <= set("-: ") for c in cells):
            continue  # header or separator
        if len(cells) != 4:
            raise AssertionError(
                f"PROMISES.md:{number}: a row has {len(cells)} cells, not 4 "
                "(| # | where | promise | law |); escape a '|' inside a cell as '\\|'"
            )
        rows.append(Row(source, number, *cells))
    return Table(tuple(rows), tuple(sections), summary, "\n".join(gaps))


def _method(law: Law) -> object:
    cls = getattr(asyncflow_conformance, law.cls, None)
    return None if cls is None else getattr(cls, law.method, None)


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------
def test_the_table_names_every_source_document() -> None:
    table = read_table()
    absent = [s for s in SOURCES if s not in table.sections]
    assert not absent, f"PROMISES.md has no section (## `path`) for {absent}"
    counts = Counter(r.source for r in table.rows)
    empty = [s for s in SOURCES if not counts[s]]
    assert not empty, f"PROMISES.md's sections for {empty} hold no promise"
    for source in SOURCES:
        assert (ROOT / source).is_file(), f"PROMISES.md covers {source}, which does not exist"


def test_every_row_is_well_formed() -> None:
    table = read_table()
    problems: list[str] = []
    ids = Counter(r.id for r in table.rows)
    problems += [f"{i}: the id is used {n} times" for i, n in ids.items() if n > 1]
    for row in table.rows:
        if row.kind == "malformed":
            problems.append(
                f"{row.describe()}: the law column {row.law!r} is neither a comma-separated "
                "list of `Class.test_name`, nor 'weak: ...; proposed `...`', nor 'MISSING: "
                "proposed `...`', nor 'untested because ...'"
            )
        if row.kind == "untested":
            reason = row.law.removeprefix(UNTESTED)
            noticed = reason.split(NOTICED, 1)[1].split() if NOTICED in reason else []
            if not row.law.startswith(UNTESTED) or len(noticed) < 3:
                problems.append(
                    f"{row.describe()}: an untested promise needs the only accepted reason, "
                    f"'{UNTESTED} <why>; {NOTICED} <how>', got {row.law!r}"
                )
        if row.kind in ("missing", "weak") and not row.proposed:
            problems.append(f"{row.describe()}: names no proposed `Class.test_name`")
        words = len(row.promise.split())
        if words > MAX_PROMISE_WORDS:
            problems.append(f"{row.describe()}: the promise has {words} words (at most 25)")
        if not row.where or not row.promise:
            problems.append(f"{row.id}: an empty 'where' or 'promise' cell")
    assert not problems, "malformed rows in PROMISES.md:\n" + "\n".join(problems)


def test_every_named_law_exists() -> None:
    """Each law a row names as existing is a test method of that conformance class."""
    table = read_table()
    unknown: list[str] = []
    for row in table.rows:
        for law in row.existing:
            if law.cls not in CLASSES:
                unknown.append(f"{law.name} ({row.id}): {law.cls} is not a conformance class")
            elif not callable(_method(law)):
                unknown.append(
                    f"{law.name} ({row.id}): {law.cls} has no method {law.method} (a law "
                    "still being written? land it, or correct the name)"
                )
    if unknown:
        listing = "\n".join(unknown)
        pytest.fail(
            f"{len(unknown)} law(s) named in PROMISES.md do not exist:\n{listing}", pytrace=False
        )


def test_every_proposed_law_is_specified_under_gaps() -> None:
    table = read_table()
    unspecified = [
        f"{law.name} ({row.id})"
        for row in table.rows
        for law in row.proposed
        if f"{law.cls}.{law.method}" not in table.gaps or law.param not in table.gaps
    ]
    listing = "\n".join(unspecified)
    assert not unspecified, f"proposed laws without a section under '## Gaps':\n{listing}"


def test_the_summary_counts_the_rows() -> None:
    table = read_table()
    kinds = Counter(r.kind for r in table.rows)
    want = (
        f"Summary: {len(table.rows)} promises: {kinds['covered']} covered, {kinds['weak']} "
        f"weak, {kinds['missing']} missing, {kinds['untested']} untested."
    )
    assert table.summary is not None and SUMMARY.match(table.summary), (
        f"PROMISES.md needs a line {want!r}"
    )
    assert table.summary == want, f"PROMISES.md's summary is stale; make it {want!r}"


OPEN_GAPS = 0
"""Rows still MISSING or weak: none since issue #42. The number only goes down; a new promise
comes with its law (or, for a while, a MISSING row, its proposed law under Gaps and this raised
by one, to be lowered again when the law lands)."""


def test_the_open_gaps_are_counted_and_only_shrink() -> None:
    """The gaps: every row still MISSING (no law) or weak (a law that cannot fail for the
    promise), with the law it proposes. Their number must be exactly ``OPEN_GAPS``: a new
    promise without a law fails, and so does a law that landed while its row still says
    MISSING (lower ``OPEN_GAPS`` and name the law)."""
    table = read_table()
    gaps = [r for r in table.rows if r.kind in ("missing", "weak")]
    lines = []
    landed_rows = []
    for row in gaps:
        names = ", ".join(law.name for law in row.proposed)
        landed = [law.name for law in row.proposed if not law.param and callable(_method(law))]
        note = f" [now exists: {', '.join(landed)}; name it in the row]" if landed else ""
        if landed:
            landed_rows.append(row.describe())
        lines.append(f"{row.kind.upper():7} {row.describe()} -> {names}{note}")
    listing = "\n".join(lines)
    missing = sum(r.kind == "missing" for r in gaps)
    assert not landed_rows, (
        f"these rows propose a law that now exists; name it in the row: {landed_rows}"
    )
    assert len(gaps) <= OPEN_GAPS, (
        f"{len(gaps)} of {len(table.rows)} promises have no law that can fail ({missing} "
        f"missing, {len(gaps) - missing} weak), more than the {OPEN_GAPS} known: a new promise "
        f"needs its law; see '## Gaps' in conformance/PROMISES.md:\n{listing}"
    )
    assert len(gaps) == OPEN_GAPS, (
        f"{len(gaps)} gaps are left, fewer than OPEN_GAPS = {OPEN_GAPS}: lower it to "
        f"{len(gaps)}:\n{listing}"
    )
