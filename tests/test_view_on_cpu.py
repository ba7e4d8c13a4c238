"""`verl-tokensel view`: the HTML page of scored responses, checked as parsed HTML and as rendered by
headless Chromium (skipped when the Debian package is not installed; .ci/run installs it)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
NASTY = " <script>alert(1)</script> & 12 - 30 = -18 \u00e9\u2192 done"
RESPONSES = [
    # (prompt, response, reward, uid)
    ("Question: What is 12 plus 30?", " Let's think step by step. 12 + 30 = 42.\nSo the answer is \\boxed{42}.", 1.0,
     "q1"),
    ("Question: What is 12 plus 30?", NASTY, 0.0, "q1"),
    ("Compute 7 times 8.", " 7 * 8 = 56. The answer is 56.\n\n\tDone  ", 1.0, "q2"),
    ("Compute 7 times 8.", " 7 * 8 = 54", 0.0, "q2"),
]


def _env():
    leaked = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in leaked}


def _view(*args, timeout=300):
    cmd = [sys.executable, "-m", "verl_tokensel.cli.main", "view", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


class PageParser(HTMLParser):
    """Collects the token spans (class, title, text), body attributes and every start tag."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tokens: list[dict] = []
        self.body: dict = {}
        self.summary: dict = {}
        self.tags: list[str] = []
        self.responses: list[list[dict]] = []
        self._depth = 0  # span nesting inside the current token span
        self._cur = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        cls = (a.get("class") or "").split()
        if tag == "body":
            self.body = a
        if "summary" in cls:
            self.summary = a
        if tag == "div" and "resp" in cls:
            self.responses.append([])
        if tag == "span":
            if self._cur is not None:
                self._depth += 1
            elif "tok" in cls:
                self._cur = {"cls": set(cls), "title": a.get("title", ""), "text": ""}
                self._depth = 0

    def handle_endtag(self, tag):
        if tag == "span" and self._cur is not None:
            if self._depth:
                self._depth -= 1
            else:
                self.tokens.append(self._cur)
                self.responses[-1].append(self._cur)
                self._cur = None

    def handle_data(self, data):
        if self._cur is not None:
            self._cur["text"] += data


def _parse(path: Path) -> PageParser:
    p = PageParser()
    p.feed(path.read_text(encoding="utf-8"))
    p.close()
    return p


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir, load_tiny_tokenizer

    root = tmp_path_factory.mktemp("view")
    model = build_tiny_model_dir(root / "tiny_qwen2")
    data = root / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r, "reward": w, "uid": u}) + "\n"
                            for p, r, w, u in RESPONSES))
    tok = load_tiny_tokenizer(model)
    lengths = [len(tok(r, add_special_tokens=False)["input_ids"]) for _, r, _, _ in RESPONSES]
    return {"root": root, "model": model, "data": data, "lengths": lengths}


@pytest.fixture(scope="module")
def forking_page(assets):
    out = assets["root"] / "forking.html"
    res = _view("--model", assets["model"], "--data", str(assets["data"]), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_forking_page_has_every_token_and_the_micro_batch_selection(assets, forking_page):
    out, res = forking_page
    page = _parse(out)
    n = sum(assets["lengths"])
    assert len(page.tokens) == n == int(page.body["data-token-count"]) == int(page.summary["data-token-count"])
    assert [len(r) for r in page.responses] == assets["lengths"]
    # forking: top 20% entropy over ONE pool of all rendered responses (scope micro_batch)
    k = math.ceil(0.2 * n)
    sel = [t for t in page.tokens if "sel" in t["cls"]]
    assert len(sel) == k == int(page.body["data-selected-count"])
    # the tooltip has the numbers; the selected tokens are exactly ranks 1..k of the pool
    for t in page.tokens:
        for word in ("entropy", "logp", "grad norm", "advantage", "score (entropy)", "rank"):
            assert word in t["title"], t["title"]
    ranks = sorted(int(re.search(r"rank (\d+) of (\d+)", t["title"]).group(1)) for t in sel)
    assert ranks == list(range(1, k + 1))
    # the entropy is the selected tokens' ranking score: every selected token's >= every other's
    ent = lambda t: float(re.search(r"score \(entropy\) (\S+)", t["title"]).group(1))  # noqa: E731
    assert min(map(ent, sel)) >= max(ent(t) for t in page.tokens if "sel" not in t["cls"])
    # the spans' text is the response, whitespace, newlines and multi-byte characters included
    assert ["".join(t["text"] for t in r) for r in page.responses] == [r for _, r, _, _ in RESPONSES]
    assert any("nl" in t["cls"] for t in page.tokens)
    # the page says what it did
    html = out.read_text()
    assert "scope micro_batch" in html and "ONE pool" in html and "On-policy: ratio r = 1" in html
    # how forking trains (test_front_door: every preset's line)
    assert "scope micro_batch: the pool is each micro-batch on each rank; score_source current" in html
    assert "GRPO from the rewards" in html
    assert "wrote" in res.stdout and "scoring" in res.stderr  # tqdm progress bar


def test_page_gets_the_mode_open_gives_a_new_file(forking_page):
    """0666 less the umask (0644 under the usual 022), like the demo's pages, not mkstemp's 0600; no temporary file
    left next to it."""
    import stat

    out, _ = forking_page
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask, oct(out.stat().st_mode)
    assert not [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_page_escapes_response_text(forking_page):
    out, _ = forking_page
    html = out.read_text()
    page = _parse(out)
    assert "<script>alert" not in html
    assert page.tags.count("script") == 1  # the page's own inline script, nothing injected
    assert "&lt;" in html and "&amp;" in html
    assert "<script>alert(1)</script> &" in "".join(t["text"] for t in page.tokens)
    assert not re.search(r"""<(link|img|iframe)\b|src=|href=["']?https?:|url\(""", html), "external request"


def test_sequence_scope_bottom_preset(assets):
    out = assets["root"] / "bottom.html"
    res = _view("--model", assets["model"], "--data", str(assets["data"]), "--out", str(out),
                "--preset", "forking_bottom", "--scope", "sequence", "--shade", "logp", "--max-responses", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    page = _parse(out)
    lengths = assets["lengths"][:3]
    assert len(page.tokens) == sum(lengths) == int(page.body["data-token-count"])
    # sequence scope: ceil(0.8 n) lowest-entropy tokens of every response
    assert [sum("sel" in t["cls"] for t in r) for r in page.responses] == [math.ceil(0.8 * n) for n in lengths]
    html = out.read_text()
    assert "Scope sequence" in html and "shade (logp)" in html and "3 rendered of 4" in html


@pytest.mark.parametrize(
    "case, expect",
    [
        ("preset", ["--preset", "'bogus'", "forking", "gmts", "grad_norm"]),
        ("shade", ["--shade", "'bogus'", "entropy", "logp", "gmts", "grad_norm", "random"]),
        ("missing_data", ["--data", "nope.jsonl", "no such file"]),
        ("empty_data", ["--data", "empty.jsonl", "empty"]),
        ("missing_model", ["--model", "no_model", "no such directory"]),
    ],
)
def test_bad_input_is_named_and_nothing_is_written(assets, tmp_path, capsys, case, expect):
    from verl_tokensel.cli.main import main

    (tmp_path / "empty.jsonl").write_text("")
    args = {"--model": assets["model"], "--data": str(assets["data"]), "--out": str(tmp_path / "page.html")}
    if case == "preset":
        args["--preset"] = "bogus"
    elif case == "shade":
        args["--shade"] = "bogus"
    elif case == "missing_data":
        args["--data"] = str(tmp_path / "nope.jsonl")
    elif case == "empty_data":
        args["--data"] = str(tmp_path / "empty.jsonl")
    else:
        args["--model"] = str(tmp_path / "no_model")
    rc = main(["view", *[x for kv in args.items() for x in kv]])
    err = capsys.readouterr().err
    assert rc == 2
    for word in expect:
        assert word in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_grpo_advantages_match_verl():
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from verl_tokensel.analysis.stats import grpo_advantages as verl_grpo_advantages

    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.25]
    groups = ["a", "a", "b", "b", "b", "c", "a"]
    tlr = torch.zeros(len(rewards), 3)
    tlr[:, -1] = torch.tensor(rewards)
    adv, _ = compute_grpo_outcome_advantage(tlr, torch.ones_like(tlr), np.array(groups, dtype=object))
    assert verl_grpo_advantages(rewards, groups) == pytest.approx(adv[:, 0].tolist(), abs=1e-6)


def _chromium(*args, tmp: Path, timeout=120) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    profile.mkdir()
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), "HOME": str(tmp)})


@pytest.fixture(scope="module")  # module scope: resolved before the (module-scoped) page is built
def chromium():
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
        pytest.skip("Debian package chromium not installed; .ci/run installs it")
    return CHROMIUM


def test_page_renders_in_headless_chromium(chromium, assets, forking_page, tmp_path):
    import numpy as np
    from PIL import Image

    out, _ = forking_page
    n = sum(assets["lengths"])
    png = tmp_path / "page.png"
    res = _chromium(f"--screenshot={png}", "--window-size=1200,900", out.resolve().as_uri(), tmp=tmp_path)
    assert png.exists(), res.stderr[-2000:]
    im = Image.open(png).convert("RGB")
    assert im.size == (1200, 900)
    px = np.asarray(im, dtype=np.int64).reshape(-1, 3)
    non_white = float((px.min(axis=1) < 245).mean())
    colours = len(np.unique(px[:, 0] * 65536 + px[:, 1] * 256 + px[:, 2]))
    # the token shading: saturated warm pixels of the colour scale (red high, blue low)
    warm = int(((px[:, 0] > 230) & (px[:, 2] < 150) & (px[:, 0] - px[:, 2] > 100)).sum())
    # the selection mark: the blue (#1d4ed8) outline / underline of the selected tokens
    blue = int(((px[:, 2] > 180) & (px[:, 0] < 80) & (px[:, 1] < 120)).sum())
    assert non_white > 0.05 and colours > 100 and warm > 2000 and blue > 200, (non_white, colours, warm, blue)

    res = _chromium("--dump-dom", out.resolve().as_uri(), tmp=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert len(re.findall(r'<span class="tok[ "]', dom)) == n
    # the inline script ran and counted the same spans
    m = re.search(r'id="dom-count"[^>]*data-dom-tokens="(\d+)"', dom)
    assert m and int(m.group(1)) == n, dom[:2000]
