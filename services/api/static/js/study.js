// Study page: per metric, one chart with each arm's mean curve over seeds and its 95 % band
// (uPlot bands between the band's high and low series), in charts.js's look; beside the primary
// metric's, each arm's change from its seeds' own starts (the report's change curves).
(() => {
  const {COLORS, HEIGHT, ticks, resizeOnWindow} = gtr.charts;
  const charts = [];

  function rgba(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
  }

  // [xs, mean_1, high_1, low_1, mean_2, ...] on the union of the arms' updates (gaps as null).
  function aligned(curves) {
    const xs = [...new Set(curves.flatMap(c => c.points.map(p => p.update)))].sort((a, b) => a - b);
    const data = [xs];
    for (const c of curves) {
      const at = new Map(c.points.map(p => [p.update, p]));
      for (const key of ['mean', 'high', 'low']) data.push(xs.map(x => (at.has(x) && at.get(x)[key] !== null ? at.get(x)[key] : null)));
    }
    return data;
  }

  function chart(box, title, curves, unit) {
    const series = [{label: 'update'}], bands = [];
    curves.forEach((c, i) => {
      const color = COLORS[i % COLORS.length], base = 1 + 3 * i;
      series.push({label: c.arm, stroke: color, width: 2, spanGaps: true, points: {show: true, size: 6}});
      series.push({label: `${c.arm} · 95 % high`, stroke: rgba(color, 0.35), width: 1, spanGaps: true, points: {show: false}});
      series.push({label: `${c.arm} · 95 % low`, stroke: rgba(color, 0.35), width: 1, spanGaps: true, points: {show: false}});
      bands.push({series: [base + 1, base + 2], fill: rgba(color, 0.15)});
    });
    const data = aligned(curves), xs = data[0];
    const x = xs.length === 1 ? {time: false, range: [xs[0] - 1, xs[0] + 1]} : {time: false};  // one update: a narrow axis
    const opts = {
      title, width: box.clientWidth || 420, height: HEIGHT, series, bands,
      scales: {x, y: unit ? {range: [0, 1]} : {}},
      axes: [{label: 'update', size: 36, labelSize: 14}, {size: 54, values: (u, splits) => ticks(splits)}],
    };
    return new uPlot(opts, data, box);
  }

  // The curves come after the page (its tables and verdicts are the answer; the curves are
  // the largest part of the report): /studies/ID/curves.json.
  function draw(groups) {
  document.querySelectorAll('.study-charts').forEach((root) => {
    const g = groups[Number(root.dataset.group)];
    root.replaceChildren();
    for (const m of g.metrics) {
      const curves = g.curves.filter(c => c.metric === m.metric && c.points.length);
      if (!curves.length) continue;
      const role = m.role === 'primary' ? 'primary' : 'secondary';
      const box = gtr.el('div', {class: `chart study-chart ${role}`, 'data-metric': m.metric, 'data-role': m.role});
      root.append(box);
      const unit = curves.every(c => c.points.every(p => p.mean >= 0 && p.mean <= 1 && (p.low === null || p.low >= 0) && (p.high === null || p.high <= 1)));
      charts.push({box, plot: chart(box, `${role}: ${m.label}`, curves, unit)});
      const change = (g.change_curves || []).filter(c => c.metric === m.metric && c.points.length);
      if (m.role === 'primary' && change.length) {  // each seed's curve less its own start
        const from = gtr.el('div', {class: 'chart study-chart change', 'data-metric': m.metric, 'data-role': 'change'});
        root.append(from);
        charts.push({box: from, plot: chart(from, `change from each seed's start: ${m.label}`, change, false)});
      }
    }
    if (!root.children.length) root.append(gtr.el('p', {class: 'muted empty'}, 'No run of this task has recorded an update yet.'));
    root.dataset.charts = String(root.querySelectorAll('.study-chart').length);
  });
  }

  // A chart drawn inside a folded section has no width yet: redraw it at its box's width once
  // the section opens.
  document.querySelectorAll('details.curves-fold').forEach((d) => d.addEventListener('toggle', () => {
    if (d.open) charts.filter(c => d.contains(c.box)).forEach(c => c.plot.setSize({width: c.box.clientWidth || 420, height: HEIGHT}));
  }));
  const url = document.getElementById('study-curves').dataset.url;
  fetch(url, {credentials: 'same-origin', headers: {Accept: 'application/json'}})
    .then((res) => { if (!res.ok) throw new Error(res.statusText || String(res.status)); return res.json(); })
    .then(draw)
    .catch(err => document.querySelectorAll('.study-charts').forEach(r => r.replaceChildren(gtr.el('p', {class: 'error'}, `Could not load the curves: ${err.message}`))));
  resizeOnWindow(() => charts);
})();
