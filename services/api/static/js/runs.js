// Runs list: fill the launch form from a preset or a file, and refresh live runs in place.
(() => {
  const text = document.getElementById('config');
  const presets = JSON.parse(text?.dataset.presets || '{}');
  document.getElementById('preset')?.addEventListener('change', (e) => {
    if (presets[e.target.value]) text.value = presets[e.target.value];
  });
  document.getElementById('config-file')?.addEventListener('change', async (e) => {
    const file = e.target.files[0];
    if (file) text.value = await file.text();
  });

  const TERMINAL = ['completed', 'degraded', 'failed', 'cancelled', 'superseded'];
  const table = document.getElementById('runs-table');

  function update(row, run) {
    const status = row.querySelector('[data-field=status] .status');
    status.textContent = run.status; status.className = `status status-${run.status}`;
    const pct = run.num_updates ? 100 * run.updates_done / run.num_updates : 0;
    row.querySelector('.progress .bar').style.width = `${pct.toFixed(1)}%`;
    row.querySelector('.progress span').textContent = `${run.updates_done}/${run.num_updates}`;
    row.querySelector('[data-field=success]').textContent = gtr.pct(run.latest_metrics.success_rate);
    row.querySelector('[data-field=eval]').textContent = gtr.pct(run.latest_metrics['eval/success_rate']);
    row.querySelector('[data-field=phase]').textContent = gtr.phaseText(run);
    row.querySelector('[data-field=timing]').textContent = gtr.timingText(run);
    row.classList.toggle('alarmed', run.alarm);
    row.querySelector('[data-field=alarm]').replaceChildren(run.alarm ? gtr.el('span', {class: 'alarm'}, '⚠ collapse') : '');
  }

  // One request per refresh: the same page of the list the server rendered.
  async function refresh() {
    const live = () => [...table.querySelectorAll('tr[data-run-id]')]
      .filter(r => !TERMINAL.includes(r.querySelector('[data-field=status] .status').textContent));
    if (!live().length) return;
    try {
      const query = new URLSearchParams({limit: '50', offset: table.dataset.offset});
      if (table.dataset.status) query.set('status', table.dataset.status);
      const page = await gtr.api(`/api/runs?${query}`);
      const byId = new Map(page.items.map(r => [String(r.id), r]));
      for (const row of live()) if (byId.has(row.dataset.runId)) update(row, byId.get(row.dataset.runId));
    } catch (err) { console.warn('refresh failed', err); }
    setTimeout(refresh, REFRESH_MS);
  }
  const REFRESH_MS = 5000;
  setTimeout(refresh, REFRESH_MS);
})();
