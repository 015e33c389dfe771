"""The README's demo table is generated from the demo's metrics and checked against them."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_pipeline.export.metrics_json import MetricRecord
from tools.readme_table import END, START, compare_with_readme, parse_tables, update_readme
from wsi_pipeline.export.demo_table import demo_summary

REPO = Path(__file__).resolve().parents[2]


def _records() -> list[MetricRecord]:
    out = []
    for m, (a, loc, ea, acc) in {"frozen": (0.8, 0.734, 0.48, 0.5), "e2e": (0.955, 0.99, 0.875, 0.8125)}.items():
        for split, cohort, metric, v in (("test", "internal", "auc", a), ("test", "internal", "localisation_auc", loc),
                                         ("external", "ext", "auc", ea), ("external", "ext", "accuracy", acc)):
            out.append(MetricRecord(m, 0, cohort, split, "all", metric, v))
            out.append(MetricRecord(m, "mean", cohort, split, "all", metric, v))
        out.append(MetricRecord(m, 0, "internal", "test", "sub64x10", "auc", a - 0.1))
        out.append(MetricRecord(m, 0, "internal", "test", "sub64x10", "auc_repeat_std", 0.123))
        out.append(MetricRecord(m, 0, "internal", "test", "sub64x10", "auc", 0.1, repeat=0))  # a repeat's value: ignored
        out.append(MetricRecord(m, 0, "ext", "external", "ens64x10", "auc", ea + 0.05))
        out.append(MetricRecord(m, 1, "internal", "test", "all", "auc", 0.0))  # another seed: ignored
    return out


def test_summary_holds_the_seed_0_values_rounded_to_2_decimals():
    tables = parse_tables(demo_summary(_records(), ["frozen", "e2e"]))
    assert len(tables) == 2
    cells = {**tables[0], **tables[1]}
    assert cells[("frozen", "internal AUC")] == "0.80" and cells[("frozen", "internal localisation")] == "0.73"
    assert cells[("e2e", "external accuracy")] == "0.81" and cells[("e2e", "internal AUC")] == "0.95"
    assert cells[("e2e", "internal AUC sub64x10")] == "0.85 (sd 0.12)"
    assert cells[("frozen", "external AUC ens64x10")] == "0.53"
    assert cells[("frozen", "external AUC sub64x10")] == "-"


def test_readme_is_updated_between_its_markers_and_compared(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{START}\nold\n{END}\n\nafter\n")
    summary = demo_summary(_records(), ["frozen", "e2e"])
    assert "differs" in compare_with_readme(summary, readme)
    study = "| method | internal AUC |\n|---|---|\n| `frozen` | 0.77 +- 0.05 (min 0.72) |\n"  # same heading, not compared
    assert update_readme(readme, summary, study) is True
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    assert compare_with_readme(summary, readme) == "README demo table: agrees with this run"
    assert update_readme(readme, summary, study) is False
    changed = summary.replace("| 0.80 |", "| 0.79 |", 1)
    line = compare_with_readme(changed, readme)
    assert line.startswith("README demo table differs (1 values") and "frozen internal AUC: README 0.80, now 0.79" in line
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="no demo table markers"):
        update_readme(tmp_path / "plain.md", summary)


def test_the_repository_readme_has_the_generated_block():
    """The README shows one table, the headline; docs/demo.md shows them all: the README's equals the page's first."""
    blocks = []
    for page in (REPO / "README.md", REPO / "docs" / "demo.md"):
        text = page.read_text()
        assert text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END), page
        blocks.append(parse_tables(text[text.index(START):text.index(END)]))
    readme, docs = blocks
    assert len(readme) == 1 and len(docs) >= 2
    assert readme[0] == docs[0] and readme[0]


def test_make_readme_table_writes_the_headline_to_the_readme_and_all_tables_to_the_docs(tmp_path):
    from tools.readme_table import headline, main

    summary = demo_summary(_records(), ["frozen", "e2e"])
    (tmp_path / "summary.md").write_text(summary)
    (tmp_path / "study.md").write_text("| method | internal AUC |\n|---|---|\n| `frozen` | 0.77 +- 0.05 (min 0.72) |\n")
    readme, docs = tmp_path / "README.md", tmp_path / "demo.md"
    readme.write_text(f"# x\n{START}\nold\n{END}\n")
    docs.write_text(f"# demo\n{START}\nold\n{END}\n")
    assert main(["--summary", str(tmp_path / "summary.md"), "--study", str(tmp_path / "study.md"), "--survival",
                 str(tmp_path / "none.md"), "--readme", str(readme), "--docs", str(docs)]) == 0
    assert readme.read_text() == f"# x\n{START}\n{headline(summary)}{END}\n"
    assert len(parse_tables(readme.read_text())) == 1 and len(parse_tables(docs.read_text())) == 3
    # both agree with the run; a README showing only the headline is compared on the headline alone
    assert compare_with_readme(summary, readme) == compare_with_readme(summary, docs) == "README demo table: agrees with this run"
    changed = summary.replace("| 0.85 (sd 0.12) |", "| 0.50 (sd 0.12) |")
    assert changed != summary and "agrees" in compare_with_readme(changed, readme) and "differs" in compare_with_readme(changed, docs)


def test_survival_table_goes_between_its_markers(tmp_path):
    from tools.readme_table import SURVIVAL_END, SURVIVAL_START, update_block

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{SURVIVAL_START}\nold\n{SURVIVAL_END}\nrest\n")
    assert update_block(readme, "| seed | c |\n") and not update_block(readme, "| seed | c |\n")
    assert readme.read_text() == f"intro\n{SURVIVAL_START}\n| seed | c |\n{SURVIVAL_END}\nrest\n"


def test_a_demo_without_a_new_seed_study_keeps_the_readmes_study_table(tmp_path):
    """`make demo` then `make readme-table` (no seed study on disk) must not delete the study table."""
    study = "Seed study: seeds 0, 1.\n\n| method | internal AUC |\n|---|---|\n| `frozen` | 0.77 +- 0.05 (min 0.72) |\n"
    summary = demo_summary(_records(), ["frozen", "e2e"])
    # the README as the previous release wrote it: the study after the summary, no inner markers
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{START}\n| method | internal AUC |\n|---|---|\n| `frozen` | 0.10 |\n\n{study}{END}\n")
    assert update_readme(readme, summary) is True
    text = readme.read_text()
    assert "0.77 +- 0.05 (min 0.72)" in text and "| 0.10 |" not in text
    # and again, now with the inner markers: still kept, and a new study replaces it
    assert update_readme(readme, summary) is False
    assert text.count("Seed study") == 1
    update_readme(readme, summary, study.replace("0.77", "0.66"))
    assert "0.66 +- 0.05" in readme.read_text() and "0.77" not in readme.read_text()


def test_check_compares_without_writing_and_runs_from_the_repository_root(tmp_path):
    """`make demo` ends with `python -m tools.readme_table --check`: one line, the README untouched."""
    import subprocess
    import sys

    from tools.readme_table import main

    summary = tmp_path / "summary.md"
    summary.write_text(demo_summary(_records(), ["frozen", "e2e"]))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{START}\nold\n{END}\n")
    before = readme.read_bytes()
    assert main(["--check", "--summary", str(summary), "--readme", str(readme)]) == 0
    assert readme.read_bytes() == before
    out = subprocess.run([sys.executable, "-m", "tools.readme_table", "--check", "--summary", str(summary), "--readme",
                          str(readme)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("README demo table differs"), out.stderr
    assert main(["--check", "--summary", str(tmp_path / "none.md"), "--readme", str(readme)]) == 0
