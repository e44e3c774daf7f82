"""The interactive history page: one self-contained HTML file (Plotly's script inlined: it opens offline) in which a
reader picks a GPU (or all of them), an implementation, a tier and a figure, and sees that figure over time for every
group that matches, with the value, the threshold, the run id and the commit on hover, failed checks and regressions
marked; and, below the chart, the latest night per GPU type side by side for the implementation and tier selected (or
each of them, where a filter is "(all)"): one column per GPU type, one row per figure (``history_latest``).

The data travel once, in columns (``payload``): a table of runs (id, time, commit) and, per group (GPU,
implementation, tier), per figure, the points as run indices and values, thresholds only where a figure has one;
names are indices into one string table. 10,000 runs of a dozen figures each take a few MB of JSON beside Plotly's
own 4.6 MB, and the page draws only what the filters select. The side-by-side tables (``side``) take the same
string and run ids.
"""

from __future__ import annotations

import json

from lora_suite.results import history_latest
from lora_suite.results.history_data import Group

TITLE = "LoRA GPU suite history"


def payload(groups: list[Group]) -> dict:
    """The page's data, in columns: runs, strings, groups with their figures' points and their regressions."""
    runs: dict[str, int] = {}
    run_rows: list[list] = []
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        return strings.setdefault(text, len(strings))

    def rid(group: Group, run: str, when) -> int:
        if run not in runs:
            runs[run] = len(run_rows)
            run_rows.append([run, when.strftime("%Y-%m-%dT%H:%M:%SZ"), group.commits.get(run, "")])
        return runs[run]

    out_groups = []
    for g in groups:
        for when, run in g.runs:
            rid(g, run, when)
        figures = []
        for name, pts in sorted(g.figures.items()):
            thresholds = [p.threshold for p in pts]
            figures.append(
                {
                    "n": sid(name),
                    "op": pts[-1].op,
                    "r": [runs[p.run] for p in pts],
                    "v": [_num(p.value) for p in pts],
                    **({"t": [_num(t) for t in thresholds]} if any(t is not None for t in thresholds) else {}),
                    **({"f": [i for i, p in enumerate(pts) if not p.passed]} if not all(p.passed for p in pts) else {}),
                }
            )
        out_groups.append(
            {
                "gpu": sid(g.gpu),
                "impl": sid(g.implementation),
                "tier": sid(g.tier),
                "figs": figures,
                "reg": {str(runs[r]): "; ".join(found)[:300] for r, found in g.regressions.items() if r in runs},
            }
        )
    side = history_latest.encode(history_latest.latest_per_gpu(groups), sid, runs.__getitem__, _num)
    return {"runs": run_rows, "s": list(strings), "groups": out_groups, "side": side}


def _num(v: float | None):
    return None if v is None else float(f"{v:.6g}")


def render(groups: list[Group]) -> str:
    """The whole page: Plotly's script, the data, the controls and the code that draws what they select."""
    from plotly.offline import get_plotlyjs

    data = json.dumps(payload(groups), separators=(",", ":")).replace("</", "<\\/")
    runs = len({(g.gpu, run) for g in groups for _, run in g.runs})  # GPU types started together share run ids
    gpus = len({g.gpu for g in groups})
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{TITLE}</title>"
        f"<script>{get_plotlyjs()}</script><style>{STYLE}</style></head><body>"
        f"<h1>{TITLE}</h1><p id='summary'>{runs} runs of {gpus} GPU type(s) in {len(groups)} groups "
        "(GPU · implementation · tier).</p>"
        f"{CONTROLS}<div id='chart'></div><p id='note'></p><table id='latest'></table>"
        "<h2>The latest night per GPU type</h2><div id='side'></div>"
        f"<script id='data' type='application/json'>{data}</script><script>{SCRIPT}</script></body></html>\n"
    )


STYLE = (
    "body{font-family:sans-serif;margin:12px;max-width:1500px}label{margin-right:14px}select{max-width:420px}"
    "#chart{height:560px}table{border-collapse:collapse;margin-top:10px}td,th{border:1px solid #bbb;padding:2px 6px;"
    "font-size:12px}.fail{background:#f8d0d0}.pass{background:#dff0d8}th.sel,td.sel{outline:2px solid #36c}"
    "caption{text-align:left;font-weight:bold;padding:6px 0}.side th{text-align:left}"
)
CONTROLS = (
    "<div id='controls'><label>GPU <select id='gpu' title='(all): every GPU type'></select></label>"
    "<label>implementation <select id='impl'></select></label><label>tier <select id='tier'></select></label>"
    "<label>figure <select id='fig'></select></label></div>"
)
# The page's code: fill the selects from the data, then draw the chosen figure for every group the filters keep.
SCRIPT = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const S = D.s, ALL = '(all)';
const sel = id => document.getElementById(id);
function fill(id, values, keep) {
  const el = sel(id), before = keep ? el.value : ALL;
  el.innerHTML = '';
  for (const v of [ALL, ...values]) { const o = document.createElement('option'); o.value = o.textContent = v; el.appendChild(o); }
  el.value = values.includes(before) ? before : ALL;
}
function groupsKept() {
  return D.groups.filter(g => ['gpu', 'impl', 'tier'].every(k => sel(k).value === ALL || S[g[k]] === sel(k).value));
}
function refreshFigures() {
  const names = new Set();
  for (const g of groupsKept()) for (const f of g.figs) names.add(S[f.n]);
  const el = sel('fig'), before = el.value;
  el.innerHTML = '';
  for (const n of [...names].sort()) { const o = document.createElement('option'); o.value = o.textContent = n; el.appendChild(o); }
  if (names.has(before)) el.value = before;
}
function draw() {
  const name = sel('fig').value, traces = [], rows = [];
  let regs = 0;
  for (const g of groupsKept()) {
    const f = g.figs.find(f => S[f.n] === name);
    if (!f) continue;
    const label = `${S[g.gpu]} · ${S[g.impl]} · ${S[g.tier]}`;
    const x = f.r.map(i => D.runs[i][1]);
    const text = f.r.map((i, k) => `${D.runs[i][0]}<br>commit ${D.runs[i][2]}<br>value ${f.v[k]}` +
      (f.t ? `<br>threshold ${f.op} ${f.t[k]}` : '') + (g.reg[i] ? `<br><b>regression</b>: ${g.reg[i]}` : ''));
    traces.push({type: 'scattergl', mode: 'lines+markers', name: label, x, y: f.v, text, hoverinfo: 'text+name',
                 legendgroup: label});
    if (f.t) traces.push({type: 'scattergl', mode: 'lines', name: `${label}: threshold`, x, y: f.t,
                          line: {dash: 'dash', width: 1}, hoverinfo: 'skip', legendgroup: label, showlegend: false});
    const bad = [...new Set([...(f.f || []), ...f.r.map((i, k) => g.reg[i] ? k : -1).filter(k => k >= 0)])];
    regs += bad.length;
    if (bad.length) traces.push({type: 'scattergl', mode: 'markers', name: `${label}: failed or regressed`,
      x: bad.map(k => x[k]), y: bad.map(k => f.v[k]), text: bad.map(k => text[k]), hoverinfo: 'text',
      marker: {color: '#c00', size: 11, symbol: 'x'}, legendgroup: label, showlegend: false});
    const k = f.v.length - 1;
    rows.push(`<tr class="${(f.f || []).includes(k) ? 'fail' : ''}"><td>${label}</td><td>${f.v[k]}</td>` +
      `<td>${f.t ? f.op + ' ' + f.t[k] : ''}</td><td>${f.v.length}</td><td>${D.runs[f.r[k]][0]}</td>` +
      `<td>${D.runs[f.r[k]][2]}</td></tr>`);
  }
  Plotly.react('chart', traces, {title: {text: name || 'no figure matches the filters'}, hovermode: 'closest',
    xaxis: {title: {text: 'run time (UTC)'}}, yaxis: {title: {text: name}}, legend: {orientation: 'h', y: -0.2}},
    {responsive: true});
  sel('note').textContent = `${traces.length ? rows.length : 0} group(s) drawn; ${regs} point(s) failed or regressed.`;
  sel('latest').innerHTML = '<tr><th>group</th><th>latest</th><th>threshold</th><th>runs</th><th>run</th><th>commit</th></tr>' + rows.join('');
}
const esc = t => String(t).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'})[c]);
// The latest night per GPU type, side by side: one table per implementation and tier the filters keep, one column per
// GPU type (the GPU selected outlined), one row per figure; an empty cell: that GPU's latest run has no such figure.
function drawSide() {
  const keep = (t, k) => sel(k).value === ALL || S[t[k]] === sel(k).value, gpus = D.side.gpus.map(i => S[i]);
  const cls = (k, more) => `class="${[gpus[k] === sel('gpu').value ? 'sel' : '', more].join(' ').trim()}"`;
  const html = [];
  for (const t of D.side.t) {
    if (!keep(t, 'impl') || !keep(t, 'tier')) continue;
    const heads = t.runs.map((i, k) => i < 0 ? `<td ${cls(k, '')}>no run</td>` :
      `<td ${cls(k, t.reg[k] ? 'fail' : '')} title="commit ${D.runs[i][2]}${t.reg[k] ? '; regression: ' + esc(t.reg[k]) : ''}">` +
      `${esc(D.runs[i][0])}<br>${D.runs[i][1].slice(0, 10)}${t.reg[k] ? '<br><b>regression</b>' : ''}</td>`);
    const rows = t.rows.map(([n, cells]) => `<tr><th>${esc(S[n])}</th>` + cells.map((c, k) => !c ? `<td ${cls(k, '')}></td>` :
      `<td ${cls(k, c.length > 2 ? (c[1] ? 'pass' : 'fail') : '')}${c.length > 2 ? ` title="threshold ${esc(c[2])} ${c[3]}"` : ''}>` +
      `${c[0]}${c.length > 2 ? (c[1] ? ' pass' : ' FAIL') : ''}</td>`).join('') + '</tr>');
    html.push(`<table class="side" data-impl="${esc(S[t.impl])}" data-tier="${esc(S[t.tier])}">` +
      `<caption>${esc(S[t.impl])} · ${esc(S[t.tier])}</caption><tr><th>figure</th>` +
      gpus.map((g, k) => `<th ${cls(k, '')}>${esc(g)}</th>`).join('') + `</tr><tr><th>latest run</th>${heads.join('')}</tr>` +
      rows.join('') + '</table>');
  }
  sel('side').innerHTML = html.join('') || '<p>no run matches the implementation and tier selected</p>';
}
function update(fromFilter) { if (fromFilter) refreshFigures(); draw(); drawSide(); }
fill('gpu', [...new Set(D.groups.map(g => S[g.gpu]))].sort());
fill('impl', [...new Set(D.groups.map(g => S[g.impl]))].sort());
fill('tier', [...new Set(D.groups.map(g => S[g.tier]))].sort());
for (const id of ['gpu', 'impl', 'tier']) sel(id).addEventListener('change', () => update(true));
sel('fig').addEventListener('change', () => update(false));
update(true);
"""
