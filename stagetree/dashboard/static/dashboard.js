// stagetree dashboard: renders the server's payload (GET /api/view, then server-sent events on
// /api/stream) with Plotly.js. Every string that comes from the log (study names, trial ids,
// hyper-parameters, metric names, errors) is data: it is set with textContent, or escaped with
// plotText() before Plotly (which reads a small HTML subset in its labels) sees it. The page is
// never reloaded: a study is picked, the stream is reopened, the views are redrawn in place.
'use strict';

(function () {
  const COLORS = {shared: '#e8743b', unique: '#4c78a8', failed: '#d62728', running: '#f2b134', lost: '#9e9e9e',
                  best: '#c0392b', selected: '#1f5fbf', promote: '#2da44e', stop: '#6e7781'};
  const PALETTE = ['#4c78a8', '#72b7b2', '#54a24b', '#b279a2', '#9d755d', '#79706e', '#eeca3b', '#ff9da6',
                   '#439894', '#83bcb6', '#88d27a', '#d6a5c9'];
  const PLOT_CONFIG = {responsive: true, displaylogo: false, scrollZoom: false};
  const LAYOUT = {legend: {orientation: 'h', y: 1.02, yanchor: 'bottom', x: 0}, hoverlabel: {align: 'left'}};

  const ui = {
    study: new URLSearchParams(window.location.search).get('study'),
    payload: null,
    selected: null,
    sort: null,        // {key, dir: 1 | -1}
    stream: null,
  };

  const $ = (id) => document.getElementById(id);

  // Text for Plotly labels: its pseudo-HTML is neutralised, so data always shows as written.
  function plotText(value) {
    return String(value).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === 'class') node.className = v;
      else if (k === 'text') node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return '—';
    if (typeof value !== 'number') return String(value);
    if (Number.isInteger(value) && digits === undefined) return value.toLocaleString('en-US');
    return value.toLocaleString('en-US', {maximumFractionDigits: digits === undefined ? 4 : digits,
                                          minimumFractionDigits: 0});
  }

  function seconds(value) {
    if (value === null || value === undefined) return '—';
    if (value >= 3600) return (value / 3600).toFixed(2) + ' h';
    if (value >= 60) return (value / 60).toFixed(1) + ' min';
    return value.toFixed(1) + ' s';
  }

  // ---------------------------------------------------------------- the stream

  function connect() {
    if (ui.stream) ui.stream.close();
    const query = ui.study ? '?study=' + encodeURIComponent(ui.study) : '';
    const stream = new EventSource('/api/stream' + query);
    ui.stream = stream;
    stream.addEventListener('update', (event) => {
      if (stream !== ui.stream) return;
      render(JSON.parse(event.data));
    });
    stream.onerror = () => {
      if (stream !== ui.stream) return;
      setLive('off', 'disconnected: reconnecting…');
    };
  }

  function setLive(kind, text) {
    const node = $('live-status');
    node.className = 'live ' + kind;
    node.textContent = text;
  }

  // ---------------------------------------------------------------- rendering

  function render(payload) {
    ui.payload = payload;
    if (!ui.study && payload.study) ui.study = payload.study;
    const source = payload.source;
    $('source').textContent = source.label;
    if (source.error) setLive('off', 'source unreachable');
    else if (source.live && !(payload.view && payload.view.study.finished)) {
      setLive('on', 'live · ' + fmt(source.records) + ' records');
    } else if (source.live) setLive('done', 'following · study finished · ' + fmt(source.records) + ' records');
    else setLive('done', (source.kind === 'export' ? 'export' : 'finished') + ' · ' + fmt(source.records) + ' records');
    renderStudies(payload);
    const problem = source.error || payload.problem;
    $('problem').hidden = !problem;
    $('problem').textContent = problem || '';
    renderAudit(payload.audit);
    const view = payload.view;
    if (!view) {
      $('study-name').textContent = payload.studies.length ? '' : 'waiting for a study to start…';
      return;
    }
    $('study-name').textContent = view.study.name;
    $('study-name').title = view.study.tuner ? 'tuner: ' + view.study.tuner : '';
    document.title = 'stagetree · ' + view.study.name;
    if (ui.selected && !view.trials.some((t) => t.id === ui.selected)) ui.selected = null;
    renderFigures(view);
    renderTable(view);
    drawTree(view);
    drawGantt(view);
    drawCurves(view);
    renderSelected(view);
  }

  function renderStudies(payload) {
    const select = $('study-select');
    const wanted = payload.studies.map((s) => s.id + '\u0000' + s.name + '\u0000' + s.finished).join('\u0001');
    if (select.dataset.list !== wanted) {
      select.replaceChildren(...payload.studies.map((s) => el('option', {
        value: s.id,
        text: s.name + (s.name !== s.id ? ' [' + s.id + ']' : '') + (s.finished ? ' · finished' : ' · running'),
      })));
      select.dataset.list = wanted;
    }
    if (payload.study !== null) select.value = payload.study;
  }

  const FIGURES = [
    ['finished_trials', 'Finished trials', (f) => fmt(f.finished_trials) + ' / ' + fmt(f.trials),
     (f) => fmt(f.running_trials) + ' running' + (f.failed_trials ? ', ' + f.failed_trials + ' failed' : '')],
    ['merge_rate', 'Merge rate p', (f) => fmt(f.merge_rate, 3), () => 'total / unique steps'],
    ['total_steps', 'Total steps', (f) => fmt(f.total_steps), () => 'every trial alone'],
    ['unique_steps', 'Unique steps', (f) => fmt(f.unique_steps), () => 'after merging'],
    ['executed_steps', 'Executed steps', (f) => fmt(f.executed_steps), () => 'trained by workers'],
    ['worker_seconds', 'Worker-seconds', (f) => seconds(f.worker_seconds), () => 'held by stages'],
    ['saved_worker_seconds', 'Saved vs trial-based', (f) => seconds(f.saved_worker_seconds),
     (f) => 'est. of ' + seconds(f.trial_based_worker_seconds) + ' trial-based'],
    ['idle_worker_seconds', 'Idle worker time', (f) => seconds(f.idle_worker_seconds),
     (f) => f.idle_ratio === null ? '' : (100 * f.idle_ratio).toFixed(1) + '% of capacity'],
    ['end_to_end_seconds', 'End-to-end', (f) => seconds(f.end_to_end_seconds), () => 'study wall time'],
    ['best_metric', 'Best', (f) => fmt(f.best_metric), (f) => f.best_trial === null ? '' : 'trial ' + f.best_trial + (f.best_step == null ? '' : ' at step ' + f.best_step)],
  ];

  function renderFigures(view) {
    const f = view.figures;
    const cards = FIGURES.map(([key, label, value, note]) => el('div', {class: 'fig', 'data-key': key},
      el('div', {class: 'label', text: key === 'best_metric' && view.study.metric ? 'Best ' + view.study.metric : label}),
      el('div', {class: 'value', 'data-value': JSON.stringify(f[key] === undefined ? null : f[key]),
                 text: value(f)}),
      el('div', {class: 'note', text: note(f)})));
    $('figures').replaceChildren(...cards);
  }

  function renderAudit(audit) {
    const box = $('audit');
    const status = $('audit-status');
    const checks = $('audit-checks');
    const button = $('verify-button');
    if (!audit) {
      box.className = 'audit none';
      status.textContent = 'not verified';
      checks.replaceChildren();
      button.disabled = false;
      return;
    }
    if (audit.running) {
      box.className = 'audit running';
      status.textContent = 'verifying…';
      button.disabled = true;
      return;
    }
    button.disabled = false;
    box.className = 'audit ' + (audit.ok ? 'ok' : 'fail');
    status.textContent = audit.error ? audit.error
      : audit.ok ? 'passed (' + fmt(audit.events) + ' records, ' + seconds(audit.seconds) + ')'
        : 'FAILED: ' + audit.first_failure;
    checks.replaceChildren(
      ...(audit.checks || []).map((c) => el('li', {
        text: (c.skipped ? 'skipped ' : c.ok ? 'ok ' : 'FAILED ') + c.name + ': ' + c.detail})),
      ...(audit.scope ? [el('li', {text: 'scope: ' + audit.scope})] : []),
      ...(audit.ok && audit.anchor ? [el('li', {text: 'anchor: ' + audit.anchor +
        ' (keep it apart from the log: `stagetree replay verify --anchor` proves later that the log still holds it)'})]
        : []));
  }

  // ---------------------------------------------------------------- the trial table

  function columns(view) {
    const names = [...new Set(view.trials.flatMap((t) => Object.keys(t.hp)))].sort();
    return [
      {key: 'id', label: 'trial', get: (t) => t.id},
      {key: 'status', label: 'status', get: (t) => t.status},
      {key: 'decision', label: 'final decision', get: (t) => t.decision},
      {key: 'steps', label: 'steps', get: (t) => t.steps, num: true},
      {key: 'trained', label: 'steps with metrics', get: (t) => t.trained, num: true},
      {key: 'metric', label: view.curves.metric || 'metric', get: (t) => t.metric, num: true, digits: 4},
      ...names.map((n) => ({key: 'hp:' + n, label: n, get: (t) => t.hp[n] || '', hp: true})),
    ];
  }

  function renderTable(view) {
    const cols = columns(view);
    if (!ui.sort || !cols.some((c) => c.key === ui.sort.key)) {
      ui.sort = {key: 'metric', dir: view.curves.mode === 'min' ? 1 : -1};
    }
    const col = cols.find((c) => c.key === ui.sort.key);
    const rows = [...view.trials].sort((a, b) => {
      const x = col.get(a);
      const y = col.get(b);
      if (x === y) return a.id < b.id ? -1 : 1;
      if (x === null || x === '') return 1;  // missing values last either way
      if (y === null || y === '') return -1;
      return (x < y ? -1 : 1) * ui.sort.dir;
    });
    const head = $('trials-table').tHead.rows[0];
    head.replaceChildren(...cols.map((c) => {
      const th = el('th', {'data-col': c.key, scope: 'col', text: c.label,
                           'aria-sort': c.key === ui.sort.key ? (ui.sort.dir > 0 ? 'ascending' : 'descending') : null});
      th.addEventListener('click', () => {
        ui.sort = {key: c.key, dir: ui.sort.key === c.key ? -ui.sort.dir : (c.num ? -1 : 1)};
        renderTable(ui.payload.view);
      });
      return th;
    }));
    const body = $('trials-table').tBodies[0];
    body.replaceChildren(...rows.map((t) => {
      const tr = el('tr', {'data-trial': t.id, class: [t.best ? 'best' : '', t.id === ui.selected ? 'selected' : '']
        .join(' ').trim() || null});
      for (const c of cols) {
        const v = c.get(t);
        const cls = c.num ? 'num' : c.hp ? 'hp' : c.key === 'status' ? 'status-' + t.status : null;
        tr.append(el('td', {class: cls, 'data-col': c.key,
                            text: c.num ? fmt(v, c.digits) : (c.key === 'status' && t.error ? v + ': ' + t.error
                              : v === '' && c.key === 'decision' ? '—' : v)}));
      }
      tr.addEventListener('click', () => select(t.id));
      return tr;
    }));
    const f = view.figures;
    $('trials-caption').textContent = fmt(f.trials) + ' trials · click a header to sort, a row to select';
  }

  // ---------------------------------------------------------------- selection

  function select(trialId) {
    ui.selected = ui.selected === trialId ? null : trialId;
    const view = ui.payload && ui.payload.view;
    if (!view) return;
    renderTable(view);
    drawTree(view);
    drawGantt(view);
    drawCurves(view);
    renderSelected(view);
  }

  function bestOf(trialIds, view) {
    if (ui.selected && trialIds.includes(ui.selected)) return ui.selected;
    const sign = view.curves.mode === 'min' ? -1 : 1;
    const byId = new Map(view.trials.map((t) => [t.id, t]));
    let best = null;
    for (const id of trialIds) {
      const t = byId.get(id);
      if (!t) continue;
      if (best === null || (t.metric !== null && (best.metric === null || sign * t.metric > sign * best.metric))) best = t;
    }
    return best ? best.id : null;
  }

  function renderSelected(view) {
    const box = $('selected');
    const t = view.trials.find((x) => x.id === ui.selected);
    if (!t) {
      box.textContent = 'click a trial in the table, a curve, a stage or a worker\u2019s bar';
      return;
    }
    const lines = [
      el('div', {}, el('span', {class: 'id', text: t.id}),
         document.createTextNode(' · ' + t.status + (t.error ? ': ' + t.error : '') +
                                 (t.decision ? ' · ' + t.decision : '') +
                                 ' · ' + fmt(t.trained) + ' of ' + fmt(t.steps) + ' steps · ' +
                                 (view.curves.metric || 'metric') + ' ' + fmt(t.metric))),
      ...Object.entries(t.hp).map(([k, v]) => el('div', {text: k + ' = ' + v})),
      el('div', {text: 'path: ' + t.path.map(([node, a, b]) => node + ' [' + a + ', ' + b + ')').join(' → ')}),
    ];
    box.replaceChildren(...lines);
  }

  function onClick(div, pick) {
    if (div.dataset.clicks) return;
    div.dataset.clicks = '1';
    div.on('plotly_click', (event) => {
      const point = event.points && event.points[0];
      if (!point || point.customdata === undefined) return;
      const trial = pick(point.customdata);
      if (trial) select(trial);
    });
  }

  // ---------------------------------------------------------------- the stage tree

  function drawTree(view) {
    const stages = view.tree;
    const div = $('tree');
    const maxStep = Math.max(1, ...stages.map((s) => s.to));
    const sel = ui.selected;
    const onPath = (s) => sel !== null && s.trials.includes(sel);
    const color = (s) => (s.running ? COLORS.running : s.shared ? COLORS.shared : COLORS.unique);
    const hover = (s) => plotText(s.label + ' · steps [' + s.from + ', ' + s.to + ')') + '<br>' +
      (s.running ? 'running' : s.shared ? 'shared by ' + s.trials.length + ' trials' : 'one trial') +
      (s.executions > 1 ? ' · trained ' + s.executions + '×' : '') + '<br>' +
      plotText(s.trials.slice(0, 12).join(', ') + (s.trials.length > 12 ? ', …' : ''));
    const bars = {
      type: 'bar', orientation: 'h', name: 'stages', showlegend: false,
      y: stages.map((s) => s.row), base: stages.map((s) => s.from),
      x: stages.map((s) => Math.max(s.to - s.from, maxStep * 0.004)),
      customdata: stages.map((s) => s.row),
      hovertext: stages.map(hover), hoverinfo: 'text',
      marker: {
        color: stages.map(color),
        opacity: stages.map((s) => (sel === null || onPath(s) ? 1 : 0.25)),
        line: {color: stages.map((s) => (onPath(s) ? COLORS.selected : '#ffffff')),
               width: stages.map((s) => (onPath(s) ? 2.5 : 0.5))},
        pattern: {shape: stages.map((s) => (s.running ? '/' : ''))},
      },
    };
    const lx = [];
    const ly = [];
    for (const s of stages) {
      if (s.parent === null) continue;
      const p = stages[s.parent];
      lx.push(p.to < s.from ? p.to : s.from, s.from, s.from, null);
      ly.push(p.row, p.row, s.row, null);
    }
    const height = Math.min(1200, Math.max(320, 90 + 16 * stages.length));
    if (div.style.height !== height + 'px') div.style.height = height + 'px';
    const links = {type: 'scatter', mode: 'lines', x: lx, y: ly, hoverinfo: 'skip', showlegend: false,
                   line: {color: '#8a8a8a', width: 1}};
    const legend = [['shared (2+ trials)', COLORS.shared], ['one trial', COLORS.unique], ['running', COLORS.running]]
      .map(([name, c]) => ({type: 'bar', x: [null], y: [null], name, marker: {color: c}, hoverinfo: 'skip'}));
    Plotly.react(div, [links, bars, ...legend], {
      uirevision: view.study.id, height, margin: {l: 110, r: 20, t: 10, b: 40}, barmode: 'overlay', bargap: 0.25,
      xaxis: {title: {text: 'step'}, rangemode: 'tozero', zeroline: false},
      yaxis: {autorange: 'reversed', tickvals: stages.map((s) => s.row),
              ticktext: stages.map((s) => plotText(s.label + ' [' + s.from + ',' + s.to + ')')),
              tickfont: {size: stages.length > 40 ? 8 : 10}},
      ...LAYOUT,
    }, PLOT_CONFIG);
    onClick(div, (row) => {
      const stage = ui.payload.view.tree[row];
      return stage ? bestOf(stage.trials, ui.payload.view) : null;
    });
    const shared = stages.filter((s) => s.shared).length;
    const running = stages.filter((s) => s.running).length;
    $('tree-caption').textContent = stages.length + ' stages, ' + shared + ' shared, ' + running + ' running' +
      (sel ? ' · the selected trial\u2019s path outlined' : '');
  }

  // ---------------------------------------------------------------- the workers' timeline

  function drawGantt(view) {
    const runs = view.gantt;
    const div = $('gantt');
    const sel = ui.selected;
    const kinds = [
      ['shared stage', (r) => r.status === 'finished' && r.shared, COLORS.shared, ''],
      ['one trial', (r) => r.status === 'finished' && !r.shared, COLORS.unique, ''],
      ['running', (r) => r.status === 'running', COLORS.running, '/'],
      ['stopped (preempted)', (r) => r.status === 'stopped' || r.status === 'preempted', COLORS.stop, '.'],
      ['failed', (r) => r.status === 'failed', COLORS.failed, ''],
      ['lost', (r) => r.status === 'lost', COLORS.lost, 'x'],
    ];
    const traces = kinds.map(([name, test, color, shape]) => {
      const idx = runs.map((r, i) => [r, i]).filter(([r]) => test(r));
      return {
        type: 'bar', orientation: 'h', name, showlegend: idx.length > 0,
        y: idx.map(([r]) => plotText(r.worker)), base: idx.map(([r]) => r.start),
        x: idx.map(([r]) => Math.max(r.end - r.start, 0.001)), customdata: idx.map(([, i]) => i),
        hovertext: idx.map(([r]) => plotText(r.worker + ': ' + r.label + ' [' + r.from + ', ' + r.to + ') · ' + r.status +
          (r.stopped_at !== null && r.stopped_at !== undefined ? ' at step ' + r.stopped_at : '')) +
          '<br>' + (r.end - r.start).toFixed(2) + ' s from ' + r.start.toFixed(2) + ' s<br>' +
          plotText(r.trials.length + ' trial(s)' + (r.trials.length ? ': ' + r.trials.slice(0, 8).join(', ') : ''))),
        hoverinfo: 'text',
        marker: {color, pattern: {shape},
                 opacity: idx.map(([r]) => (sel === null || r.trials.includes(sel) ? 1 : 0.3)),
                 line: {color: idx.map(([r]) => (sel !== null && r.trials.includes(sel) ? COLORS.selected : '#ffffff')),
                        width: idx.map(([r]) => (sel !== null && r.trials.includes(sel) ? 2 : 0.5))}},
      };
    });
    const workers = [...new Set(runs.map((r) => r.worker))].sort(
      (a, b) => a.localeCompare(b, 'en', {numeric: true}));
    Plotly.react(div, traces, {
      uirevision: view.study.id, barmode: 'overlay', bargap: 0.35, margin: {l: 60, r: 20, t: 10, b: 40},
      xaxis: {title: {text: view.study.simulated ? 'virtual seconds since the first event' : 'seconds since the first event'},
              rangemode: 'tozero'},
      yaxis: {type: 'category', categoryorder: 'array', categoryarray: workers.map(plotText), autorange: 'reversed'},
      ...LAYOUT,
    }, PLOT_CONFIG);
    onClick(div, (i) => {
      const run = ui.payload.view.gantt[i];
      return run ? bestOf(run.trials, ui.payload.view) : null;
    });
    const running = runs.filter((r) => r.status === 'running').length;
    $('gantt-caption').textContent = runs.length + ' stage runs on ' + workers.length + ' workers' +
      (running ? ', ' + running + ' running' : '');
  }

  // ---------------------------------------------------------------- learning curves

  function drawCurves(view) {
    const curves = view.curves;
    const div = $('curves');
    const sel = ui.selected;
    const traces = [];
    const drawn = curves.trials.filter((t) => t.steps.length);
    drawn.forEach((t, i) => {
      const isBest = t.id === curves.best;
      const isSel = t.id === sel;
      traces.push({
        type: 'scatter', mode: 'lines+markers', x: t.steps, y: t.values,
        name: plotText((isBest ? 'best ' : '') + t.id), showlegend: isBest,
        customdata: t.steps.map(() => t.id),
        hovertext: t.steps.map((s, j) => plotText(t.id + ' · step ' + s + ' · ' + curves.metric + ' = ' + fmt(t.values[j]))),
        hoverinfo: 'text',
        line: {width: isSel || isBest ? 3 : 1.2, color: isSel ? COLORS.selected : isBest ? COLORS.best : PALETTE[i % PALETTE.length]},
        marker: {size: isSel || isBest ? 7 : 4},
        opacity: sel === null ? (isBest ? 1 : 0.6) : (isSel ? 1 : isBest ? 0.7 : 0.15),
      });
    });
    for (const [kind, name, symbol, color] of [['promote', 'promoted', 'triangle-up', COLORS.promote],
                                               ['stop', 'stopped', 'x', COLORS.stop]]) {
      const marks = curves.marks.filter((m) => m.kind === kind);
      traces.push({
        type: 'scatter', mode: 'markers', name, showlegend: marks.length > 0,
        x: marks.map((m) => m.step), y: marks.map((m) => m.value), customdata: marks.map((m) => m.trial),
        hovertext: marks.map((m) => plotText(m.trial + ': ' + (kind === 'promote'
          ? 'promoted at step ' + m.step + ' to ' + m.to_steps + ' steps' : 'stopped at step ' + m.step))),
        hoverinfo: 'text', marker: {symbol, size: 11, color, line: {width: 1, color: '#ffffff'}},
      });
    }
    const steps = [...new Set(drawn.flatMap((t) => t.steps))].sort((a, b) => a - b);
    const logScale = steps.length >= 3 && steps[0] > 0 && steps[steps.length - 1] / steps[0] >= 16;
    Plotly.react(div, traces, {
      uirevision: view.study.id, margin: {l: 60, r: 20, t: 10, b: 40}, hovermode: 'closest',
      xaxis: {title: {text: logScale ? 'step (log scale)' : 'step'}, type: logScale ? 'log' : 'linear',
              ...(logScale ? {tickmode: 'array', tickvals: steps.length <= 12 ? steps
                : steps.filter((_, i) => i % Math.ceil(steps.length / 12) === 0), ticktext: undefined} : {})},
      yaxis: {title: {text: plotText(curves.metric || '')}},
      ...LAYOUT,
    }, PLOT_CONFIG);
    onClick(div, (id) => id);
    $('curves-caption').textContent = (curves.metric ? curves.metric + ' (' + curves.mode + ' is better) of ' : '') +
      drawn.length + ' trials';
  }

  // ---------------------------------------------------------------- start

  function start() {
    $('study-select').addEventListener('change', (event) => {
      ui.study = event.target.value;
      ui.selected = null;
      ui.sort = null;
      const url = new URL(window.location.href);
      url.searchParams.set('study', ui.study);
      window.history.replaceState(null, '', url);
      connect();
    });
    $('verify-button').addEventListener('click', async () => {
      $('verify-button').disabled = true;
      try {
        const response = await fetch('/api/verify', {method: 'POST', headers: {'X-Stagetree-Request': 'verify'}});
        renderAudit(await response.json());
      } catch (err) {
        renderAudit({ok: false, error: 'verify could not be reached: ' + err});
      }
    });
    connect();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
