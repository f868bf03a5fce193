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

  // While a run on the page is live, the page's own rows are read again (the same address:
  // the same filters, order and page) and swapped in, as a reload would show them.
  async function refresh() {
    const live = [...table.querySelectorAll('tr[data-run-id] [data-field=status] .status, tr.study-row .status-running, tr.study-row .status-queued')]
      .filter(s => !TERMINAL.includes(s.textContent));
    if (!live.length) return;
    try {
      const res = await fetch(location.href, {credentials: 'same-origin', headers: {Accept: 'text/html'}});
      if (res.ok && !res.redirected) {
        const doc = new DOMParser().parseFromString(await res.text(), 'text/html');
        const fresh = doc.querySelector('#runs-table tbody');
        const picked = new Set([...table.querySelectorAll('input[name=runs]:checked')].map(i => i.value));
        if (fresh) {
          table.tBodies[0].replaceWith(document.importNode(fresh, true));
          table.querySelectorAll('input[name=runs]').forEach((i) => { i.checked = picked.has(i.value); });
        }
      }
    } catch (err) { console.warn('refresh failed', err); }
    setTimeout(refresh, REFRESH_MS);
  }
  const REFRESH_MS = 5000;
  setTimeout(refresh, REFRESH_MS);
})();
