// Chart helpers shared by the run and compare pages (uPlot, vendored in static/vendor/uplot).
gtr.charts = {
  // family: the collapsible section; unit: a 0-1 axis; steps: the step search a point opens.
  GROUPS: [
    {family: 'Learning', title: 'Success rate', keys: ['eval/success_rate', 'success_rate'], unit: true, steps: {}},
    {family: 'Learning', title: 'Episode return', keys: ['episode_return'], steps: {}},
    {family: 'Learning', title: 'Episode length', keys: ['episode_length'], steps: {}},
    {family: 'Corrector', title: 'Corrector disagreement & validity', keys: ['corrected_rate', 'format_valid_rate', 'action_valid_rate'], unit: true, steps: {verdict: 'corrected'}},
    {family: 'Corrector', title: 'Corrector accuracy (against the exact judge)', keys: ['corrector/accuracy'], unit: true, steps: {}},
    {family: 'Corrector', title: 'Corrector latency (ms)', keys: ['corrector_latency_ms'], steps: {}},
    {family: 'Corrector', title: 'Failed corrections', keys: ['corrections_failed', 'corrections'], steps: {verdict: 'failed'}},
    {family: 'Collapse', title: 'Collapse · state relevance', keys: ['probe_relevance', 'state_relevance'], unit: true, collapse: true, threshold: 'minRelevance', steps: {}},
    // probe_distinct_thoughts is a count: drawn as a share of the probe set (see derived()).
    {family: 'Collapse', title: 'Collapse · probe dominance (share of probe)', keys: ['probe_top_thought_share', 'probe_distinct_share'], unit: true, collapse: true, threshold: 'maxTopShare', steps: {}},
    {family: 'Collapse', title: 'Collapse · diversity', keys: ['distinct_1', 'distinct_2', 'self_bleu_2'], unit: true, collapse: true, steps: {}},
    {family: 'Collapse', title: 'Collapse · distinct thoughts per state', keys: ['thoughts_per_state'], collapse: true, steps: {}},
    {family: 'Collapse', title: 'Thought length (tokens)', keys: ['thought_length'], collapse: true, steps: {}},
    {family: 'Collapse', title: 'Thought-token entropy', keys: ['thought_entropy'], collapse: true, steps: {}},
    {family: 'Optimisation', title: 'Losses', keys: ['losses/policy', 'losses/value', 'losses/sft', 'losses/kl']},
    {family: 'Optimisation', title: 'PPO · approx KL & clip fraction', keys: ['approx_kl', 'clipfrac']},
    {family: 'Optimisation', title: 'Gradient norm', keys: ['grad_norm', 'sft/grad_norm', 'kl/grad_norm']},
    // The thought-SFT term's share of the applied step: under ~0.1 for
    // several updates while losses/sft stays flat, the guidance is drowned (the run's alarm).
    {family: 'Optimisation', title: 'Thought guidance · SFT share of the step', keys: ['sft/grad_share'], unit: true},
    // gtr_turbo_kl's guidance: the KL-to-teacher term's share, measured the same way (no alarm:
    // a small share is expected while the agent sits near its teacher, docs/training.md).
    {family: 'Optimisation', title: 'Thought guidance · KL-to-teacher share of the step', keys: ['kl/grad_share'], unit: true},
    {family: 'Optimisation', title: 'Value · explained variance', keys: ['explained_variance']},
    {family: 'Optimisation', title: 'Learning rate', keys: ['lr']},
  ],
  // Bookkeeping numbers, not curves.
  IGNORE: new Set(['checkpoint_id', 'trained', 'probe_distinct_thoughts', 'rollout_s', 'update_s']),
  FAMILIES: ['Learning', 'Corrector', 'Collapse', 'Optimisation', 'Other'],
  COLORS: ['#2563eb', '#d97706', '#059669', '#7c3aed', '#db2777', '#0891b2', '#65a30d', '#dc2626'],
  HEIGHT: 190,

  // Every numeric metric key present in the updates.
  keys(updates) {
    return new Set(updates.flatMap(u => Object.keys(u.metrics).filter(k => typeof u.metrics[k] === 'number')));
  },

  // A metric's value in one update, with the derived ones (a count turned into a share).
  value(u, key, ctx = {}) {
    if (key === 'probe_distinct_share') {
      const n = u.metrics.probe_distinct_thoughts;
      return typeof n === 'number' && ctx.probeStates ? n / ctx.probeStates : null;
    }
    return typeof u.metrics[key] === 'number' ? u.metrics[key] : null;
  },

  // Known groups with data, then the unknown keys: one chart per 'prefix/' family, the rest
  // four to a chart, all in the collapsed 'Other' section (never one chart per key).
  groups(updates) {
    const c = gtr.charts, seen = c.keys(updates);
    if (seen.has('probe_distinct_thoughts')) seen.add('probe_distinct_share');
    const known = new Set(c.GROUPS.flatMap(g => g.keys));
    const out = c.GROUPS.map(g => ({...g, keys: g.keys.filter(k => seen.has(k))})).filter(g => g.keys.length);
    const unknown = [...seen].filter(k => !known.has(k) && !c.IGNORE.has(k)).sort();
    const byPrefix = new Map();
    for (const k of unknown) {
      const p = k.includes('/') ? k.split('/')[0] + '/…' : '';
      if (!byPrefix.has(p)) byPrefix.set(p, []);
      byPrefix.get(p).push(k);
    }
    for (const [p, ks] of byPrefix) {
      for (let i = 0; i < ks.length; i += 4) out.push({family: 'Other', title: p || ks.slice(i, i + 4).join(', '), keys: ks.slice(i, i + 4), steps: {}});
    }
    return out;
  },

  tick(v, digits = 3) {
    if (v === 0) return '0';
    const a = Math.abs(v);
    return a < 0.01 || a >= 1e5 ? v.toExponential(digits - 2) : String(+v.toPrecision(digits));
  },

  // An axis's labels, with as many digits as it takes to tell its ticks apart (a narrow range,
  // 20.88 to 20.92, would otherwise read "20.9" four times).
  ticks(splits) {
    for (let digits = 3; digits <= 8; digits += 1) {
      const out = splits.map(v => gtr.charts.tick(v, digits));
      if (new Set(out).size === out.length) return out;
    }
    return splits.map(String);
  },

  // Exponential moving average (TensorBoard-style), nulls kept as gaps.
  smooth(ys, alpha) {
    if (!alpha) return ys;
    let last = null;
    return ys.map((y) => {
      if (y === null) return null;
      last = last === null ? y : alpha * last + (1 - alpha) * y;
      return last;
    });
  },

  // Why the collapse alarm fired or did not, under a chart with a dashed line (the rule is
  // services/controller/metrics.py alarm_reason; the limits are the run's [metrics] config).
  ruleText(group, updates, limits) {
    const fired = updates.filter(u => u.alarm).length;
    const tail = fired ? ` It fired on ${fired} update${fired === 1 ? '' : 's'} (shaded red).` : ' It has not fired.';
    if (group.threshold === 'maxTopShare') {
      const max = parseFloat(limits.maxTopShare);
      return `Alarm when one thought's share of the probe passes s0 + ${max} × (1 − s0), s0 being the share ` +
        `the probe's own states give when thoughts track them (the dashed line: ${max}, for all-distinct states).${tail}`;
    }
    const min = parseFloat(limits.minRelevance), drop = parseFloat(limits.relevanceDrop);
    const warm = parseInt(limits.warmupUpdates, 10) || 0;
    const rels = updates.map(u => u.metrics.probe_relevance ?? u.metrics.state_relevance).filter(v => typeof v === 'number');
    const best = rels.length ? Math.max(...rels) : null;
    let text = `Alarm when relevance falls ${Math.round(drop * 100)}% under the run's best, once that best reached ${min} (the dashed line)`;
    text += warm ? `, or stays under ${min} after ${warm} updates.` : '; staying under it raises none (alarm_warmup_updates is 0: an agent that has not learnt to read the state has not collapsed).';
    if (best !== null && best < min) text += ` This run's best is ${best.toFixed(2)}: no drop counts yet.`;
    else if (best !== null) text += ` This run's best is ${best.toFixed(2)}: an alarm below ${(best * (1 - drop)).toFixed(2)}.`;
    return text + tail;
  },

  // A dashed horizontal line at y: the alarm threshold of a collapse monitor.
  thresholdHook(y) {
    return (u) => {
      if (!Number.isFinite(y)) return;
      const {ctx, bbox} = u, py = u.valToPos(y, 'y', true);
      ctx.save();
      ctx.strokeStyle = 'rgba(220, 38, 38, 0.8)'; ctx.setLineDash([6, 4]); ctx.lineWidth = 1.5;
      ctx.beginPath(); ctx.moveTo(bbox.left, py); ctx.lineTo(bbox.left + bbox.width, py); ctx.stroke();
      ctx.restore();
    };
  },

  // Red bands behind the updates whose alarm fired (x: the updates' positions on the axis).
  alarmHook(getUpdates) {
    return (u) => {
      const {ctx, bbox} = u, xs = u.data[0], ups = getUpdates();
      ctx.save();
      ctx.fillStyle = 'rgba(220, 38, 38, 0.13)';
      ups.forEach((upd, i) => {
        if (!upd.alarm || xs[i] === undefined) return;
        const half = (xs.length > 1 ? (xs[Math.min(i + 1, xs.length - 1)] - xs[Math.max(i - 1, 0)]) / (i > 0 && i < xs.length - 1 ? 4 : 2) : 0.5);
        const x0 = u.valToPos(xs[i] - half, 'x', true), x1 = u.valToPos(xs[i] + half, 'x', true);
        const left = Math.max(bbox.left, x0), right = Math.min(bbox.left + bbox.width, x1);
        if (right > left) ctx.fillRect(left, bbox.top, right - left, bbox.height);
      });
      ctx.restore();
    };
  },

  // points: a boolean, or one per series (a series with a single value needs its dot).
  // intX: the x values are counts (updates, env steps): ticks only on whole numbers, and a
  // lone x value sits in a range of its own instead of uPlot's default 0-100.
  plot(box, {title, labels, unit, hooks = {}, points = true, xLabel = 'update', intX = true}, data) {
    const c = gtr.charts;
    const show = i => (Array.isArray(points) ? points[i] : points);
    const x = {time: false};
    if (intX) {
      x.range = (u, min, max) => {
        // From the data: uPlot has already widened a lone value's range to 0-100 by now.
        const xs = (u.data[0] || []).filter(v => v !== null && v !== undefined);
        if (xs.length) { min = Math.min(...xs); max = Math.max(...xs); }
        const r = min === max ? [min - 0.5, max + 0.5] : [min, max];
        box.dataset.xRange = r.join(' ');  // what the axis spans, for a reader (and a test)
        return r;
      };
    }
    const xAxis = {label: xLabel, size: 36, labelSize: 14};
    if (intX) {
      xAxis.incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6, 1e7];
      xAxis.values = (u, splits) => {
        const labels = splits.map(v => (Number.isInteger(v) ? String(v) : ''));
        box.dataset.xTicks = labels.filter(Boolean).join(' ');
        return labels;
      };
    }
    const opts = {
      title, width: box.clientWidth || 420, height: c.HEIGHT,
      scales: {x, y: unit ? {range: [0, 1]} : {}},
      series: [{label: xLabel}, ...labels.map((label, i) => ({label, stroke: c.COLORS[i % c.COLORS.length], width: 2, spanGaps: true, points: {show: show(i), size: 6}}))],
      axes: [xAxis, {size: 54, values: (u, splits) => {
        const out = c.ticks(splits);
        box.dataset.yTicks = out.join('|');
        return out;
      }}],
      hooks,
    };
    return new uPlot(opts, data, box);
  },

  // Whether each series needs dots: few x values, or a single value of its own.
  pointsFor(data) {
    return data.slice(1).map(ys => data[0].length < 60 || ys.filter(y => y !== null).length < 2);
  },

  // All updates of a run after the first `have`, following the pages.
  async fetchUpdates(runId, have = 0) {
    const out = [];
    for (;;) {
      const page = await gtr.api(`/api/runs/${runId}/updates?limit=500&offset=${have + out.length}`);
      out.push(...page.items);
      if (!page.items.length || have + out.length >= page.total) return out;
    }
  },

  resizeOnWindow(getCharts) {
    let timer;
    window.addEventListener('resize', () => {
      clearTimeout(timer);
      timer = setTimeout(() => getCharts().forEach(c => c.plot.setSize({width: c.box.clientWidth, height: gtr.charts.HEIGHT})), 150);
    });
  },
};
