"""The README stays short and every link in it leads somewhere; the site itself is checked by
``make docs`` (MkDocs in strict mode: broken links, anchors and API references fail)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    # The anchors GitHub and the site (pymdownx's slugify, lower case) give a heading.
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [u for u in LINK.findall(text) if not re.match(r"[a-z]+://", u)]
    assert links, "the README links into the documentation"
    for url in links:
        path, _, anchor = url.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.is_file(), f"README.md links to {url}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {url}: no such heading"


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    missing = [p for p in pages if p not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_the_checkpoint_size_the_docs_give_is_that_of_a_run(tmp_path: Path) -> None:
    """docs/fault-tolerance.md's checkpoint sizes (the default model, DiLoCo and CO2 per
    worker) are those a run writes."""
    import os

    from lowcomm.testing.jobs import run_train_job

    text = (ROOT / "docs" / "fault-tolerance.md").read_text()
    found = re.search(r"a checkpoint is ([\d.]+) MB per worker.*?make its ([\d.]+) MB", text, re.S)
    assert found, "the checkpoint size is not where the test looks for it"
    documented = {"diloco": float(found.group(1)), "co2": float(found.group(2))}
    for algo, mb in documented.items():
        out = tmp_path / algo
        argv = ["--algo", algo, "--workers", "2", "--steps", "4", "--sync-every", "4"]
        argv += [
            "--eval-every",
            "4",
            "--eval-batches",
            "1",
            "--checkpoint-every",
            "4",
            "--sync-warmup",
            "0",
        ]
        run_train_job(out, *argv, "--tune-link", "off", "--quiet")
        folder = out / "checkpoints" / "step-000004"
        sizes = [os.path.getsize(folder / f"rank-{r}.pt") / 1e6 for r in (0, 1)]
        assert all(abs(size - mb) < 0.05 for size in sizes), (algo, sizes, mb)
