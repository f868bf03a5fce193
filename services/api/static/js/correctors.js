// Corrector registry: list with latency and failure statistics, register, test, delete.
(() => {
  const scope = document.body.dataset.scope;
  const canTest = scope === 'write' || scope === 'admin';
  const tbody = document.getElementById('registered-correctors');
  const errorBox = document.getElementById('correctors-error');
  const {el, pct, num} = gtr;

  function showError(msg) { errorBox.textContent = msg; errorBox.hidden = !msg; }

  async function testCorrector(c, cell) {
    cell.replaceChildren(el('span', {class: 'muted'}, 'testing…'));
    try {
      const r = await gtr.api(`/api/correctors/${c.id}/test`, {method: 'POST', body: JSON.stringify({task: 'numberline'})});
      // What `gtr corrector test` prints: the verdict or the error (a malformed answer's reason),
      // what the server did with structured output level by level, and the raw answer.
      cell.replaceChildren(r.ok
        ? el('span', {class: 'ok'}, `ok · ${r.verdict} · ${Math.round(r.latency_ms)} ms · ${r.tokens} tokens · ${r.attempts} request(s)`)
        : el('span', {class: 'bad'}, `failed after ${Math.round(r.latency_ms)} ms: ${r.error}`));
      if (r.structured) cell.append(el('div', {class: 'small structured'}, r.structured));
      if (r.probe && r.probe.length) {
        cell.append(el('ul', {class: 'small muted probe'}, ...r.probe.map(p =>
          el('li', {'data-level': p.level}, `${p.level} ${p.outcome}${p.reason ? `: ${p.reason}` : ''}`))));
      }
      if (r.raw != null) cell.append(el('details', {class: 'small'}, el('summary', {}, 'raw answer'), el('pre', {class: 'raw'}, r.raw)));
    } catch (err) { cell.replaceChildren(el('span', {class: 'bad'}, err.message)); }
  }

  async function remove(c) {
    if (!confirm(`Delete corrector ${c.name}? Its recorded corrections stay.`)) return;
    try { await gtr.api(`/api/correctors/${c.id}`, {method: 'DELETE'}); load(); } catch (err) { showError(err.message); }
  }

  function row(c, s) {
    const result = el('div', {class: 'test-result'});
    const actions = el('td', {},
      el('button', {type: 'button', disabled: !canTest, title: canTest ? 'send one sample state' : 'needs a write token', onclick: () => testCorrector(c, result)}, 'Test'),
      scope === 'admin' ? el('button', {type: 'button', class: 'danger', onclick: () => remove(c)}, 'Delete') : '',
      result);
    // As the oracle's row: p95 then mean, with the digits a sub-millisecond figure needs.
    const ms = v => (v >= 10 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : String(+v.toPrecision(2)));
    return el('tr', {'data-corrector': c.name},
      el('td', {}, el('b', {}, c.name)), el('td', {}, c.kind), el('td', {}, el('code', {}, c.base_url || '–')),
      el('td', {}, c.model || '–'), el('td', {}, c.api_key_set ? 'stored' : (c.api_key_env ? `$${c.api_key_env}` : '–')),
      el('td', {class: 'num'}, s ? String(s.total) : '–'),
      el('td', {class: 'num' + (s && s.failure_rate > 0.1 ? ' bad' : '')}, s ? pct(s.failure_rate) : '–'),
      el('td', {class: 'num'}, s ? pct(s.incorrect_rate) : '–'),
      el('td', {class: 'num'}, s && s.latency_mean_ms != null ? `${ms(s.latency_p95_ms)} · ${ms(s.latency_mean_ms)} ms` : '–'),
      el('td', {class: 'num'}, s ? s.tokens.toLocaleString() : '–'),
      actions);
  }

  async function load() {
    try {
      const items = await gtr.api('/api/correctors');
      const stats = await Promise.all(items.map(c => gtr.api(`/api/correctors/${c.id}/stats`).catch(() => null)));
      tbody.replaceChildren(...items.map((c, i) => row(c, stats[i])));
      if (!items.length) tbody.replaceChildren(el('tr', {}, el('td', {colspan: 11, class: 'muted'}, 'No corrector registered yet: runs use the built-in oracle (above).')));
      showError('');
    } catch (err) { showError(`Could not load the correctors: ${err.message}`); }
  }

  document.getElementById('register-form').addEventListener('submit', async (e) => {
    e.preventDefault();
    const status = document.getElementById('register-status');
    const form = new FormData(e.target);
    const body = {};
    for (const [k, v] of form.entries()) if (String(v).trim()) body[k] = String(v).trim();
    try {
      if (body.params) body.params = JSON.parse(body.params);
    } catch (err) { status.className = 'bad small'; status.textContent = `params: not valid JSON (${err.message})`; return; }
    try {
      const c = await gtr.api('/api/correctors', {method: 'POST', body: JSON.stringify(body)});
      status.className = 'ok small'; status.textContent = `registered ${c.name}`;
      e.target.reset(); load();
    } catch (err) { status.className = 'bad small'; status.textContent = err.message; }
  });
  load();
})();
