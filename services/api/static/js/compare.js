// Compare page: one chart per metric, one line per run (e.g. GTR against RL4VLM on a task).
(() => {
  const {GROUPS, COLORS, plot, keys, fetchUpdates, resizeOnWindow, pointsFor} = gtr.charts;
  const root = document.getElementById('compare-charts');
  const runs = JSON.parse(root.dataset.runs || '[]');
  const METRICS = GROUPS.flatMap(g => g.keys.map(k => ({key: k, unit: g.unit, collapse: g.collapse})));
  let charts = [];

  function aligned(perRun, key) {
    // One shared x axis: the union of update indices; a run without that update draws a gap.
    const xs = [...new Set(perRun.flatMap(us => us.map(u => u.idx)))].sort((a, b) => a - b);
    const series = perRun.map((us) => {
      const byIdx = new Map(us.map(u => [u.idx, u.metrics[key]]));
      return xs.map(x => (typeof byIdx.get(x) === 'number' ? byIdx.get(x) : null));
    });
    return [xs, ...series];
  }

  async function load() {
    const perRun = await Promise.all(runs.map(r => fetchUpdates(r.id)));
    const present = keys(perRun.flat());
    const labels = runs.map(r => `#${r.id} ${r.name}`);
    root.replaceChildren();
    charts = METRICS.filter(m => present.has(m.key)).map((m) => {
      const box = gtr.el('div', {class: 'chart' + (m.collapse ? ' collapse-chart' : ''), 'data-title': m.key});
      root.append(box);
      const data = aligned(perRun, m.key);  // a run with one update still shows its dot
      return {box, plot: plot(box, {title: m.key, labels, unit: m.unit, points: pointsFor(data)}, data)};
    });
    if (!charts.length) root.replaceChildren(gtr.el('p', {class: 'muted empty'}, 'None of these runs has recorded an update yet.'));
    root.dataset.charts = String(charts.length);
  }

  document.querySelectorAll('.swatch').forEach((el, i) => { el.style.background = COLORS[i % COLORS.length]; });
  resizeOnWindow(() => charts);
  load().catch(err => root.replaceChildren(gtr.el('p', {class: 'error'}, `Could not load the curves: ${err.message}`)));
})();
