// Run page: learning curves and collapse monitors, polled while the run is live.
(() => {
  const {GROUPS, plot, keys, alarmHook, thresholdHook, fetchUpdates, resizeOnWindow} = gtr.charts;
  const root = document.getElementById('charts');
  const runId = root.dataset.runId;
  const POLL_MS = 5000;
  const updates = [];
  let charts = [];
  let layoutKey = '';

  function groupsWithData() {
    const seen = keys(updates);
    const known = new Set(GROUPS.flatMap(g => g.keys));
    const groups = GROUPS.map(g => ({...g, keys: g.keys.filter(k => seen.has(k))})).filter(g => g.keys.length);
    // Metrics a newer trainer adds still get drawn, one chart each.
    for (const k of [...seen].filter(k => !known.has(k)).sort()) groups.push({title: k, keys: [k]});
    return groups;
  }

  function data(group) {
    return [updates.map(u => u.idx), ...group.keys.map(k => updates.map(u => (typeof u.metrics[k] === 'number' ? u.metrics[k] : null)))];
  }

  function build() {
    const groups = groupsWithData();
    const key = groups.map(g => g.title + g.keys.join()).join('|');
    if (key === layoutKey) { charts.forEach(c => c.plot.setData(data(c.group))); return; }
    layoutKey = key;
    charts.forEach(c => c.plot.destroy());
    root.replaceChildren();
    charts = groups.map((group) => {
      const box = gtr.el('div', {class: 'chart' + (group.collapse ? ' collapse-chart' : ''), 'data-title': group.title});
      root.append(box);
      const hooks = {drawClear: [alarmHook(() => updates)]};
      if (group.threshold) hooks.draw = [thresholdHook(parseFloat(root.dataset[group.threshold]))];
      const opts = {title: group.title, labels: group.keys, unit: group.unit, hooks, points: updates.length < 60};
      return {group, box, plot: plot(box, opts, data(group))};
    });
  }

  function render() {
    if (!updates.length) {
      root.replaceChildren(gtr.el('p', {class: 'muted empty', id: 'charts-empty'}, 'No update recorded yet: curves appear after the first PPO update.'));
      return;
    }
    build();
    root.dataset.points = String(updates.length);
  }

  function setStatus(run) {
    const badge = document.querySelector('#run-status .status');
    if (badge) { badge.textContent = run.status; badge.className = `status status-${run.status}`; }
    const pct = run.num_updates ? 100 * run.updates_done / run.num_updates : 0;
    document.querySelector('#progress-block .progress .bar').style.width = `${pct.toFixed(1)}%`;
    document.querySelector('#progress-block .progress span').textContent = `${run.updates_done}/${run.num_updates}`;
    for (const el of document.querySelectorAll('[data-metric]')) {
      const m = run.latest_metrics, v = m[el.dataset.metric];
      el.textContent = /rate|share/.test(el.dataset.metric) ? gtr.pct(v) : gtr.num(v, el.dataset.metric === 'thought_length' ? 1 : 2);
      // No episode ended yet: say so rather than show no success rate.
      if (el.dataset.metric === 'success_rate' && v === undefined && m.episodes_started) {
        el.textContent = `${m.episodes_finished || 0} of ${m.episodes_started} finished`;
      }
    }
    document.getElementById('alarm-banner').hidden = !run.alarm;
    if (run.latest_metrics.alarm_reason) document.getElementById('alarm-reason').textContent = run.latest_metrics.alarm_reason;
  }

  async function poll() {
    const state = document.getElementById('poll-state');
    try {
      const run = await gtr.api(`/api/runs/${runId}`);
      updates.push(...await fetchUpdates(runId, updates.length));
      setStatus(run);
      render();
      const live = !['completed', 'failed', 'cancelled'].includes(run.status);
      state.textContent = live ? `live · refreshed ${new Date().toLocaleTimeString()}` : `${updates.length} updates`;
      if (live) setTimeout(poll, POLL_MS);
    } catch (err) {
      state.textContent = `refresh failed (${err.message}); retrying`;
      setTimeout(poll, POLL_MS * 2);
    }
  }

  resizeOnWindow(() => charts);
  poll();
})();
