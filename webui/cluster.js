// gpuam cluster page: vanilla JS over the RM's GET /ws/v1/cluster/overview, polled.
// No build step; the RM embeds this file. Everything is drawn with DOM calls (no
// innerHTML with data), so job names and reasons cannot inject markup.
'use strict';

const POLL_MS = 1000;
// Queue colours (hues); a job's GPUs take its queue's hue at the job's own lightness.
const HUES = [212, 28, 140, 280, 350, 50, 180, 320, 95, 250];

const state = { data: null, queueFilter: '', liveOnly: true, failures: 0, token: null };

// The caller's token comes in the URL fragment (/cluster#token=...), never sent in a URL:
// with it the RM shows the caller's jobs (the admin's token: every job).
function readToken() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  state.token = m ? decodeURIComponent(m[1]) : null;
}

function $(id) { return document.getElementById(id); }
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k === 'text') el.textContent = v;
      else if (k === 'style') el.style.cssText = v;
      else el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
function fmtDur(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + (s % 60) + 's';
  return Math.floor(s / 3600) + 'h ' + Math.floor((s % 3600) / 60) + 'm';
}
function num(x, digits) { return (x === null || x === undefined) ? '–' : Number(x).toFixed(digits); }
// The short number of an application id (application_<ts>_0042 → 42).
function seq(id) { const m = /_(\d+)$/.exec(id || ''); return m ? String(Number(m[1])) : (id || '?'); }

// ---------- colours ----------
function queueHue(name) {
  const names = (state.data ? state.data.queues : []).map(q => q.name);
  const i = names.indexOf(name);
  return HUES[(i < 0 ? 0 : i) % HUES.length];
}
function queueColour(name) { return 'hsl(' + queueHue(name) + ', 62%, 42%)'; }
// Jobs of one queue get spread-out lightness by their order in the queue.
function jobColour(app) {
  const jobs = state.data.apps.filter(a => a.queue === app.queue).map(a => a.id).sort();
  const k = Math.max(0, jobs.indexOf(app.id));
  const light = 30 + (k * 13) % 36;
  return 'hsl(' + queueHue(app.queue) + ', 65%, ' + light + '%)';
}

// ---------- queues ----------
function renderQueues() {
  const d = state.data;
  const rows = d.queues.map(q => {
    const deserved = q.deservedGpus || 0, used = q.usedGpus || 0;
    const total = Math.max(1, ...d.queues.filter(x => x.leaf).map(x => Math.max(x.usedGpus, x.deservedGpus)), used, deserved);
    const bar = h('span', { class: 'share', title: used + ' in use, ' + num(deserved, 1) + ' deserved' },
      h('span', { class: 'used', style: 'width:' + (100 * used / total) + '%;background:' + queueColour(q.name) }),
      h('span', { class: 'mark', style: 'left:calc(' + (100 * deserved / total) + '% - 1px)' }));
    return h('tr', { 'data-queue': q.name, 'data-leaf': q.leaf },
      h('td', null, h('span', { class: 'chip', style: 'background:' + queueColour(q.name) }, q.name), q.leaf ? null : h('span', { class: 'meta small', text: ' (parent)' })),
      h('td', { class: 'num', text: q.weight }),
      h('td', { class: 'num', text: (q.guaranteedGpus || 0) + ' / ' + (q.maxGpus === null || q.maxGpus === undefined ? '∞' : q.maxGpus) }),
      h('td', { class: 'num', 'data-deserved': num(deserved, 2), text: num(deserved, 1) }),
      h('td', { class: 'num', 'data-used': used, text: used }),
      h('td', null, bar),
      h('td', { class: 'num', 'data-waiting': q.waitingTasks, text: q.waitingTasks + (q.waitingGpus ? ' (' + q.waitingGpus + ' GPUs)' : '') }),
      h('td', { class: 'num', 'data-preempted': q.preempted, text: q.preemptingNow + ' / ' + q.preempted }),
      h('td', { class: 'small', text: q.users ? (q.users.length ? q.users.join(', ') : 'admin only') : 'everyone' }));
  });
  $('queue-rows').replaceChildren(...rows);
  const legend = d.queues.filter(q => q.leaf).map(q => h('span', { class: 'legend' }, h('span', { class: 'gpu', style: 'background:' + queueColour(q.name) }), q.name));
  $('queue-legend').replaceChildren(...legend);
  const sel = $('f-queue');
  const have = [...sel.options].map(o => o.value);
  for (const q of d.queues.filter(q => q.leaf)) {
    if (!have.includes(q.name)) sel.append(h('option', { value: q.name, text: q.name }));
  }
}

// ---------- jobs ----------
function renderJobs() {
  const d = state.data;
  const final = ['FINISHED', 'FAILED', 'KILLED'];
  const apps = d.apps
    .filter(a => !state.queueFilter || a.queue === state.queueFilter)
    .filter(a => !state.liveOnly || !final.includes(a.state))
    .sort((x, y) => (x.startedTime - y.startedTime) || x.id.localeCompare(y.id));
  const rows = apps.map(a => {
    const waiting = a.waitingTasks > 0;
    const st = final.includes(a.state) ? (a.finalStatus === 'SUCCEEDED' ? 'SUCCEEDED' : a.state) : (waiting && !a.gpus ? 'WAITING' : a.state);
    const link = a.trackingUrl
      // The job's dashboard gets a page ticket of this one job, for minutes, which the RM
      // gives only for the caller's own live jobs — never the caller's token: the address
      // is what the job's AM registered, and its port may be another process's once the
      // AM has gone.
      ? h('a', { href: a.trackingUrl + (a.dashboardTicket ? '#token=' + encodeURIComponent(a.dashboardTicket) : ''), target: '_blank', rel: 'noopener', title: 'the job\'s dashboard' }, a.name)
      : h('span', { title: 'no dashboard yet' }, a.name);
    return h('tr', { 'data-app': a.id, 'data-state': a.state, 'data-waiting': waiting, 'data-why-code': a.whyCode || '' },
      h('td', null, h('span', { class: 'gpu owned', style: 'background:' + jobColour(a) + ';width:auto;padding:0 4px;height:18px;margin-right:6px', text: seq(a.id) }), link, h('div', { class: 'meta small mono', text: a.id })),
      h('td', { text: a.user || '–' }),
      h('td', null, h('span', { class: 'chip', style: 'background:' + queueColour(a.queue) }, a.queue)),
      h('td', { class: 'num', text: a.priority }),
      h('td', null, h('span', { class: 'state', 'data-state': st, text: st })),
      h('td', { class: 'num', 'data-gpus': a.gpus, text: a.gpus }),
      h('td', { class: 'num', text: waiting ? a.waitingTasks + (a.waitingTasks === 1 ? ' task · ' : ' tasks · ') + fmtDur(a.waitingMs || 0) : '–' },
        // When the RM expects it to start, and on what basis (issue 27).
        waiting && a.startEstimate ? h('div', { class: 'meta small start-estimate', 'data-start-ms': a.startEstimate.startMs || '', text: estimateText(a.startEstimate) }) : null),
      h('td', { class: 'why', 'data-kind': waiting && a.reason ? a.reason.kind : '', 'data-until-ms': waiting && a.reason && a.reason.untilMs ? a.reason.untilMs : '', text: waiting ? (reasonText(a.reason) || a.why || 'placing…') : '' }),
      h('td', null, final.includes(a.state) ? null : stopButton(a)));
  });
  if (!rows.length) rows.push(h('tr', null, h('td', { colspan: 9, class: 'hint', text: 'No jobs.' })));
  $('job-rows').replaceChildren(...rows);
}

// ---------- stop ----------
let stopping = null;
function stopButton(app) {
  const b = h('button', { type: 'button', class: 'danger stop', 'data-stop': app.id, title: 'Stop this job (asks for confirmation)' }, 'Stop');
  b.addEventListener('click', () => askStop(app));
  return b;
}

function askStop(app) {
  stopping = app;
  $('stop-job-name').textContent = app.name;
  $('stop-job-id').textContent = app.id;
  $('stop-dialog').showModal();
}

async function onStopClosed() {
  if ($('stop-dialog').returnValue !== 'stop' || !stopping) return;
  const app = stopping;
  stopping = null;
  const out = $('stop-result');
  out.hidden = false;
  try {
    // The caller's own credential: the RM lets the job's owner and the admin stop it.
    const r = await fetch('/ws/v1/cluster/apps/' + encodeURIComponent(app.id) + '/state', {
      method: 'PUT',
      headers: { Authorization: 'Bearer ' + (state.token || ''), 'Content-Type': 'application/json' },
      body: JSON.stringify({ state: 'KILLED' }),
    });
    let body = {};
    try { body = await r.json(); } catch (_) { /* empty */ }
    out.dataset.ok = r.ok ? 'true' : 'false';
    out.textContent = r.ok ? 'Job ' + seq(app.id) + ' is stopping.' : 'Stop refused: ' + (body.message || r.status);
  } catch (e) {
    out.dataset.ok = 'false';
    out.textContent = 'Stop failed: ' + e.message;
  }
}

// ---------- history ----------
function fmtTime(ms) { return ms ? new Date(ms).toISOString().slice(5, 16).replace('T', ' ') : '–'; }

async function pollHistory() {
  if (!state.token) return;
  const q = new URLSearchParams({ limit: '50' });
  for (const [k, id] of [['user', 'h-user'], ['queue', 'h-queue'], ['state', 'h-state']]) {
    const v = $(id).value.trim();
    if (v) q.set(k, v);
  }
  const r = await fetch('/ws/v1/cluster/history?' + q, { cache: 'no-store', headers: { Authorization: 'Bearer ' + state.token } });
  if (!r.ok) return;
  const rows = (await r.json()).history.map(x => h('tr', { 'data-app': x.id, 'data-state': x.state },
    h('td', null, h('b', { text: seq(x.id) + ' ' }), x.name, h('div', { class: 'meta small mono', text: x.id })),
    h('td', { text: x.user }),
    h('td', null, h('span', { class: 'chip', style: 'background:' + queueColour(x.queue) }, x.queue)),
    h('td', null, h('span', { class: 'state', 'data-state': x.state, text: x.state })),
    h('td', { class: 'num', 'data-exit': x.exitCode, text: x.exitCode === null ? '–' : x.exitCode }),
    h('td', { class: 'mono small', text: fmtTime(x.submittedTime) }),
    h('td', { class: 'mono small', text: fmtTime(x.startedTime) }),
    h('td', { class: 'mono small', text: fmtTime(x.finishedTime) }),
    h('td', { class: 'num', text: fmtDur(x.durationSec * 1000) }),
    h('td', { class: 'num', 'data-gpu-hours': x.gpuHours, text: num(x.gpuHours, 3) }),
    h('td', { class: 'why', text: x.reason })));
  if (!rows.length) rows.push(h('tr', null, h('td', { colspan: 11, class: 'hint', text: 'No finished jobs.' })));
  $('history-rows').replaceChildren(...rows);
}

// ---------- node grid ----------
function renderNodes() {
  const d = state.data;
  const byId = new Map(d.apps.map(a => [a.id, a]));
  const cards = d.nodes.map(n => {
    const boxes = n.gpus.map(g => {
      const app = g.app ? byId.get(g.app) : null;
      if (g.used && !g.app) {
        // Another user's job: its queue shows, the job does not.
        return h('span', {
          class: 'gpu owned' + (g.leaving ? ' leaving' : ''), 'data-gpu-box': true, 'data-host': n.host, 'data-gpu': g.index,
          'data-queue': g.queue || '', style: 'background-color:' + queueColour(g.queue),
          title: 'GPU ' + g.index + ' · a job of queue ' + (g.queue || '?') + (g.leaving ? ' · being taken back' : ''),
        });
      }
      if (g.app) {
        const colour = app ? jobColour(app) : queueColour(g.queue);
        return h('span', {
          class: 'gpu owned' + (g.leaving ? ' leaving' : ''), 'data-gpu-box': true, 'data-host': n.host, 'data-gpu': g.index,
          'data-app': g.app, 'data-queue': g.queue || '', style: 'background-color:' + colour,
          title: 'GPU ' + g.index + ' · ' + (app ? app.name + ' ' : '') + g.app + ' · queue ' + (g.queue || '?') + (g.leaving ? ' · being taken back' : ''),
        }, seq(g.app));
      }
      return h('span', { class: 'gpu', 'data-gpu-box': true, 'data-host': n.host, 'data-gpu': g.index, 'data-look': g.other ? 'other' : 'free', title: 'GPU ' + g.index + (g.other ? ' · used outside gpuam' : ' · free') });
    });
    const unhealthy = n.state !== 'RUNNING';
    return h('div', { class: 'node-card' + (unhealthy ? ' unhealthy' : ''), 'data-host': n.host },
      h('div', { class: 'node-head' }, h('b', { class: 'mono', text: n.host }), h('span', { class: 'meta small', text: n.rack + (n.gpuType ? ' · ' + n.gpuType : '') }), h('span', { class: 'state', 'data-state': unhealthy ? 'FAILED' : 'RUNNING', text: n.state })),
      h('div', { class: 'gpus' }, boxes),
      h('div', { class: 'cpu', text: 'CPU ' + n.usedCpu + '/' + n.totalCpu + ' · memory ' + Math.round(n.usedMemoryMB / 1024) + '/' + Math.round(n.totalMemoryMB / 1024) + ' GiB · ' + n.containers + ' containers' }));
  });
  $('node-grid').replaceChildren(...cards);
}

function renderHeader() {
  const d = state.data;
  const total = d.nodes.reduce((s, n) => s + n.gpus.length, 0);
  const used = d.nodes.reduce((s, n) => s + n.gpus.filter(g => g.used || g.other).length, 0);
  $('c-nodes').textContent = d.nodes.length;
  $('c-gpus').textContent = used + ' / ' + total;
  $('c-progress').setAttribute('aria-valuemax', total);
  $('c-progress').setAttribute('aria-valuenow', used);
  $('c-progress-bar').style.width = (total ? 100 * used / total : 0) + '%';
  const live = d.apps.filter(a => !['FINISHED', 'FAILED', 'KILLED'].includes(a.state));
  $('c-running').textContent = live.filter(a => a.gpus > 0).length;
  $('c-waiting').textContent = live.filter(a => a.waitingTasks > 0).length;
  $('c-preempting').textContent = d.preemptions.length;
  $('c-grace').textContent = d.preemptionGraceSec + ' s';
  $('c-updated').textContent = new Date(d.time).toLocaleTimeString();
}

async function poll() {
  try {
    const headers = state.token ? { Authorization: 'Bearer ' + state.token } : {};
    const r = await fetch('/ws/v1/cluster/overview', { cache: 'no-store', headers });
    if (r.status === 401) {
      $('conn').textContent = 'this page needs a token: open it as /cluster#token=YOUR_TOKEN (gpuam token new; the admin token shows every job)';
      $('conn').hidden = false;
      setTimeout(poll, 5000);
      return;
    }
    if (!r.ok) throw new Error(r.status + ' ' + r.statusText);
    state.data = await r.json();
    state.failures = 0;
    $('conn').hidden = true;
    renderHeader();
    renderQueues();
    renderJobs();
    renderNodes();
    await pollHistory();
    document.body.dataset.ready = 'true';
  } catch (e) {
    state.failures++;
    $('conn').textContent = 'RM unreachable · retrying…';
    $('conn').hidden = false;
    $('conn').title = String(e);
  }
  setTimeout(poll, Math.min(POLL_MS * (1 + state.failures), 10000));
}

window.addEventListener('hashchange', readToken);
document.addEventListener('DOMContentLoaded', () => {
  readToken();
  $('f-queue').addEventListener('change', e => { state.queueFilter = e.target.value; if (state.data) renderJobs(); });
  $('f-live').addEventListener('change', e => { state.liveOnly = e.target.checked; if (state.data) renderJobs(); });
  for (const id of ['h-user', 'h-queue', 'h-state']) $(id).addEventListener('change', () => { pollHistory(); });
  $('stop-dialog').addEventListener('close', onStopClosed);
  poll();
});
