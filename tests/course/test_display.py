"""Issue 30: the tutorials' HTML tables keep their columns apart on the site and in a notebook:
every cell carries its own padding (a theme may pad nothing), numbers are not wrapped, and the
site's stylesheet spaces the table class too."""

from __future__ import annotations

import html.parser
from pathlib import Path

from tokenmdp.course.display import CELL_PADDING, table


class _Cells(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self.classes = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("td", "th"):
            self.cells.append(attrs.get("style", ""))
        if tag == "table":
            self.classes.append(attrs.get("class", ""))


def test_every_html_cell_is_padded_and_unwrapped():
    rendered = table([[-0.489, -0.306, -0.179], ["PPO ε=0.2", 1.3312, 2]], ["a", "b", "c"],
                     title="t")
    parser = _Cells()
    parser.feed(rendered.html)
    assert len(parser.cells) == 9 and parser.classes == ["tokenmdp-table"]
    for style in parser.cells:
        assert f"padding:{CELL_PADDING}" in style and "white-space:nowrap" in style
    assert "-0.489</td><td" in rendered.html                       # one number per cell
    assert str(rendered).splitlines()[1].split() == ["a", "b", "c"]


def test_the_site_stylesheet_spaces_the_tables():
    css = (Path(__file__).parents[2] / "docs" / "_static" / "tokenmdp.css").read_text("utf-8")
    assert "table.tokenmdp-table th, table.tokenmdp-table td { padding:" in css
