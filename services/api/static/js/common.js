// Shared helpers: same-origin JSON calls (the HttpOnly cookie carries the token) and formatting.
window.gtr = {
  async api(path, options = {}) {
    const res = await fetch(path, {
      credentials: 'same-origin',
      headers: {'Accept': 'application/json', ...(options.body ? {'Content-Type': 'application/json'} : {})},
      ...options,
    });
    if (res.status === 401) { location.href = '/login?next=' + encodeURIComponent(location.pathname); }
    const body = res.headers.get('content-type')?.includes('json') ? await res.json() : null;
    if (!res.ok) { const err = new Error(gtr.detail(body) || res.statusText); err.status = res.status; throw err; }
    return body;
  },
  detail(body) {
    const d = body && body.detail;
    if (Array.isArray(d)) return d.map(e => `${(e.loc || []).filter(x => x !== 'body').join('.')}: ${e.msg}`).join('\n');
    return d || '';
  },
  pct: v => (typeof v === 'number' ? `${Math.round(v * 100)}%` : '–'),
  duration(sec) {
    if (typeof sec !== 'number') return '–';
    const s = Math.floor(sec), pad = n => String(n).padStart(2, '0');
    if (s >= 3600) return `${Math.floor(s / 3600)}h ${pad(Math.floor(s % 3600 / 60))}m`;
    return s >= 60 ? `${Math.floor(s / 60)}m ${pad(s % 60)}s` : `${s}s`;
  },
  // What a run is doing now, as the server's _macros.html phase() writes it.
  phaseText(run) {
    if (run.status === 'queued') return 'queued';
    if (run.status !== 'running') return run.status;
    const of = run.phase_total ? ` ${run.phase_step || 0} of ${run.phase_total}` : '';
    return {warm_start: `warm start${of}`, rollout: `rollout${of ? ' step' + of : ''}`,
      corrections: 'waiting for corrections'}[run.phase] || run.phase || 'starting';
  },
  timingText(run) {
    let out = run.elapsed_s != null ? `· ${gtr.duration(run.elapsed_s)} elapsed` : '';
    if (run.eta_s == null) return out;
    // A stage past its measured time makes the ETA a floor: say so, and by how much.
    const over = run.eta_over_s >= 1;
    const notes = [run.eta_of === 'warm start' ? 'warm start' : '',
      over ? `this stage ${gtr.duration(run.eta_over_s)} past its usual` : ''].filter(Boolean);
    out += ` · ETA ${over ? '≥ ' : ''}${gtr.duration(run.eta_s)}${notes.length ? ` (${notes.join('; ')})` : ''}`;
    return out;
  },
  num: (v, digits = 2) => (typeof v === 'number' ? v.toFixed(digits) : '–'),
  el(tag, attrs = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === 'class') e.className = v; else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? '' : v);
    }
    for (const c of children.flat()) e.append(c instanceof Node ? c : document.createTextNode(c ?? ''));
    return e;
  },
};

// Behaviour the markup asks for by class, so no page needs an inline handler (the CSP has no
// 'unsafe-inline'): forms.confirm ask first (the text is read as data, never as code), and
// select.autosubmit submits its form.
document.addEventListener('submit', (e) => {
  const form = e.target;
  if (form.matches && form.matches('form.confirm') && !confirm(form.dataset.confirm || 'Are you sure?')) e.preventDefault();
});
document.addEventListener('change', (e) => {
  if (e.target.matches && e.target.matches('select.autosubmit')) e.target.form.submit();
});
