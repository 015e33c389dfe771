"""The demo's results in README.md and docs/demo.md, generated from what the demo printed so that they cannot go stale.

Part of the workbench, not of the installed package: run from the repository's root
(``python -m tools.readme_table``). ``make demo`` writes ``results/demo/summary.md``
(:func:`wsi_pipeline.export.demo_table.demo_summary`): the headline table (four columns for seed 0
and all tiles), then the subsample protocols. ``make demo-study`` writes
``results/seed-study/demo/seed_study.md``. ``make readme-table`` (``python -m tools.readme_table``)
copies the headline table (:func:`headline`) into README.md and both tables with the seed study's
into docs/demo.md, each between the markers ``<!-- demo-table:start -->`` and
``<!-- demo-table:end -->``; at its end ``make demo`` compares its own tables with those the README
shows (``python -m tools.readme_table --check``) and prints one line saying whether they agree
(:func:`compare_with_readme`). The survival demo's C-index table (``make demo-survival``:
``results/seed-study/demo_survival/c_index.md``) goes into docs/demo.md between
``<!-- survival-table:start -->`` and ``<!-- survival-table:end -->`` when it exists (:func:`update_block`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["START", "END", "SURVIVAL_START", "SURVIVAL_END", "parse_tables", "compare_with_readme",
           "update_block", "update_readme", "main", "STUDY_START", "STUDY_END", "headline"]

START = "<!-- demo-table:start -->"
END = "<!-- demo-table:end -->"
SURVIVAL_START = "<!-- survival-table:start -->"
SURVIVAL_END = "<!-- survival-table:end -->"
#: Inside the demo block, the seed study's table sits between these (kept when a run has no new study).
STUDY_START = "<!-- seed-study:start -->"
STUDY_END = "<!-- seed-study:end -->"

def headline(summary: str) -> str:
    """The first table of a demo summary (seed 0, all tiles): what the README's quickstart shows."""
    return summary.split("\n\n", 1)[0].rstrip("\n") + "\n"


def parse_tables(text: str) -> list[dict[tuple[str, str], str]]:
    """Every markdown table in ``text``, in order, as ``(method, column heading) -> cell``."""
    tables: list[dict[tuple[str, str], str]] = []
    heads: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            heads = []
            continue
        parts = [p.strip() for p in line.strip("|").split("|")]
        if not heads:
            heads = parts
            tables.append({})
        elif not set("".join(parts)) <= set("-: "):
            for h, c in zip(heads[1:], parts[1:]):
                tables[-1][(parts[0].strip("`"), h)] = c
    return tables


def _block(readme: str) -> str | None:
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), readme, re.S)
    return m.group(1) if m else None


def compare_with_readme(summary: str, readme_path: str | Path) -> str:
    """One line: whether the README's demo table agrees with ``summary``, and which values differ."""
    path = Path(readme_path)
    block = _block(path.read_text()) if path.is_file() else None
    if block is None:
        return f"README demo table: none found in {path} (markers {START} ... {END})"
    # the summary's tables come first in the block (the seed study's follow and are not compared); a file may
    # show only the first (the README's headline), and then only that one is compared
    shown = parse_tables(block)
    now = parse_tables(summary)[: max(1, len(shown))]
    readme = shown[: len(now)]
    readme += [{}] * (len(now) - len(readme))
    diff = [f"{m} {h}: README {old.get((m, h), 'missing')}, now {v}"
            for new_t, old in zip(now, readme) for (m, h), v in new_t.items() if old.get((m, h)) != v]
    if not diff:
        return "README demo table: agrees with this run"
    more = f" (and {len(diff) - 6} more)" if len(diff) > 6 else ""
    return f"README demo table differs ({len(diff)} values; `make readme-table` updates it): " + "; ".join(diff[:6]) + more


def _study_part(block: str) -> str | None:
    """The seed-study table of a demo block: between its own markers, or (older READMEs) from its "Seed study" line on."""
    m = re.search(re.escape(STUDY_START) + r"\n(.*?)" + re.escape(STUDY_END), block, re.S)
    if m:
        return m.group(1)
    legacy = re.search(r"^Seed study.*", block, re.S | re.M)
    return legacy.group(0) if legacy else None


def update_readme(readme_path: str | Path, summary: str, study: str | None = None) -> bool:
    """Replace the README's demo block with ``summary`` and the seed study's table after it; True when it changed.

    Without a new ``study`` the block's current seed-study table is kept (a plain ``make demo`` then
    ``make readme-table`` must not delete the study that ``make demo-study`` made).
    """
    from wsi_pipeline.io_atomic import write_text_atomic

    path = Path(readme_path)
    text = path.read_text()
    block = _block(text)
    if block is None:
        raise ValueError(f"{path}: no demo table markers; put {START} and {END} on their own lines where the table goes")
    if study is None:
        study = _study_part(block)
    body = summary + (f"\n{STUDY_START}\n{study.rstrip()}\n{STUDY_END}\n" if study else "")
    new = re.sub(re.escape(START) + r"\n.*?" + re.escape(END), lambda _: f"{START}\n{body}{END}", text, count=1, flags=re.S)
    if new == text:
        return False
    write_text_atomic(path, new)
    return True


def update_block(readme_path: str | Path, body: str, start: str = SURVIVAL_START, end: str = SURVIVAL_END) -> bool:
    """Replace what lies between the ``start`` and ``end`` markers of the README with ``body``; True when it changed."""
    from wsi_pipeline.io_atomic import write_text_atomic

    path = Path(readme_path)
    text = path.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path}: no markers {start} ... {end}; put them on their own lines where the table goes")
    new = re.sub(re.escape(start) + r"\n.*?" + re.escape(end), lambda _: f"{start}\n{body}{end}", text, count=1, flags=re.S)
    if new == text:
        return False
    write_text_atomic(path, new)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """``make readme-table``: copy the demo's headline table into README.md, and all its tables (with the seed study's
    and the survival demo's) into docs/demo.md (``--check``: compare only)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.readme_table", description=main.__doc__)
    p.add_argument("--summary", default="results/demo/summary.md", help="the demo's table (default: %(default)s)")
    p.add_argument("--study", default="results/seed-study/demo/seed_study.md",
                   help="the seed study's table, added after it when present (default: %(default)s)")
    p.add_argument("--survival", default="results/seed-study/demo_survival/c_index.md",
                   help="the survival demo's C-index table, copied when present (default: %(default)s)")
    p.add_argument("--readme", default="README.md", help="the README, whose headline table is updated (default: %(default)s)")
    p.add_argument("--docs", default="docs/demo.md",
                   help="the demo's page, whose tables and survival table are updated (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="change nothing: print one line saying whether the README's demo table agrees with --summary")
    args = p.parse_args(argv)
    if args.check:
        summary = Path(args.summary)
        print(compare_with_readme(summary.read_text(), args.readme) if summary.is_file()
              else f"README demo table: not checked ({summary} not found)")
        return 0
    survival = Path(args.survival)
    if survival.is_file():
        changed = update_block(args.docs, survival.read_text())
        print(f"{args.docs}: survival table {'updated' if changed else 'already current'}")
    summary = Path(args.summary)
    if not summary.is_file():
        print(f"error: {summary} not found; run `make demo` first", file=sys.stderr)
        return 2
    study = Path(args.study)
    text = summary.read_text()
    changed = update_block(args.readme, headline(text), START, END)
    print(f"{args.readme}: demo table {'updated' if changed else 'already current'}")
    changed = update_readme(args.docs, text, study.read_text() if study.is_file() else None)
    print(f"{args.docs}: demo tables {'updated' if changed else 'already current'}"
          f"{'' if study.is_file() else f' (no seed study at {study})'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
