r"""aligner-serve's search page in a real headless browser (issue 25 item 5), with a screenshot.

Starts ``aligner-serve`` (the binary) on a free localhost port, opens ``/?q=QUERY`` in Debian's
``chromium`` driven by selenium (``chromium-driver``), waits until every hit shows its ALIGNER
alignment (fetched from ``/explain``), checks what the page shows, and saves a screenshot:

  apt-get install -y chromium chromium-driver    # once
  .venv/bin/python benchmarks/search_page.py --index_dir=outputs/zero_shot_scifact/index \
    --query="statins reduce cardiovascular risk" --output=benchmarks/results/search_page.png

Checks (exit 1 on failure): the page lists k hits, each with a title, a snippet and alignment
chips (query word → aligned document words); the first hit's unfolded explanation shows the
query and the document with salience-coloured words and the alignment table.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"aligner-serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"aligner-serve did not answer {url}/health within {timeout:.0f} s")


def check_page(driver, k: int) -> dict:
    """What the page shows, checked; returns a summary."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415 - benchmark-only dependency

    hits = driver.find_elements(By.CSS_SELECTOR, "li.hit")
    assert len(hits) == k, f"{len(hits)} hits shown, expected {k}"
    summary = []
    for hit in hits:
        title = hit.find_element(By.CSS_SELECTOR, ".title").text
        snippet = hit.find_element(By.CSS_SELECTOR, ".snippet").text
        chips = [c.text for c in hit.find_elements(By.CSS_SELECTOR, ".aligned .chip")]
        assert title and snippet, f"hit {hit.get_attribute('data-doc-id')}: no title or snippet"
        assert chips and all("→" in c for c in chips), f"hit without alignments: {chips}"
        summary.append({"doc_id": hit.get_attribute("data-doc-id"), "title": title, "chips": chips})
    first = hits[0]
    linked = first.find_elements(By.CSS_SELECTOR, ".explanation .w.linked")
    rows = first.find_elements(By.CSS_SELECTOR, ".explanation table[id$='top-alignments'] tr")
    assert linked, "the first hit's explanation links no words"
    assert len(rows) > 1, "the first hit's alignment table is empty"
    return {"hits": summary, "linked_words": len(linked), "alignment_rows": len(rows) - 1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index_dir", default=str(REPO / "outputs/zero_shot_scifact/index"))
    p.add_argument("--query", default="statins reduce cardiovascular risk")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--output", default=str(REPO / "benchmarks/results/search_page.png"))
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()

    from selenium import webdriver  # noqa: PLC0415 - benchmark-only dependency
    from selenium.common.exceptions import TimeoutException  # noqa: PLC0415
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aligner_jax.serve",
            f"--index_dir={args.index_dir}",
            f"--port={port}",
        ],
        cwd=REPO,
    )
    profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
    driver = None
    try:
        health = wait_for_health(url, server, args.timeout)
        print(f"aligner-serve: {health['num_docs']} documents at {url}")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in BROWSER_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile.name}")
        options.add_argument("--window-size=1280,2000")
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        query = urllib.parse.urlencode({"q": args.query, "k": args.k})
        start = time.perf_counter()
        driver.get(f"{url}/?{query}")
        try:
            WebDriverWait(driver, args.timeout).until(
                lambda d: (
                    d.execute_script("return document.querySelector('#status').dataset").get(
                        "explained"
                    )
                    == "yes"
                )
            )
        except TimeoutException:
            status = driver.execute_script("return document.querySelector('#status').textContent")
            driver.save_screenshot(args.output)
            for entry in driver.get_log("browser"):
                print("browser:", entry)
            raise SystemExit(
                f"the page did not finish: status {status!r}; see {args.output}"
            ) from None
        seconds = time.perf_counter() - start
        summary = check_page(driver, args.k)
        status = driver.execute_script("return document.querySelector('#status').textContent")
        # the whole page: results and the first hit's unfolded explanation
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1280, min(max(height + 40, 800), 6000))
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.output)
        print(
            json.dumps(
                {"query": args.query, "status": status, "page_s": round(seconds, 2), **summary},
                indent=1,
            )
        )
        print(f"screenshot: {args.output}")
        return 0
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
        profile.cleanup()


if __name__ == "__main__":
    sys.exit(main())
