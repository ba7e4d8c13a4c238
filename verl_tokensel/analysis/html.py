"""Self-contained HTML page of scored responses (``verl-tokensel view``). No torch, no verl import.

One file, inline CSS and JS, no external request. Per response: the prompt (collapsed, greyed),
then every response token as ``<span class="tok">``, background shaded by a chosen per-token value
on a colour scale shown in a legend; tokens the selector keeps also get the class ``sel`` (bold,
underlined, outlined). Each token's ``title`` tooltip lists its entropy, log-prob, logit-gradient
norm, advantage, score and rank in its selection pool. ``<body data-token-count=N>`` holds the
number of rendered response tokens.

Token text is HTML-escaped; whitespace is kept (``white-space: pre-wrap``), a newline token gets a
visible ``↵`` mark and a token that shows no text of its own (whitespace-only or the leading bytes
of a multi-byte character that the next token completes) stays visible through its shading or a
``·`` mark. The marks are CSS pseudo-content: the DOM text of the spans, concatenated, is exactly
the decoded response.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

# Colour scale (low -> high). Light enough at the top that black text stays readable.
COLOUR_STOPS: tuple[tuple[float, tuple[int, int, int]], ...] = (
    (0.00, (255, 255, 255)),
    (0.25, (255, 241, 168)),
    (0.50, (255, 200, 110)),
    (0.75, (250, 140, 90)),
    (1.00, (232, 85, 100)),
)


@dataclass
class TokenView:
    """One rendered response token. ``score``/``rank`` are None when no selector ran."""

    text: str
    token_id: int
    token_str: str
    entropy: float
    logp: float
    grad_norm: float
    advantage: float
    shade: float
    score: Optional[float] = None
    rank: Optional[int] = None
    selected: bool = False


@dataclass
class ResponseView:
    """One rendered response."""

    index: int
    prompt_text: str
    prompt_tokens: int
    tokens: list[TokenView]
    uid: Optional[str] = None
    reward: Optional[float] = None
    advantage: Optional[float] = None
    pool: Optional[int] = None  # selection pool index (one pool per page for micro_batch scope)
    pool_size: Optional[int] = None
    pool_budget: Optional[int] = None


@dataclass
class PageInfo:
    """Header facts. ``rows`` are extra (label, value) lines shown as given (escaped)."""

    title: str
    model: str
    data: str
    preset: str
    shade: str
    shade_help: str
    shade_reversed: bool = False  # True: dark = low value (e.g. log-prob: surprising tokens dark)
    rows: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def colour(t: float) -> str:
    """Hex colour of ``t`` in [0, 1] on :data:`COLOUR_STOPS` (NaN -> light grey)."""
    if t != t:
        return "#e5e5e5"
    t = min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(COLOUR_STOPS, COLOUR_STOPS[1:]):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            rgb = tuple(round(a + (b - a) * f) for a, b in zip(c0, c1))
            return "#%02x%02x%02x" % rgb
    return "#%02x%02x%02x" % COLOUR_STOPS[-1][1]


def shade_range(values: Sequence[float]) -> tuple[float, float]:
    """(lo, hi) of the finite values (0, 0 when none)."""
    finite = [v for v in values if v == v and not math.isinf(v)]
    return (min(finite), max(finite)) if finite else (0.0, 0.0)


def _unit(v: float, lo: float, hi: float, reversed_: bool) -> float:
    if v != v:
        return float("nan")
    if math.isinf(v):
        t = 1.0 if v > 0 else 0.0
    else:
        t = 0.0 if hi <= lo else (v - lo) / (hi - lo)
    return 1.0 - t if reversed_ else t


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def escape_text(text: str) -> str:
    """HTML-escape token text; control characters (other than tab/newline/CR) become visible ``\\xNN``."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    parts = []
    last = 0
    for m in _CONTROL.finditer(text):
        parts.append(html.escape(text[last : m.start()], quote=False))
        parts.append(f'<span class="ctl">\\x{ord(m.group()):02x}</span>')
        last = m.end()
    parts.append(html.escape(text[last:], quote=False))
    return "".join(parts)


def _fmt(v: Optional[float], digits: int = 4) -> str:
    if v is None:
        return "-"
    if v != v:
        return "nan"
    return f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


def _tooltip(tok: TokenView, pos: int, n: int, resp: ResponseView, info: PageInfo, score_name: Optional[str]) -> str:
    lines = [
        f"token {pos + 1}/{n}  id {tok.token_id}  {tok.token_str!r}",
        f"entropy {_fmt(tok.entropy)} nats",
        f"logp {_fmt(tok.logp)} (p={_fmt(math.exp(tok.logp)) if tok.logp == tok.logp else 'nan'})",
        f"grad norm ||e_a - p|| {_fmt(tok.grad_norm)}",
        f"advantage {_fmt(tok.advantage)}",
    ]
    if score_name is not None:
        lines.append(f"score ({score_name}) {_fmt(tok.score)}")
        lines.append(
            f"rank {tok.rank} of {resp.pool_size} in pool {resp.pool}; "
            f"{'SELECTED' if tok.selected else 'not selected'} (budget {resp.pool_budget})"
        )
    else:
        lines.append("rank - (no selector)")
    if score_name != info.shade:
        lines.append(f"shade ({info.shade}) {_fmt(tok.shade)}")
    return "\n".join(lines)


CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;padding:16px 24px;color:#111;background:#fafafa;font-size:14px}
h1{font-size:20px;margin:0 0 8px}
table.meta{border-collapse:collapse;margin:4px 0 8px}
table.meta td{padding:1px 12px 1px 0;vertical-align:top}
table.meta td:first-child{color:#555;white-space:nowrap}
.notes{color:#444;margin:4px 0 8px;padding-left:18px}
.legend{display:flex;align-items:center;gap:8px;margin:8px 0;flex-wrap:wrap}
.bar{width:280px;height:16px;border:1px solid #999}
.controls{margin:6px 0 12px}
.controls label{margin-right:16px}
.resp{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 12px}
.resp h2{font-size:14px;margin:0 0 6px;color:#333;font-weight:600}
.resp h2 .m{font-weight:normal;color:#666;margin-left:10px}
details.prompt{color:#888;margin-bottom:6px}
details.prompt pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f4;color:#777;padding:6px;margin:4px 0;font-size:12px}
.text{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:13px;line-height:1.7}
.tok{border-radius:2px;padding:0 0.5px}
.tok:hover{outline:1px solid #333}
.tok.sel,.sel-sample{font-weight:bold;text-decoration:underline;text-decoration-color:#1d4ed8;text-decoration-thickness:2px;text-underline-offset:2px;box-shadow:inset 0 0 0 1px #1d4ed8}
.tok.nl::before{content:"\\21B5";color:#555;font-weight:normal}
.tok.empty::before{content:"\\00B7";color:#555}
.ctl{color:#b00;font-size:85%}
.sample{display:inline-block;padding:0 4px;margin:0 2px;background:#fff;border-radius:2px}
body.dim .tok:not(.sel){background:transparent!important;color:#999}
.empty-resp{color:#999;font-style:italic}
"""

JS = """
(function(){
  var toks=document.querySelectorAll('span.tok');
  var sel=document.querySelectorAll('span.tok.sel');
  var c=document.getElementById('dom-count');
  if(c){c.textContent=toks.length+' token spans, '+sel.length+' selected (counted in the page)';
        c.setAttribute('data-dom-tokens',String(toks.length));c.setAttribute('data-dom-selected',String(sel.length));}
  var dim=document.getElementById('dim');
  if(dim){dim.addEventListener('change',function(){document.body.classList.toggle('dim',dim.checked);});}
  var ex=document.getElementById('expand');
  if(ex){ex.addEventListener('change',function(){
    document.querySelectorAll('details.prompt').forEach(function(d){d.open=ex.checked;});});}
})();
"""


def render_page(info: PageInfo, responses: Sequence[ResponseView], *, score_name: Optional[str]) -> str:
    """The whole HTML document as a string. ``score_name`` is the selector's score (None: no selector)."""
    all_shades = [t.shade for r in responses for t in r.tokens]
    lo, hi = shade_range(all_shades)
    n_tokens = len(all_shades)
    n_sel = sum(t.selected for r in responses for t in r.tokens)
    esc = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # no external request: inline everything; this policy also blocks any accidental fetch
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">",
        f"<title>{esc(info.title)}</title>",
        f"<style>{CSS}</style></head>",
        f'<body data-token-count="{n_tokens}" data-selected-count="{n_sel}" data-response-count="{len(responses)}">',
        f"<h1>{esc(info.title)}</h1>",
        '<table class="meta">',
    ]
    rows = [("model", info.model), ("data", info.data), ("preset", info.preset)] + list(info.rows)
    for k, v in rows:
        out.append(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>")
    out.append(
        f'<tr><td>counts</td><td class="summary" data-token-count="{n_tokens}">{len(responses)} responses, '
        f"{n_tokens} response tokens, {n_sel} selected</td></tr>"
    )
    out.append('<tr><td>in the page</td><td id="dom-count">(needs JavaScript)</td></tr>')
    out.append("</table>")
    if info.notes:
        out.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in info.notes) + "</ul>")
    # legend
    stops = list(COLOUR_STOPS)
    grad = ", ".join(f"rgb{c} {int(t * 100)}%" for t, c in stops)
    left, right = (hi, lo) if info.shade_reversed else (lo, hi)
    out.append(
        '<div class="legend"><b>shade:</b> '
        f"<span>{esc(info.shade)}</span>"
        f"<span>{esc(_fmt(left))}</span>"
        f'<span class="bar" style="background:linear-gradient(to right, {grad})"></span>'
        f"<span>{esc(_fmt(right))}</span>"
        f'<span style="color:#555">{esc(info.shade_help)}</span>'
        # legend samples are not token spans (no class tok): the token counts stay exact
        '<span class="sample sel-sample">selected</span>'
        '<span class="sample">not selected</span>'
        "</div>"
    )
    out.append(
        '<div class="controls"><label><input type="checkbox" id="dim"> shade selected tokens only</label>'
        '<label><input type="checkbox" id="expand"> expand all prompts</label>'
        "hover a token for its numbers</div>"
    )
    for r in responses:
        n = len(r.tokens)
        k = sum(t.selected for t in r.tokens)
        meta = [f"{n} tokens", f"{k} selected"]
        if r.uid is not None:
            meta.append(f"group {r.uid}")
        if r.reward is not None:
            meta.append(f"reward {_fmt(r.reward)}")
        if r.advantage is not None:
            meta.append(f"advantage {_fmt(r.advantage)}")
        if r.pool is not None:
            meta.append(f"pool {r.pool}")
        out.append(f'<div class="resp" id="r{r.index}" data-tokens="{n}" data-selected="{k}">')
        out.append(f'<h2>response {r.index}<span class="m">{esc(" | ".join(meta))}</span></h2>')
        out.append(
            f'<details class="prompt"><summary>prompt ({r.prompt_tokens} tokens)</summary>'
            f"<pre>{escape_text(r.prompt_text)}</pre></details>"
        )
        spans = []
        for i, t in enumerate(r.tokens):
            cls = ["tok"]
            if t.selected:
                cls.append("sel")
            if "\n" in t.text:
                cls.append("nl")
            elif t.text == "":
                cls.append("empty")
            bg = colour(_unit(t.shade, lo, hi, info.shade_reversed))
            title = esc(_tooltip(t, i, n, r, info, score_name), quote=True)
            spans.append(
                f'<span class="{" ".join(cls)}" style="background:{bg}" title="{title}">{escape_text(t.text)}</span>'
            )
        body = "".join(spans) if spans else '<span class="empty-resp">(empty response)</span>'
        out.append(f'<div class="text">{body}</div></div>')
    out.append(f"<script>{JS}</script>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


__all__ = [
    "COLOUR_STOPS", "PageInfo", "ResponseView", "TokenView", "colour", "escape_text", "render_page", "shade_range",
]
