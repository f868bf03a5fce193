// Chart helpers shared by the run and compare pages (uPlot, vendored in static/vendor/uplot).
gtr.charts = {
  GROUPS: [
    {title: 'Success rate', keys: ['success_rate', 'eval/success_rate'], unit: true},
    {title: 'Episode return', keys: ['episode_return']},
    {title: 'Corrector disagreement & validity', keys: ['corrected_rate', 'format_valid_rate', 'action_valid_rate'], unit: true},
    {title: 'Losses', keys: ['losses/policy', 'losses/value', 'losses/sft']},
    {title: 'Collapse · state relevance', keys: ['probe_relevance', 'state_relevance'], unit: true, collapse: true, threshold: 'minRelevance'},
    {title: 'Collapse · probe dominance', keys: ['probe_top_thought_share', 'probe_distinct_thoughts'], unit: true, collapse: true, threshold: 'maxTopShare'},
    {title: 'Collapse · diversity', keys: ['distinct_1', 'distinct_2', 'self_bleu_2'], unit: true, collapse: true},
    {title: 'Collapse · distinct thoughts per state', keys: ['thoughts_per_state'], collapse: true},
    {title: 'Thought length (tokens)', keys: ['thought_length'], collapse: true},
    {title: 'Thought-token entropy', keys: ['thought_entropy'], collapse: true},
    {title: 'Episode length', keys: ['episode_length']},
    {title: 'PPO · approx KL & clip fraction', keys: ['approx_kl', 'clipfrac']},
    {title: 'Gradient norm', keys: ['grad_norm']},
    {title: 'Value · explained variance', keys: ['explained_variance']},
    {title: 'Learning rate', keys: ['lr']},
    {title: 'Corrector latency (ms)', keys: ['corrector_latency_ms']},
  ],
  COLORS: ['#2563eb', '#d97706', '#059669', '#7c3aed', '#db2777', '#0891b2', '#65a30d', '#dc2626'],
  HEIGHT: 190,

  // Every numeric metric key present in the updates.
  keys(updates) {
    return new Set(updates.flatMap(u => Object.keys(u.metrics).filter(k => typeof u.metrics[k] === 'number')));
  },

  tick(v) {
    if (v === 0) return '0';
    const a = Math.abs(v);
    return a < 0.01 || a >= 1e5 ? v.toExponential(1) : String(+v.toPrecision(3));
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

  // Red bands behind the updates whose alarm fired.
  alarmHook(getUpdates) {
    return (u) => {
      const {ctx, bbox} = u;
      ctx.save();
      ctx.fillStyle = 'rgba(220, 38, 38, 0.13)';
      for (const upd of getUpdates()) {
        if (!upd.alarm) continue;
        const x0 = u.valToPos(upd.idx - 0.5, 'x', true), x1 = u.valToPos(upd.idx + 0.5, 'x', true);
        const left = Math.max(bbox.left, x0), right = Math.min(bbox.left + bbox.width, x1);
        if (right > left) ctx.fillRect(left, bbox.top, right - left, bbox.height);
      }
      ctx.restore();
    };
  },

  plot(box, {title, labels, unit, hooks = {}, points = true}, data) {
    const c = gtr.charts;
    const opts = {
      title, width: box.clientWidth || 420, height: c.HEIGHT,
      scales: {x: {time: false}, y: unit ? {range: [0, 1]} : {}},
      series: [{label: 'update'}, ...labels.map((label, i) => ({label, stroke: c.COLORS[i % c.COLORS.length], width: 2, spanGaps: true, points: {show: points}}))],
      axes: [{label: 'update', size: 36, labelSize: 14, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 1e4, 2e4, 5e4]},
        {size: 54, values: (u, splits) => splits.map(c.tick)}],
      hooks,
    };
    return new uPlot(opts, data, box);
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
