"""Every gallery page has its intro: what it shows, the paper (linked), how to read, what to try."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from apps._intros import INTROS, intro_pane, paper_url

ROOT = Path(__file__).resolve().parents[1]


def test_every_gallery_page_has_an_intro_and_no_other_does():
    from apps.gallery import VIEWS

    assert set(INTROS) == {slug for _, slug, _ in VIEWS}


@pytest.mark.parametrize("slug", sorted(INTROS))
def test_intro_names_the_paper_and_its_doc_exists(slug):
    intro = INTROS[slug]
    for field in ("shows", "paper", "title", "read", "try_first"):
        assert len(getattr(intro, field).split()) >= 3, (slug, field)
    assert (ROOT / intro.doc).is_file(), intro.doc
    query = parse_qs(urlparse(paper_url(intro.title)).query)
    assert query == {"searchtype": ["title"], "query": [intro.title]}
    text = intro_pane(slug).object
    assert f"]({paper_url(intro.title)})" in text and "**Try first:**" in text
    assert "page-intro" in intro_pane(slug).css_classes


def test_every_gallery_page_has_a_reference_screenshot_shown_in_the_readme():
    """scripts/gallery_screenshots.py writes docs/figures/gallery_<slug>.png per page; the
    README's page table shows each one."""
    from PIL import Image

    from apps.gallery import VIEWS

    readme = (ROOT / "README.md").read_text()
    for title, slug, _ in VIEWS:
        name = f"docs/figures/gallery_{slug.replace('-', '_')}.png"
        with Image.open(ROOT / name) as img:
            assert img.size[0] >= 1280 and img.size[1] >= 800, (name, img.size)
        assert f'src="{name}"' in readme and f"| {title} |" in readme, title
