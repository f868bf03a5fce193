// Run page: curves grouped by family (collapsible), smoothing and an x-axis switch; a click on a
// point opens that update's steps. While the run is live it converges to what a reload shows:
// update rows are read again until they are final (the API serves an update's row before its
// training and evaluation metrics), and the server-rendered parts (status, actions, notices,
// stat cards, checkpoints: every [data-live] element) are swapped for the page's current ones.
(() => {
  const C = gtr.charts;
  const root = document.getElementById('charts');
  const runId = root.dataset.runId;
  const ctx = {probeStates: parseFloat(root.dataset.probeStates) || 0};
  const envSteps = (parseInt(root.dataset.envs, 10) || 1) * (parseInt(root.dataset.steps, 10) || 1);
  const xSelect = document.getElementById('chart-x'), smoothInput = document.getElementById('chart-smooth');
  const POLL_MS = 3000;
  const TERMINAL = ['completed', 'degraded', 'failed', 'cancelled', 'superseded'];
  const updates = [];
  let counted = [];  // the updates the run counts done: what the progress bar counts, drawn
  let stable = 0;  // updates[0, stable) are final: recorded in full, or the run has ended
  const closed = new Set(['Other']);  // families folded by the reader (Other starts folded)
  let charts = [];
  let layoutKey = '';

  const X = {
    update: {label: 'update', of: u => u.idx},
    env_steps: {label: 'env steps', of: u => (u.idx + 1) * envSteps},
    wall: {label: 'wall time (min)', of: u => (Date.parse(u.created_at) - Date.parse(counted[0].created_at)) / 60000, real: true},
  };

  function data(group) {
    const x = X[xSelect.value] || X.update, alpha = parseFloat(smoothInput.value) || 0;
    return [counted.map(x.of), ...group.keys.map(k => C.smooth(counted.map(u => C.value(u, k, ctx)), alpha))];
  }

  // The step search for the update under the cursor, filtered by what the chart shows.
  function openSteps(group, plot) {
    const i = plot.cursor.idx;
    if (i === null || i === undefined || !counted[i]) return;
    const q = new URLSearchParams({update: String(counted[i].idx), ...(group.steps || {})});
    location.href = `/runs/${runId}/steps?${q}`;
  }

  // Points drawn per chart (non-null values of all its series): what a reload would draw.
  function drawn(d) { return d.slice(1).reduce((n, ys) => n + ys.filter(y => y !== null).length, 0); }

  function build() {
    const groups = C.groups(counted);
    const key = xSelect.value + '|' + groups.map(g => g.title + g.keys.join()).join('|');
    if (key === layoutKey) {
      charts.forEach((c) => {
        const d = data(c.group);
        c.plot.setData(d);
        c.box.dataset.n = String(drawn(d));
        if (c.rule) c.rule.textContent = C.ruleText(c.group, counted, root.dataset);
      });
      return;
    }
    layoutKey = key;
    charts.forEach(c => c.plot.destroy());
    root.replaceChildren();
    charts = [];
    const x = X[xSelect.value] || X.update;
    for (const family of C.FAMILIES) {
      const inFamily = groups.filter(g => g.family === family);
      if (!inFamily.length) continue;
      const grid = gtr.el('div', {class: 'charts'});
      const section = gtr.el('details', {class: 'family', 'data-family': family, open: !closed.has(family)},
        gtr.el('summary', {}, `${family} (${inFamily.length})`), grid);
      section.addEventListener('toggle', () => { if (section.open) closed.delete(family); else closed.add(family); });
      root.append(section);
      for (const group of inFamily) {
        const box = gtr.el('div', {class: 'chart' + (group.collapse ? ' collapse-chart' : ''), 'data-title': group.title});
        grid.append(box);
        const hooks = {drawClear: [C.alarmHook(() => counted)]};
        if (group.threshold) hooks.draw = [C.thresholdHook(parseFloat(root.dataset[group.threshold]))];
        const d = data(group);
        const opts = {title: group.title, labels: group.keys, unit: group.unit, hooks, points: C.pointsFor(d), xLabel: x.label, intX: !x.real};
        const plot = C.plot(box, opts, d);
        box.dataset.n = String(drawn(d));
        if (group.steps && !('imported' in root.dataset)) {  // an imported run has no steps here
          plot.over.classList.add('clickable');
          plot.over.title = 'click: open this update\'s steps';
          plot.over.addEventListener('click', () => openSteps(group, plot));
        }
        // A dashed alarm line the run stayed under with no alarm needs its rule said.
        const rule = group.threshold ? gtr.el('p', {class: 'small muted alarm-rule'}, C.ruleText(group, counted, root.dataset)) : null;
        if (rule) box.append(rule);
        charts.push({group, box, plot, rule});
      }
    }
  }

  function render() {
    if (!counted.length) {
      root.replaceChildren(gtr.el('p', {class: 'muted empty', id: 'charts-empty'}, 'No update recorded yet: curves appear after the first PPO update.'));
      layoutKey = '';
      charts = [];
    } else build();
    root.dataset.points = String(counted.length);
  }

  // Rows past `stable` are read again: a row is final once the run counts it done and none of
  // its corrections is still pending (a late one rewrites its update's figures), or the run ended.
  async function refreshUpdates(run) {
    const fresh = await C.fetchUpdates(runId, stable);
    updates.splice(stable, updates.length - stable, ...fresh);
    const ended = TERMINAL.includes(run.status);
    const final = u => ended || (u.idx < run.updates_done && !(u.metrics.corrections_pending > 0));
    while (stable < updates.length && final(updates[stable])) stable += 1;
  }

  // An update's row appears after its rollout, before its training: the charts draw the
  // updates the progress bar counts (n of N, from the same rendering), so the two agree while
  // an update is half done.
  function countDone() {
    const done = Number(document.getElementById('progress-block')?.dataset.updatesDone || 0);
    counted = updates.filter(u => u.idx < done);
  }

  // The server's own rendering of the live parts: the same template a reload renders.
  async function refreshParts() {
    const res = await fetch(location.pathname, {credentials: 'same-origin', headers: {Accept: 'text/html'}});
    if (res.redirected && new URL(res.url).pathname === '/login') { location.href = res.url; return; }
    if (!res.ok) throw new Error(res.statusText || String(res.status));
    const doc = new DOMParser().parseFromString(await res.text(), 'text/html');
    for (const el of document.querySelectorAll('[data-live]')) {
      const fresh = doc.getElementById(el.id);
      if (fresh && fresh.outerHTML !== el.outerHTML) el.replaceWith(document.importNode(fresh, true));
    }
  }

  async function poll() {
    const state = document.getElementById('poll-state');
    try {
      const run = await gtr.api(`/api/runs/${runId}`);  // first: what it counts done is final below
      await refreshUpdates(run);
      await refreshParts();
      countDone();
      render();
      const live = !TERMINAL.includes(run.status);
      const n = counted.length;
      state.textContent = live ? `live · refreshed ${new Date().toLocaleTimeString()}` : `${n} update${n === 1 ? '' : 's'}`;
      root.dataset.state = live ? 'live' : 'final';
      if (live) setTimeout(poll, POLL_MS);
    } catch (err) {
      state.textContent = `refresh failed (${err.message}); retrying`;
      setTimeout(poll, POLL_MS * 2);
    }
  }

  xSelect.addEventListener('change', () => { layoutKey = ''; render(); });
  smoothInput.addEventListener('input', () => render());
  C.resizeOnWindow(() => charts);
  poll();
})();
