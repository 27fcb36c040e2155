"""Check the built site in a real browser: formulas render, tables are spaced, figures load, and
nothing is fetched from the network.

``check_site.py`` reads the HTML; this opens a few representative pages in headless Chromium
(Debian's ``chromium``) and reads them after their scripts ran:

- every formula became MathJax output (``mjx-container``), none is a TeX error, and no raw TeX
  (``$...$``, ``\\(``, ``\\[``, ``\\frac``...) is left in the visible text outside code;
- every cell of a content table (``table.tokenmdp-table``, the docutils and notebook-output
  tables) has horizontal padding;
- every ``<img>`` loaded (``naturalWidth > 0``), and no local file the page asked for failed;
- the page asked for nothing but 127.0.0.1.

The site is served on 127.0.0.1 (an ``http.server`` thread); the browser cannot reach anything
else: host names do not resolve (``--host-resolver-rules``) and every non-loopback request goes to
a local dead-end proxy, which records it and answers 403. Requests are recorded twice: the
DevTools protocol's ``Network.requestWillBeSent`` events of each page, and that proxy (which also
sees requests the page's workers or the browser itself would make). Styles, images and MathJax
are measured by a script evaluated in the page (DevTools ``Runtime.evaluate``) once MathJax's
typesetting, the fonts and the images are done. The DevTools protocol runs over
``--remote-debugging-pipe``: the standard library only (the browser and the proxy:
``headless.py`` beside this file).

Run after the build: ``python docs/_ext/browser_check.py docs/_build/html`` (the test suite does,
``tests/test_docs_browser.py``). Exits 1 with one line per problem.
"""

from __future__ import annotations

import functools
import http.server
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from headless import (  # noqa: F401  (find_chromium: part of this module's interface)
    BROWSER_SERVICES,
    Browser,
    BrowserError,
    DeadEndProxy,
    QuietHandler,
    find_chromium,
    proxy_host,
    serve,
)

#: The pages checked: (path in the site, whether it must show formulas). One of each kind: the
#: front page, getting started, a concept page, two executed tutorials (tables, figures, math),
#: an estimator card, an API page.
PAGES = [
    ("index.html", False),
    ("getting_started.html", False),
    ("concepts/aggregation.html", True),
    ("tutorials/02_baselines_and_groups.html", True),
    ("tutorials/06_trust_regions_and_clipping.html", True),
    ("estimators/grpo.html", False),  # a card: its tables (and formulas, where it has some)
    ("api/tokenmdp_exact.html", False),  # a module's page: its autosummary table
]
#: Seconds a page may take to load and render.
PAGE_TIMEOUT = 60.0
#: The least horizontal space (CSS px) around a cell's text: its left and right padding, plus the
#: table's border-spacing. An unstyled table has 1 + 1 + 2 = 4 px, its columns' texts run together.
MIN_CELL_SPACE = 6.0
# Runs in the page once it loaded: waits for MathJax, the images and the fonts, then measures.
PROBE = r"""
(async () => {
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const imgs = [...document.images];
  imgs.forEach(i => { if (i.loading === 'lazy') i.loading = 'eager'; });
  let mathjax = 'none';
  if (document.querySelector('script[src*="mathjax" i]')) {
    const started = () => window.MathJax && MathJax.startup && MathJax.startup.promise;
    for (let t = 0; t < 400 && !started(); t++) await sleep(50);
    if (!started()) mathjax = 'MathJax did not start';
    else {
      try { await MathJax.startup.promise; mathjax = 'done'; }
      catch (e) { mathjax = 'MathJax failed: ' + e; }
    }
  }
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => {
    i.addEventListener('load', r, {once: true});
    i.addEventListener('error', r, {once: true});
    setTimeout(r, 15000);
  })));
  await document.fonts.ready;
  const visible = el => !el.checkVisibility || el.checkVisibility();
  const short = s => s.replace(/\s+/g, ' ').trim().slice(0, 60);

  // Formulas: Sphinx's math markup (span.math, div.math) each holding MathJax's output.
  const math = [...document.querySelectorAll('.math')];
  const unrendered = math.filter(m => !m.querySelector('mjx-container'))
                         .map(m => short(m.textContent));
  const errors = [...document.querySelectorAll('mjx-merror')]
                   .map(e => short(e.getAttribute('data-mjx-error') || e.textContent));

  // Raw TeX in the visible text, outside code: the text of each block, without its code.
  const SKIP = 'pre, code, kbd, samp, script, style, textarea, noscript, template, ' +
               'mjx-container, .highlight, .MathJax';
  // $$, $...$, \( \) \[ \], and a TeX command left in the text
  const COMMANDS = 'frac|tfrac|dfrac|hat|mathbb|mathcal|mathrm|operatorname|sum|prod|nabla|' +
                   'theta|pi|log|begin|end|left|right|cdot';
  const RAW = new RegExp('\\$\\$|\\$[^\\s$][^$]*\\$|\\\\[()[\\]]|\\\\(' + COMMANDS + ')(?![a-zA-Z])');
  const blocks = new Map();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode());) {
    const el = node.parentElement;
    if (!el || el.closest(SKIP) || !visible(el)) continue;
    const block = el.closest('p, li, dt, dd, th, td, h1, h2, h3, h4, h5, h6, caption, ' +
                             'figcaption, blockquote, div, section, body');
    blocks.set(block, (blocks.get(block) || '') + node.data);
  }
  const raw = [];
  for (const text of blocks.values()) {
    const m = RAW.exec(text);
    if (m) raw.push(short(text.slice(Math.max(0, m.index - 20), m.index + 40)));
  }

  // Tables: every cell of a content table has horizontal padding (or the table separates its
  // cells with border-spacing).
  const TABLES = 'table.tokenmdp-table, table.docutils, table.table, table.dataframe, ' +
                 '.cell_output table, .output table';
  const tables = [];
  const MIN = %MIN%;
  for (const t of document.querySelectorAll(TABLES)) {
    if (t.closest('.highlight, .highlighttable') || !visible(t)) continue;
    const ts = getComputedStyle(t);
    const spacing = ts.borderCollapse === 'separate' ? parseFloat(ts.borderSpacing) || 0 : 0;
    const cells = [...t.querySelectorAll('th, td')].filter(c => c.closest('table') === t);
    const tight = cells.filter(c => {
      const s = getComputedStyle(c);
      return (parseFloat(s.paddingLeft) || 0) + (parseFloat(s.paddingRight) || 0) + spacing < MIN;
    });
    tables.push({kind: t.className || 'table', cells: cells.length, tight: tight.length,
                 first: short(cells.length ? cells[0].textContent : '')});
  }

  const images = imgs.map(i => ({src: i.getAttribute('src') || '', ok: i.complete && i.naturalWidth > 0}));
  return {mathjax, math: math.length, mjx: document.querySelectorAll('mjx-container').length,
          unrendered, errors, raw, tables, images};
})()
""".replace("%MIN%", repr(MIN_CELL_SPACE))


def _is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "ws", "wss", "ftp"):
        return True  # data:, blob:, about:, chrome-error:... never leave the browser
    return parts.hostname == "127.0.0.1"


def _is_favicon(url: str) -> bool:
    """The icon the browser asks for by itself when a page names none."""
    return urlsplit(url).path == "/favicon.ico"


def _problems_of(page: str, found: dict, wants_math: bool) -> list[str]:
    problems = []
    if found["mathjax"] not in ("done", "none"):
        problems.append(f"{page}: {found['mathjax']}")
    if (wants_math or found["math"]) and not found["mjx"]:
        problems.append(f"{page}: formulas but no MathJax output (no mjx-container)")
    problems += [f"{page}: formula not rendered: {text}" for text in found["unrendered"][:5]]
    problems += [f"{page}: formula with a TeX error: {text}" for text in found["errors"][:5]]
    problems += [f"{page}: raw TeX in the text: {text}" for text in found["raw"][:5]]
    for number, table in enumerate(found["tables"], 1):
        if table["tight"]:
            problems.append(f"{page}: table {number} ({table['kind']}, first cell "
                            f"'{table['first']}'): {table['tight']} of {table['cells']} cells "
                            f"with under {MIN_CELL_SPACE:g} px of horizontal padding")
    problems += [f"{page}: image not loaded: {image['src']}" for image in found["images"]
                 if not image["ok"]]
    return problems


def _check_page(browser: Browser, session: str, base: str, page: str,
                wants_math: bool) -> list[str]:
    browser.events.clear()
    browser.call("Page.navigate", {"url": f"{base}/{page}"}, session)
    if browser.wait_event("Page.loadEventFired", session, PAGE_TIMEOUT) is None:
        return [f"{page}: did not load in {PAGE_TIMEOUT:.0f} s"]
    result = browser.call("Runtime.evaluate", {"expression": PROBE, "awaitPromise": True,
                                               "returnByValue": True}, session,
                          timeout=PAGE_TIMEOUT)
    if "exceptionDetails" in result:
        details = result["exceptionDetails"]
        return [f"{page}: the probe failed: {details.get('exception', {}).get('description')}"]
    problems = _problems_of(page, result["result"]["value"], wants_math)
    browser.settle()  # requests still on their way (a worker's, a late script's)
    requested, failed = {}, []
    for event in browser.events:
        params = event.get("params", {})
        if event.get("method") == "Network.requestWillBeSent":
            requested[params["requestId"]] = params["request"]["url"]
        elif event.get("method") == "Network.responseReceived":
            url, status = params["response"]["url"], params["response"].get("status", 200)
            if status >= 400 and _is_loopback(url) and not _is_favicon(url):
                failed.append(f"{url} ({status})")
        elif event.get("method") == "Network.loadingFailed" and not params.get("canceled"):
            url = requested.get(params["requestId"], "?")
            if _is_loopback(url) and not _is_favicon(url):
                failed.append(f"{url} ({params.get('errorText')})")
        elif event.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            problems.append(f"{page}: script error: {str(text).splitlines()[0][:120]}")
    for url in dict.fromkeys(requested.values()):
        if not _is_loopback(url):
            problems.append(f"{page}: fetches from the network: {url[:120]}")
    problems += [f"{page}: a local file failed to load: {what[len(base) + 1:] or what}"
                 for what in dict.fromkeys(failed)]
    return problems


def check(site: Path, pages: list[tuple[str, bool]] | None = None,
          binary: str | None = None) -> list[str]:
    """Problems found by opening ``pages`` ((path, must show formulas) pairs; ``PAGES`` by
    default) of the built site ``site`` in headless Chromium; an empty list if none."""
    site = Path(site).resolve()
    pages = PAGES if pages is None else pages
    binary = binary or find_chromium()
    if binary is None:
        return ["chromium not found (apt-get install chromium)"]
    problems = [f"{page}: missing from the site" for page, _ in pages if not (site / page).is_file()]
    pages = [(page, math) for page, math in pages if (site / page).is_file()]
    if not pages:
        return problems
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    proxy = DeadEndProxy()
    serve(server)
    serve(proxy)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="browser_check_") as profile:
        browser = Browser(binary, proxy.server_address[1], Path(profile))
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.call("Target.attachToTarget",
                                   {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Network", "Runtime"):
                browser.call(f"{domain}.enable", session=session)
            # the page's workers and frames get sessions of their own (their requests recorded)
            browser.call("Target.setAutoAttach", {"autoAttach": True, "flatten": True,
                                                  "waitForDebuggerOnStart": True}, session)
            seen = 0
            for page, wants_math in pages:
                found = _check_page(browser, session, base, page, wants_math)
                reported = " ".join(found)
                for line in proxy.seen[seen:]:
                    host = proxy_host(line)
                    if host in reported or host.endswith(BROWSER_SERVICES):
                        continue  # reported from the page's own requests, or the browser's
                    found.append(f"{page}: the browser tried the network: {line[:120]}")
                seen = len(proxy.seen)
                problems += found
        except BrowserError as error:
            problems.append(f"chromium: {error}")
        finally:
            browser.close()
            server.shutdown()
            proxy.shutdown()
            server.server_close()
            proxy.server_close()
    return problems


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
    extra = [(page, False) for page in sys.argv[2:]]
    start = time.monotonic()
    problems = check(site, extra or None)
    checked = len(extra or PAGES)
    print("\n".join(problems) or
          f"site: {checked} pages checked in Chromium in {time.monotonic() - start:.0f} s "
          "(formulas rendered, tables spaced, images loaded, nothing fetched from the network)")
    sys.exit(1 if problems else 0)
