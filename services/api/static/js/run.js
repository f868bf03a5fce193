// Run page: curves grouped by family (collapsible), smoothing and an x-axis switch; a click on a
// point opens that update's steps; status, phase and stat cards polled while the run is live.
(() => {
  const C = gtr.charts;
  const root = document.getElementById('charts');
  const runId = root.dataset.runId;
  const ctx = {probeStates: parseFloat(root.dataset.probeStates) || 0};
  const envSteps = (parseInt(root.dataset.envs, 10) || 1) * (parseInt(root.dataset.steps, 10) || 1);
  const xSelect = document.getElementById('chart-x'), smoothInput = document.getElementById('chart-smooth');
  const POLL_MS = 3000;
  const updates = [];
  const closed = new Set(['Other']);  // families folded by the reader (Other starts folded)
  let charts = [];
  let layoutKey = '';

  const X = {
    update: {label: 'update', of: u => u.idx},
    env_steps: {label: 'env steps', of: u => (u.idx + 1) * envSteps},
    wall: {label: 'wall time (min)', of: u => (Date.parse(u.created_at) - Date.parse(updates[0].created_at)) / 60000},
  };

  function data(group) {
    const x = X[xSelect.value] || X.update, alpha = parseFloat(smoothInput.value) || 0;
    return [updates.map(x.of), ...group.keys.map(k => C.smooth(updates.map(u => C.value(u, k, ctx)), alpha))];
  }

  // The step search for the update under the cursor, filtered by what the chart shows.
  function openSteps(group, plot) {
    const i = plot.cursor.idx;
    if (i === null || i === undefined || !updates[i]) return;
    const q = new URLSearchParams({update: String(updates[i].idx), ...(group.steps || {})});
    location.href = `/runs/${runId}/steps?${q}`;
  }

  function build() {
    const groups = C.groups(updates);
    const key = xSelect.value + '|' + groups.map(g => g.title + g.keys.join()).join('|');
    if (key === layoutKey) { charts.forEach(c => c.plot.setData(data(c.group))); return; }
    layoutKey = key;
    charts.forEach(c => c.plot.destroy());
    root.replaceChildren();
    charts = [];
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
        const hooks = {drawClear: [C.alarmHook(() => updates)]};
        if (group.threshold) hooks.draw = [C.thresholdHook(parseFloat(root.dataset[group.threshold]))];
        const d = data(group);
        const opts = {title: group.title, labels: group.keys, unit: group.unit, hooks, points: C.pointsFor(d), xLabel: (X[xSelect.value] || X.update).label};
        const plot = C.plot(box, opts, d);
        if (group.steps) {
          plot.over.classList.add('clickable');
          plot.over.title = 'click: open this update\'s steps';
          plot.over.addEventListener('click', () => openSteps(group, plot));
        }
        charts.push({group, box, plot});
      }
    }
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
    document.querySelector('#run-phase [data-field=phase]').textContent = gtr.phaseText(run);
    document.querySelector('#run-phase [data-field=timing]').textContent = gtr.timingText(run);
    const m = run.latest_metrics;
    for (const el of document.querySelectorAll('[data-metric]')) {
      const v = m[el.dataset.metric];
      // No episode ended yet: say so rather than show no success rate.
      if (el.dataset.metric === 'success_rate' && v === undefined && m.episodes_started) {
        el.textContent = `${m.episodes_finished || 0} of ${m.episodes_started} finished`;
        continue;
      }
      if (typeof v !== 'number') continue;  // keep the last value shown until a new one comes
      el.textContent = /rate|share/.test(el.dataset.metric) ? gtr.pct(v) : gtr.num(v, el.dataset.metric === 'thought_length' ? 1 : 2);
    }
    document.getElementById('alarm-banner').hidden = !run.alarm;
    if (run.latest_metrics.alarm_reason) document.getElementById('alarm-reason').textContent = run.latest_metrics.alarm_reason;
    const allFailed = m.corrections > 0 && m.corrections_failed === m.corrections;
    const banner = document.getElementById('corrections-alarm');
    banner.hidden = !allFailed;
    if (allFailed) {
      banner.querySelector('[data-field=corrections]').textContent = String(m.corrections);
      banner.querySelector('[data-field=corrections-failed]').textContent = String(m.corrections_failed);
    }
    const terminal = ['completed', 'failed', 'cancelled'].includes(run.status);
    document.getElementById('cancel-pending').hidden = !(run.cancel_requested && !terminal);
    const cancel = document.getElementById('cancel-run');
    if (cancel && run.cancel_requested) { cancel.disabled = true; cancel.textContent = terminal ? 'Cancelled' : 'Cancel pending…'; }
  }

  async function poll() {
    const state = document.getElementById('poll-state');
    try {
      const run = await gtr.api(`/api/runs/${runId}`);
      updates.push(...await C.fetchUpdates(runId, updates.length));
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

  xSelect.addEventListener('change', () => { layoutKey = ''; render(); });
  smoothInput.addEventListener('input', () => render());
  C.resizeOnWindow(() => charts);
  poll();
})();
