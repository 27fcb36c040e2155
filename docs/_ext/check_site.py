"""Check a built site works offline: no page loads a script, style sheet, font or image from the
network, the bundled MathJax is there, and every page with formulas loads it; and that it stays
lean: under ``SITE_LIMIT`` bytes, without Sphinx's doctrees inside.

Run after the build: ``python docs/_ext/check_site.py docs/_build/html`` (CI does). Exits 1 with
one line per problem.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# src="http..." / href="http..." on tags that the browser fetches by itself (links to papers in
# <a href> are fine: a reader follows them on purpose).
FETCHED = re.compile(r"<(script|link|img|iframe|source)\b[^>]*\b(src|href)=[\"'](https?:)?//",
                     re.I)
MATH = re.compile(r'class="math|\\\(|\\\[')
#: The largest site (bytes) a course should have to download or host.
SITE_LIMIT = 40 * 1024 ** 2


def check(site: Path) -> list[str]:
    problems = []
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"{site}: no HTML pages"]
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    if size > SITE_LIMIT:
        problems.append(f"{site}: {size / 1024 ** 2:.1f} MiB, over {SITE_LIMIT / 1024 ** 2:.0f} MiB")
    if (site / ".doctrees").exists():
        problems.append(f"{site}/.doctrees: Sphinx's doctrees in the site (build with -d elsewhere)")
    mathjax = list(site.glob("_static/mathjax/tex-chtml*.js"))
    if not mathjax:
        problems.append(f"{site}/_static/mathjax: the bundled MathJax is missing")
    for page in pages:
        text = page.read_text(errors="replace")
        for match in FETCHED.finditer(text):
            problems.append(f"{page.relative_to(site)}: fetches from the network: {match.group(0)}")
        if MATH.search(text) and "_static/mathjax/" not in text:
            problems.append(f"{page.relative_to(site)}: has formulas but no local MathJax")
    return problems


if __name__ == "__main__":
    problems = check(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html"))
    print("\n".join(problems) or "site: offline-ready (no network fetches, MathJax bundled)")
    sys.exit(1 if problems else 0)
