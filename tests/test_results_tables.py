"""Every results table in the READMEs is exactly what its committed evidence file says."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.results_table import refresh

REPO = Path(__file__).resolve().parent.parent
READMES = sorted(str(p.relative_to(REPO)) for p in [REPO / "README.md", *REPO.glob("step*/README.md")])


@pytest.mark.parametrize("readme", READMES)
def test_readme_tables_match_their_evidence(readme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert refresh(readme, write=False) == [], "regenerate with: python scripts/results_table.py --refresh " + readme


def test_the_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table whose figure was edited by hand is reported."""
    monkeypatch.chdir(REPO)
    text = (REPO / "step01_serial/README.md").read_text(encoding="utf-8")
    tampered = tmp_path / "README.md"
    tampered.write_text(text.replace("| step01_serial | 1 |", "| step01_serial | 1 | 9", 1), encoding="utf-8")
    assert refresh(str(tampered), write=False) != []
