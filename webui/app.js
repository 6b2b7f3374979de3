// gpuam dashboard: vanilla JS over the AM's status API (/api/v1) and its SSE stream.
// No build step; the AM embeds this file. Everything is drawn with DOM calls (no
// innerHTML with data), so task names and diagnostics cannot inject markup.
'use strict';

const TASK_PAGE = 50;
const NODE_PAGE = 24;
const LOG_POLL_MS = 1500;
const LOG_TAIL = 65536;
const TAIL_POLL_MS = 2000;
const TAIL_LINES = 3;
// frameworklauncher's code for a container stopped because its job completed.
const KILLED_ON_JOB_END = -7125;

const state = {
  job: null,
  tasks: new Map(),      // "role/index" -> task
  order: [],             // keys in API order
  nodes: new Map(),      // host -> node
  nodeOrder: [],
  selected: null,        // "role/index"
  taskPage: 0,
  nodePage: 0,
  token: null,
  lastEventId: null,
  logTimer: null,
  stream: 'stdout',
  tails: new Map(),      // "role/index" -> { containerId, lines }
  tailTimer: null,
  ticketTimer: null,
  ticketExpiresMs: 0,    // when the page's ticket expires (browser clock)
  ended: false,          // the job is final and the live stream is closed
};

// ---------- helpers ----------
function $(id) { return document.getElementById(id); }
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k === 'text') el.textContent = v;
      else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
function key(t) { return t.role + '/' + t.index; }
function fmtTime(ms) {
  if (!ms) return '–';
  const d = new Date(ms);
  return d.toLocaleString(undefined, { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit' });
}
function fmtDur(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + (s % 60) + 's';
  return Math.floor(s / 3600) + 'h ' + Math.floor((s % 3600) / 60) + 'm';
}
function parseMask(hex) {
  try { return hex ? BigInt(hex) : 0n; } catch (_) { return 0n; }
}
function bits(mask) {
  const out = [];
  for (let i = 0; mask > 0n; i++, mask >>= 1n) if (mask & 1n) out.push(i);
  return out;
}
function popcount(mask) { return bits(mask).length; }
function lowestBit(mask) { const b = bits(mask); return b.length ? b[0] : 1e9; }

// The API needs the token of the link the page was opened with (#token=...): the job
// token, the owner's user token, the admin token, or a page ticket of this job (the
// cluster page's links carry one).
function pageToken() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}
function authHeaders() {
  return state.token ? { Authorization: 'Bearer ' + state.token } : {};
}

// The page keeps no lasting credential. The dashboard's address is a loopback port that
// another process may take once the job's AM has gone, and a page still calling it would
// hand that process whatever it holds. So the page trades the credential it was opened
// with for a page ticket of this job at once (good for minutes, this job only), puts the
// ticket in its address instead (a reload still works while it is good), renews it while
// the AM answers, and forgets it once the job has ended and the AM has gone.
const TICKET_RENEW_MS = 200000;
async function trade() {
  clearTimeout(state.ticketTimer);
  state.ticketTimer = null;
  if (!state.token || state.ended) return;
  try {
    const r = await fetch('/api/v1/page-ticket', { cache: 'no-store', headers: authHeaders() });
    const t = r.ok ? await r.json() : null;
    if (t && t.ticket && !state.ended) {
      state.token = t.ticket;
      state.ticketExpiresMs = t.expires * 1000;
      history.replaceState(null, '', location.pathname + location.search + '#token=' + encodeURIComponent(t.ticket));
    }
  } catch (_) { /* the AM is away: try again at the next renewal */ }
  if (!state.ended) state.ticketTimer = setTimeout(trade, TICKET_RENEW_MS);
}
// The job has ended and its AM stopped serving: nothing more is asked of that address.
function forget() {
  state.ended = true;
  state.token = null;
  clearTimeout(state.ticketTimer);
  clearTimeout(state.logTimer);
  clearTimeout(state.tailTimer);
  state.ticketTimer = state.logTimer = state.tailTimer = null;
}

async function getJSON(url) {
  const r = await fetch(url, { cache: 'no-store', headers: authHeaders() });
  if (!r.ok) {
    let msg = r.status + ' ' + r.statusText;
    try { const e = await r.json(); msg = e.message || msg; } catch (_) { /* not JSON */ }
    const err = new Error(msg); err.status = r.status; throw err;
  }
  const last = r.headers.get('x-last-event-id');
  return { body: await r.json(), lastEventId: last };
}

// A task's state in words people use.
function displayState(t) {
  switch (t.state) {
    case 'TASK_WAITING': return 'WAITING';
    case 'CONTAINER_REQUESTED': return 'REQUESTED';
    case 'CONTAINER_ALLOCATED': return 'ALLOCATED';
    case 'CONTAINER_LAUNCHED': return 'LAUNCHED';
    case 'CONTAINER_RUNNING': return 'RUNNING';
    case 'CONTAINER_COMPLETED':
    case 'TASK_COMPLETED':
      if (t.exitCode === 0 || t.exitType === 'SUCCEEDED') return 'SUCCEEDED';
      // Stopped because the job ended (parameter servers, the rest of a failed gang):
      // not a failure of this task.
      if (t.exitCode === KILLED_ON_JOB_END) return t.state === 'TASK_COMPLETED' ? 'STOPPED' : 'COMPLETING';
      if (t.exitCode === null || t.exitCode === undefined) return t.state === 'TASK_COMPLETED' ? 'STOPPED' : 'COMPLETING';
      return t.state === 'TASK_COMPLETED' ? 'FAILED' : 'COMPLETING';
    default: return t.state;
  }
}
const DISPLAY_STATES = ['WAITING', 'REQUESTED', 'ALLOCATED', 'LAUNCHED', 'RUNNING', 'COMPLETING', 'SUCCEEDED', 'FAILED', 'STOPPED'];
function isLive(t) { return ['CONTAINER_ALLOCATED', 'CONTAINER_LAUNCHED', 'CONTAINER_RUNNING'].includes(t.state); }

// ---------- loading ----------
async function loadJob() {
  const { body, lastEventId } = await getJSON('/api/v1/job');
  state.job = body;
  if (state.lastEventId === null && lastEventId !== null) state.lastEventId = lastEventId;
  renderJob();
}

async function loadTasks() {
  const all = [];
  for (let offset = 0; ; offset += 1000) {
    const { body } = await getJSON('/api/v1/tasks?limit=1000&offset=' + offset);
    all.push(...body.tasks);
    if (body.tasks.length === 0 || all.length >= body.total) break;
  }
  state.tasks = new Map(all.map(t => [key(t), t]));
  state.order = all.map(key);
  renderRoleFilter();
  renderTasks();
  renderNodes();
  if (state.selected) renderDetail();
}

async function loadTask(k) {
  const [role, index] = k.split('/');
  try {
    const { body } = await getJSON('/api/v1/tasks/' + encodeURIComponent(role) + '/' + encodeURIComponent(index));
    if (!state.tasks.has(k)) state.order.push(k);
    state.tasks.set(k, body);
  } catch (e) {
    if (e.status !== 404) throw e;
  }
}

async function loadNodes() {
  const all = [];
  for (let offset = 0; ; offset += 1000) {
    const { body } = await getJSON('/api/v1/nodes?limit=1000&offset=' + offset);
    all.push(...body.nodes);
    if (body.nodes.length === 0 || all.length >= body.total) break;
  }
  state.nodes = new Map(all.map(n => [n.host, n]));
  state.nodeOrder = all.map(n => n.host);
  renderNodes();
}

// ---------- job header ----------
function renderJob() {
  const j = state.job;
  if (!j) return;
  document.title = j.name + ' · ' + j.state + ' · gpuam';
  $('job-name').textContent = j.name;
  const st = $('job-state');
  st.textContent = j.state;
  st.dataset.state = j.state;
  $('job-attempt').textContent = j.attempt;
  $('job-appid').textContent = j.appId + (j.gang ? ' · gang' : '') + (j.queue ? ' · queue ' + j.queue + (j.priority ? ' (priority ' + j.priority + ')' : '') : '');
  const total = j.totalTasks || 0, done = j.completedTasks || 0;
  const p = $('progress');
  p.setAttribute('aria-valuemax', total);
  p.setAttribute('aria-valuenow', done);
  $('progress-bar').style.width = (total ? (100 * done / total) : 0) + '%';
  $('progress-bar').dataset.state = j.state;
  $('progress-text').textContent = done + ' / ' + total + ' tasks done';
  $('job-started').textContent = fmtTime(j.startedMs);
  $('job-finished').textContent = j.finishedMs ? fmtTime(j.finishedMs) + ' (took ' + fmtDur(j.finishedMs - j.startedMs) + ')' : (j.startedMs ? 'not yet (running ' + fmtDur(Date.now() - j.startedMs) + ')' : '–');
  $('job-exit').textContent = (j.exitCode === null || j.exitCode === undefined) ? '–' : j.exitCode;
  const roles = $('job-roles');
  roles.replaceChildren(...(j.roles || []).map(r => h('span', { class: 'role-chip', title: 'waiting ' + r.waiting + ', requested ' + r.requested + ', allocated ' + r.allocated + ', running ' + r.running + ', succeeded ' + r.succeeded + ', failed ' + r.failed + ', stopped ' + (r.stopped || 0) },
    h('b', { text: r.role }), ' ', r.running + ' run · ' + r.succeeded + ' ok' + (r.failed ? ' · ' + r.failed + ' failed' : '') + (r.stopped ? ' · ' + r.stopped + ' stopped' : '') + ((r.waiting + r.requested) ? ' · ' + (r.waiting + r.requested) + ' wait' : '') + ' / ' + r.instances)));
  const diag = $('job-diagnostics');
  diag.hidden = !j.diagnostics;
  diag.textContent = j.diagnostics || '';
  diag.dataset.state = j.state;
  const final = ['SUCCEEDED', 'FAILED', 'KILLED'].includes(j.state);
  // Why the job waits: the one reason (the queue's cause, or that of the task that holds
  // it back), in the words every surface shows (reason.js).
  const note = $('job-queue-note');
  const why = final ? null : j.reason;
  note.hidden = !why;
  note.textContent = why ? 'Waiting — ' + reasonText(why) : '';
  note.dataset.kind = why ? why.kind : '';
  note.dataset.untilMs = why && why.untilMs ? why.untilMs : '';
  // When the RM expects it to start, and on what basis (issue 27), under the reason.
  const est = $('job-start-estimate');
  const e = why && !final ? j.startEstimate : null;
  est.hidden = !e;
  est.textContent = e ? estimateText(e) : '';
  est.dataset.startMs = e && e.startMs ? e.startMs : '';
  const kill = $('kill');
  if (!state.token) {
    kill.disabled = true;
  } else {
    kill.disabled = final;
    kill.title = final ? 'The job has ended' : 'Kill this job (asks for confirmation)';
  }
}

// ---------- tasks ----------
function renderRoleFilter() {
  const sel = $('f-role');
  const roles = [...new Set(state.order.map(k => state.tasks.get(k).role))];
  const cur = sel.value;
  sel.replaceChildren(h('option', { value: '' }, 'all'), ...roles.map(r => h('option', { value: r }, r)));
  sel.value = roles.includes(cur) ? cur : '';
}

function filteredTasks() {
  const role = $('f-role').value, st = $('f-state').value, host = $('f-host').value.trim();
  const out = [];
  for (const k of state.order) {
    const t = state.tasks.get(k);
    if (role && t.role !== role) continue;
    if (st && displayState(t) !== st) continue;
    if (host && !(t.host || '').includes(host)) continue;
    out.push(t);
  }
  return out;
}

function taskRow(t) {
  const k = key(t), ds = displayState(t);
  const ports = (t.ports || []).map(([l, ps]) => l + ':' + ps.join(',')).join(' ');
  const note = reasonText(t.reason) || t.exitDiagnostics || '';
  return h('tr', { 'data-task': k, 'data-state': ds, 'data-raw-state': t.state, class: k === state.selected ? 'selected' : null, tabindex: 0,
    onclick: () => selectTask(k), onkeydown: e => { if (e.key === 'Enter') selectTask(k); } },
    h('td', { class: 'mono' }, k),
    h('td', null, h('span', { class: 'state', 'data-state': ds }, ds)),
    h('td', { class: 'mono' }, t.host || '–'),
    h('td', { class: 'mono', title: t.gpuMask || '' }, t.gpus && t.gpus.length ? t.gpus.join(',') + (t.gpuShare ? ' (' + t.gpuShare + ')' : '') : '–'),
    h('td', { class: 'mono small' }, ports || '–'),
    h('td', null, t.attempt),
    h('td', { class: 'mono' }, t.exitCode === null || t.exitCode === undefined ? '' : t.exitCode),
    h('td', { class: 'note', title: note }, h('span', { class: 'note-text' }, note)),
    tailCell(t));
}

// The task's latest output lines, if its container still matches.
function tailCell(t) {
  const tl = state.tails.get(key(t));
  const lines = tl && tl.containerId === t.containerId ? tl.lines : [];
  return h('td', { class: 'tail', 'data-tail': key(t), title: lines.join('\n') }, ...lines.map(l => h('div', null, l)));
}

// ---------- latest output of the tasks on the page ----------
function jobFinal() { return !!state.job && ['SUCCEEDED', 'FAILED', 'KILLED'].includes(state.job.state); }

// One round at a time: state.tailTimer is set while a round is scheduled or running.
async function loadTails() {
  state.tailTimer = 'running';
  const list = filteredTasks();
  const start = state.taskPage * TASK_PAGE;
  const keys = list.slice(start, start + TASK_PAGE).filter(t => t.containerId).map(key);
  const wasFinal = jobFinal();
  if (keys.length) {
    try {
      const { body } = await getJSON('/api/v1/tails?lines=' + TAIL_LINES + '&tasks=' + encodeURIComponent(keys.join(',')));
      let changed = false;
      for (const tl of body.tails) {
        if (!tl.lines.length && tl.error) continue; // keep what was shown (the AM may be gone)
        const k = tl.role + '/' + tl.index, old = state.tails.get(k);
        if (!old || old.containerId !== tl.containerId || old.lines.join('\n') !== tl.lines.join('\n')) {
          state.tails.set(k, { containerId: tl.containerId, lines: tl.lines });
          changed = true;
        }
      }
      if (changed) for (const td of document.querySelectorAll('td.tail[data-tail]')) {
        const t = state.tasks.get(td.dataset.tail);
        if (t) td.replaceWith(tailCell(t));
      }
    } catch (_) { /* the next round tries again */ }
  }
  // A round that began after the job ended read the last lines: stop there (a page
  // change starts one more round through renderTasks).
  state.tailTimer = wasFinal ? null : setTimeout(loadTails, TAIL_POLL_MS);
}

function renderTasks() {
  const list = filteredTasks();
  const pages = Math.max(1, Math.ceil(list.length / TASK_PAGE));
  if (state.taskPage >= pages) state.taskPage = pages - 1;
  const start = state.taskPage * TASK_PAGE;
  const page = list.slice(start, start + TASK_PAGE);
  $('task-rows').replaceChildren(...page.map(taskRow));
  $('t-page').textContent = list.length ? (start + 1) + '–' + (start + page.length) + ' of ' + list.length + (list.length !== state.order.length ? ' (of ' + state.order.length + ')' : '') : 'no tasks match';
  $('t-prev').disabled = state.taskPage === 0;
  $('t-next').disabled = state.taskPage >= pages - 1;
  if (!state.tailTimer && !state.ended) state.tailTimer = setTimeout(loadTails, 0);
}

function selectTask(k) {
  state.selected = k;
  for (const tr of document.querySelectorAll('#task-rows tr')) tr.classList.toggle('selected', tr.dataset.task === k);
  renderDetail();
  renderNodes();
  const t = state.tasks.get(k);
  if (t && t.host) {
    const card = document.querySelector('.node-card[data-host="' + CSS.escape(t.host) + '"]');
    if (card) card.scrollIntoView({ block: 'nearest' });
  }
  loadLog(true);
  loadSelection();
}

// ---------- task detail ----------
function fact(dt, dd, cls) { return [h('dt', null, dt), h('dd', { class: cls || null }, dd)]; }

function renderDetail() {
  const t = state.selected && state.tasks.get(state.selected);
  $('detail').hidden = !t;
  $('detail-empty').hidden = !!t;
  if (!t) { $('detail-title').textContent = 'Select a task'; return; }
  const ds = displayState(t);
  $('detail-title').replaceChildren('Task ', h('span', { class: 'mono' }, key(t)), ' ', h('span', { class: 'state', 'data-state': ds }, ds));
  const ports = (t.ports || []).map(([l, ps]) => l + ':' + ps.join(',')).join('  ');
  $('task-facts').replaceChildren(
    ...fact('host', t.host || 'not placed yet', 'mono'),
    ...fact('GPUs', t.gpus && t.gpus.length ? t.gpus.join(', ') + '  (' + t.gpuMask + ')' + (t.gpuShare ? '  share ' + t.gpuShare + ' of the GPU' : '') : 'none', 'mono'),
    ...(t.resources && Object.keys(t.resources).length ? fact('resources', resText(t.resources), 'mono') : []),
    ...fact('ports', ports || '–', 'mono'),
    ...fact('container', t.containerId || '–', 'mono'),
    ...fact('attempt', t.attempt + (t.retriedCount ? ' (' + t.retriedCount + ' retries counted)' : '')),
    ...fact('launched', fmtTime(t.launchedMs)),
    ...fact('completed', t.completedMs ? fmtTime(t.completedMs) : '–'),
    ...(t.exitCode !== null && t.exitCode !== undefined ? fact('exit', t.exitCode + (t.exitType ? ' · ' + t.exitType : '') + (t.exitDiagnostics ? ' · ' + t.exitDiagnostics : '')) : []));
}

async function loadSelection() {
  const t = state.selected && state.tasks.get(state.selected);
  const panel = $('waiting-panel');
  if (!t) { panel.hidden = true; return; }
  const waiting = ['TASK_WAITING', 'CONTAINER_REQUESTED'].includes(t.state);
  let rec = null;
  try {
    const { body } = await getJSON('/api/v1/selections?limit=1&role=' + encodeURIComponent(t.role) + '&index=' + t.index);
    rec = body.selections[0] || null;
  } catch (_) { rec = null; }
  if (state.selected !== key(t)) return;
  panel.hidden = !rec && !waiting;
  if (panel.hidden) return;
  panel.querySelector('h3').textContent = waiting ? 'Why is this task waiting?' : 'How this task was placed';
  if (!rec) {
    $('waiting-outcome').replaceChildren(waiting && t.reason
      ? h('p', { class: 'outcome', 'data-outcome': 'waiting', 'data-kind': t.reason.kind }, h('b', null, 'not placed'), ' — ', h('span', { class: 'reason' }, reasonText(t.reason)))
      : h('p', null, 'No selection has run for this task yet.'));
    panel.querySelector('tbody').replaceChildren();
    $('waiting-candidates').replaceChildren();
    return;
  }
  // A task that is not placed (waiting, or its ask not yet granted) is never shown as
  // placed: the panel says why it waits, the one reason; its last selection (which may have
  // found a place a gang held back, or an ask the RM has not granted) comes after.
  const where = rec.host ? h('span', { class: 'mono' }, rec.host + ' GPUs ' + (rec.gpus || []).join(',') + (rec.nic ? ' (NIC ' + rec.nic + ')' : '')) : '';
  const found = rec.outcome === 'placed' ? ['found ', where] : [rec.outcome === 'impossible' ? 'found it impossible' : 'found no place'];
  $('waiting-outcome').replaceChildren(waiting
    ? h('p', { class: 'outcome', 'data-outcome': 'waiting', 'data-kind': t.reason ? t.reason.kind : '' }, h('b', null, 'not placed'),
      ' — ', h('span', { class: 'reason' }, reasonText(t.reason) || 'waiting'),
      h('span', { class: 'meta' }, ' (its last selection, ' + fmtTime(rec.atMs) + ', ', ...found, ')'))
    : h('p', { class: 'outcome', 'data-outcome': rec.outcome },
      h('b', null, rec.outcome === 'placed' ? 'placed' : rec.outcome === 'impossible' ? 'impossible on this cluster' : 'not now'),
      rec.host ? ' on ' : '', where,
      rec.reason ? ' — ' + rec.reason : '', h('span', { class: 'meta' }, ' (' + fmtTime(rec.atMs) + ')')));
  const rows = (rec.trace.stages || []).map(s => h('tr', { 'data-stage': s.stage, class: s.nodesOut === 0 ? 'empty' : null },
    h('td', { class: 'mono' }, s.stage),
    h('td', { class: 'mono' }, s.nodesIn + ' → ' + s.nodesOut),
    h('td', null, ...(s.dropped || []).map(g => h('div', { class: 'drop' }, h('b', null, g.count + '× '), g.reason,
      g.hosts && g.hosts.length ? h('span', { class: 'meta mono' }, ' e.g. ' + g.hosts.join(', ') + (g.count > g.hosts.length ? ', …' : '')) : '')),
      s.note ? h('div', { class: 'meta' }, s.note) : '')));
  panel.querySelector('tbody').replaceChildren(...rows);
  const cands = rec.trace.candidates || [];
  $('waiting-candidates').replaceChildren(...(cands.length ? [h('div', { class: 'meta' }, 'best candidates: ',
    ...cands.map(c => h('span', { class: 'mono cand' }, c.host + ' (' + c.freeGpus + ' free GPUs, tier ' + c.gpuTier + (c.gpuTierIdeal ? ' ideal' : '') + (c.jobAffinity ? ', job affinity' : '') + ')')))] : []),
    ...(rec.trace.alternative ? [h('div', { class: 'meta next-best' }, 'next best: ',
      h('span', { class: 'mono' }, rec.trace.alternative.host), ' — lost on ' + rec.trace.alternative.lostOn)] : []));
}

async function loadLog(reset) {
  clearTimeout(state.logTimer);
  state.logTimer = null;
  const view = $('log-view');
  const t = state.selected && state.tasks.get(state.selected);
  if (!t) return;
  const k = key(t);
  const stream = state.stream;
  if (reset) view.textContent = '';
  try {
    const r = await fetch('/api/v1/tasks/' + encodeURIComponent(t.role) + '/' + t.index + '/logs?stream=' + stream + '&tail=' + LOG_TAIL, { cache: 'no-store', headers: authHeaders() });
    if (state.selected !== k || state.stream !== stream) return;
    let text;
    if (r.ok) text = await r.text();
    else { let m = r.status + ''; try { m = (await r.json()).message; } catch (_) { /* keep status */ } text = '(' + m + ')'; }
    const atBottom = view.scrollTop + view.clientHeight >= view.scrollHeight - 8;
    if (view.textContent !== text) {
      view.textContent = text;
      if (atBottom || reset) view.scrollTop = view.scrollHeight;
    }
  } catch (e) {
    view.textContent = '(could not load the log: ' + e.message + ')';
  }
  const cur = state.tasks.get(k);
  const follow = !state.ended && cur && (isLive(cur) || cur.state === 'CONTAINER_COMPLETED');
  $('log-follow').textContent = follow ? 'following (every ' + (LOG_POLL_MS / 1000) + ' s)' : '';
  if (follow) state.logTimer = setTimeout(() => loadLog(false), LOG_POLL_MS);
}

// ---------- nodes ----------
const TIER_LABEL = { 2: 'NVLink', 1: 'PCIe switch', 0: 'socket' };

// Nested frames from node.gpuGroups (islands per tier, best tier first): the outermost
// frames are the lowest tier; groups that are single GPUs or the whole node are skipped.
function gpuTree(node) {
  const n = node.gpuCount || 0;
  const all = n > 0 ? (1n << BigInt(n)) - 1n : parseMask(node.totalGpuMask);
  const groups = node.gpuGroups || [];
  const levels = groups.map((g, i) => ({ tier: Math.max(0, groups.length - 1 - i), masks: (g || []).map(parseMask) })).reverse();
  function build(set, lvl) {
    if (set === 0n) return [];
    if (lvl >= levels.length) return bits(set).map(i => ({ gpu: i }));
    const L = levels[lvl];
    const gs = L.masks.filter(m => (m & set) === m && m !== set && m !== all && popcount(m) > 1);
    let covered = 0n;
    const items = [];
    for (const g of gs) {
      if (g & covered) continue;
      covered |= g;
      items.push({ frame: TIER_LABEL[L.tier] || ('tier ' + L.tier), mask: g, kids: build(g, lvl + 1) });
    }
    items.push(...build(set & ~covered, lvl + 1));
    items.sort((a, b) => (a.gpu !== undefined ? a.gpu : lowestBit(a.mask)) - (b.gpu !== undefined ? b.gpu : lowestBit(b.mask)));
    return items;
  }
  return build(all, 0);
}

// A share "0.25" in hundredths (exact: the wire carries decimals with two places at most).
function hundredths(text) {
  const [u, f = ''] = String(text).split('.');
  return parseInt(u || '0', 10) * 100 + parseInt((f + '00').slice(0, 2), 10);
}
function resText(r) { return Object.entries(r || {}).map(([n, q]) => n + '=' + q).join(', '); }

// Hundredths of GPU i used on the node: its share where it is held in part, else 100 if used.
function usedHundredths(node, i) {
  const s = (node.usedGpuShares || {})[String(i)];
  if (s !== undefined) return hundredths(s);
  return parseMask(node.usedGpuMask) & (1n << BigInt(i)) ? 100 : 0;
}

function gpuLook(node, i) {
  const b = 1n << BigInt(i);
  if (parseMask(node.jobGpuMask) & b) return 'job';
  if (parseMask(node.requestedGpuMask) & b) return 'requested';
  if (parseMask(node.usedGpuMask) & b) return 'other';
  return 'free';
}
const LOOK_TEXT = { free: 'free', other: 'used by another job', job: 'used by this job', requested: 'requested by this job' };

function nodeCard(node, sel) {
  const selGpus = sel && sel.host === node.host ? new Set(sel.gpus || []) : null;
  const owners = new Map();
  // This job's shares per GPU: [{k, h}] (a shared GPU's box is split into them).
  const shares = new Map();
  for (const k of state.order) {
    const t = state.tasks.get(k);
    if (t.host === node.host && isLive(t) || t.host === node.host && t.state === 'CONTAINER_REQUESTED') for (const g of t.gpus || []) {
      owners.set(g, k);
      if (t.gpuShare) { if (!shares.has(g)) shares.set(g, []); shares.get(g).push({ k, h: hundredths(t.gpuShare) }); }
    }
  }
  // A GPU held in part: one segment per task of this job, one for other jobs' shares, the rest free.
  function shareBox(i) {
    const mine = shares.get(i) || [];
    const used = usedHundredths(node, i);
    const others = Math.max(0, used - mine.reduce((a, s) => a + s.h, 0));
    // Widths through the CSSOM: the page's Content-Security-Policy allows no style attributes.
    const seg = (attrs, hh) => { const el = h('span', Object.assign({ class: 'seg', 'data-share': hh }, attrs)); el.style.flex = '0 0 ' + hh + '%'; return el; };
    const segs = mine.map(s => seg({ 'data-look': 'job', 'data-share-task': s.k, title: s.k + ': ' + (s.h / 100).toFixed(2) + ' of GPU ' + i,
      onclick: (e) => { e.stopPropagation(); selectTask(s.k); } }, s.h));
    if (others) segs.push(seg({ 'data-look': 'other', title: 'other jobs: ' + (others / 100).toFixed(2) }, others));
    const free = Math.max(0, 100 - used);
    if (free) segs.push(seg({ 'data-look': 'free', title: 'free: ' + (free / 100).toFixed(2) }, free));
    const text = 'GPU ' + i + ' shared: ' + mine.map(s => s.k + ' ' + (s.h / 100).toFixed(2)).concat(others ? ['other jobs ' + (others / 100).toFixed(2)] : []).join(', ') + '; free ' + (free / 100).toFixed(2);
    return h('span', { class: 'gpu shared', 'data-gpu-box': true, 'data-host': node.host, 'data-gpu': i, 'data-look': 'shared',
      'data-task-gpus': selGpus && selGpus.has(i) ? key(sel) : null, title: text, 'aria-label': text },
      h('span', { class: 'gnum' }, String(i)), h('span', { class: 'segs' }, segs));
  }
  function draw(items) {
    return items.map(it => {
      if (it.gpu !== undefined) {
        if (shares.has(it.gpu) || (node.usedGpuShares || {})[String(it.gpu)] !== undefined) return shareBox(it.gpu);
        const look = gpuLook(node, it.gpu);
        const owner = owners.get(it.gpu);
        return h('span', { class: 'gpu', 'data-gpu-box': true, 'data-host': node.host, 'data-gpu': it.gpu, 'data-look': look,
          'data-task-gpus': selGpus && selGpus.has(it.gpu) ? key(sel) : null,
          title: 'GPU ' + it.gpu + ': ' + LOOK_TEXT[look] + (owner ? ' (' + owner + ')' : ''),
          onclick: owner ? (e) => { e.stopPropagation(); selectTask(owner); } : null }, String(it.gpu));
      }
      return h('span', { class: 'gframe', 'data-group': it.frame }, h('span', { class: 'glabel' }, it.frame), h('span', { class: 'gkids' }, draw(it.kids)));
    });
  }
  const unhealthy = node.state !== 'RUNNING';
  return h('div', { class: 'node-card' + (selGpus ? ' selected' : '') + (unhealthy ? ' unhealthy' : ''), 'data-host': node.host },
    h('div', { class: 'node-head' }, h('b', { class: 'mono' }, node.host), h('span', { class: 'meta' }, ' ' + node.rack + ' · ' + (node.gpuType || '?') + ' · ' + (node.topology || 'topology unknown')),
      unhealthy ? h('span', { class: 'state', 'data-state': 'FAILED' }, node.state) : ''),
    h('div', { class: 'gpus', 'aria-label': 'GPUs of ' + node.host }, draw(gpuTree(node))),
    h('div', { class: 'meta small' }, 'CPU ' + node.usedCpu + '/' + node.totalCpu + (node.requestedCpu ? ' (+' + node.requestedCpu + ' req)' : '') +
      ' · mem ' + Math.round(node.usedMemoryMb / 1024) + '/' + Math.round(node.totalMemoryMb / 1024) + ' GiB · ', h('span', { class: 'ports', title: 'free ports ' + (node.freePorts || '') }, 'free ports ', h('span', { class: 'mono' }, node.freePorts || '–')),
      node.customResources ? h('span', { class: 'custom', 'data-custom': resText(node.customResources) }, ' · ' + Object.entries(node.customResources).map(([n, q]) =>
        n + ' ' + ((node.usedCustomResources || {})[n] || 0) + '/' + q + ' used').join(', ')) : ''));
}

function renderNodes() {
  const sel = state.selected && state.tasks.get(state.selected);
  const text = $('f-node').value.trim();
  const onlyJob = $('f-node-job').checked;
  const jobHosts = new Set();
  for (const k of state.order) { const t = state.tasks.get(k); if (t.host) jobHosts.add(t.host); }
  let hosts = state.nodeOrder.filter(hh => (!text || hh.includes(text)) && (!onlyJob || jobHosts.has(hh) ||
    parseMask((state.nodes.get(hh) || {}).jobGpuMask) || parseMask((state.nodes.get(hh) || {}).requestedGpuMask)));
  if (onlyJob && hosts.length === 0 && !text) hosts = state.nodeOrder.slice();
  // The selected task's node always comes first.
  if (sel && sel.host && state.nodes.has(sel.host)) hosts = [sel.host, ...hosts.filter(x => x !== sel.host)];
  const pages = Math.max(1, Math.ceil(hosts.length / NODE_PAGE));
  if (state.nodePage >= pages) state.nodePage = pages - 1;
  const start = state.nodePage * NODE_PAGE;
  const page = hosts.slice(start, start + NODE_PAGE);
  $('node-cards').replaceChildren(...page.map(hh => nodeCard(state.nodes.get(hh), sel)));
  $('n-page').textContent = hosts.length ? (start + 1) + '–' + (start + page.length) + ' of ' + hosts.length : 'no nodes';
  $('n-prev').disabled = state.nodePage === 0;
  $('n-next').disabled = state.nodePage >= pages - 1;
}

// ---------- live updates ----------
const dirty = { job: false, nodes: false, tasks: new Set(), all: false, selection: false };
let flushTimer = null;
function schedule() { if (!flushTimer && !state.ended) flushTimer = setTimeout(flush, 300); }
async function flush() {
  flushTimer = null;
  const d = { job: dirty.job, nodes: dirty.nodes, tasks: [...dirty.tasks], all: dirty.all, selection: dirty.selection };
  dirty.job = dirty.nodes = dirty.all = dirty.selection = false;
  dirty.tasks.clear();
  try {
    const jobs = [];
    if (d.job || d.all) jobs.push(loadJob());
    if (d.all || d.tasks.length > 40) jobs.push(loadTasks());
    else if (d.tasks.length) jobs.push(Promise.all(d.tasks.map(loadTask)).then(() => { renderTasks(); if (d.tasks.includes(state.selected)) { renderDetail(); loadSelection(); if (!state.logTimer) loadLog(false); } }));
    if (d.nodes || d.all) jobs.push(loadNodes());
    await Promise.all(jobs);
    if (d.selection && state.selected) loadSelection();
    if (d.tasks.length && !d.nodes) renderNodes();
  } catch (e) {
    console.warn('refresh failed', e);
    dirty.all = true;
    setTimeout(schedule, 2000);
  }
}

function onEvent(kind, ev) {
  // Where a stream opened again (with a new ticket) takes up.
  if (ev.lastEventId) state.lastEventId = ev.lastEventId;
  let data = null;
  try { data = JSON.parse(ev.data); } catch (_) { data = null; }
  if (kind === 'task') {
    if (data && data.role !== undefined && data.index !== undefined) dirty.tasks.add(data.role + '/' + data.index);
    else dirty.all = true;
    dirty.job = true;
  } else if (kind === 'job') {
    dirty.job = true;
    // Known at once: the AM of a finished job may be gone before the reload below.
    if (data && data.state && state.job) { state.job.state = data.state; renderJob(); }
  }
  else if (kind === 'nodes') dirty.nodes = true;
  else if (kind === 'selection') {
    dirty.selection = true;
    if (data && data.role !== undefined && data.index !== undefined) dirty.tasks.add(data.role + '/' + data.index);
  } else dirty.all = true;
  schedule();
}

async function connect() {
  // EventSource sends no header, and no credential goes in a URL: the stream takes the
  // job's events ticket, fetched with the page's token in its header.
  const q = [];
  if (state.lastEventId) q.push('lastEventId=' + encodeURIComponent(state.lastEventId));
  try {
    const t = (await getJSON('/api/v1/events-ticket')).body;
    if (t && t.ticket) q.push('token=' + encodeURIComponent(t.ticket));
  } catch (_) { /* the stream then fails and says so */ }
  const url = '/api/v1/events' + (q.length ? '?' + q.join('&') : '');
  const es = new EventSource(url);
  const conn = $('conn');
  es.onopen = () => { conn.hidden = true; };
  es.onerror = () => {
    conn.hidden = false;
    // A finished job's AM goes away after a while: nothing will change any more, so
    // say so rather than try to reconnect forever.
    if (jobFinal()) {
      es.close();
      forget();
      conn.dataset.conn = 'ended';
      conn.textContent = 'job ended · no longer live';
      conn.title = 'The job has finished and its AM has stopped serving; this page shows the final state.';
    } else {
      // The AM has not answered for the whole life of the page's ticket: it is gone (the
      // job may have ended without this page seeing it). Nothing more is asked of that
      // address, which may be another process's by now.
      if (state.ticketExpiresMs && Date.now() > state.ticketExpiresMs) {
        es.close();
        forget();
        conn.dataset.conn = 'gone';
        conn.textContent = 'AM unreachable · no longer live';
        conn.title = 'The job\'s AM has not answered for a while, or this page\'s ticket has ended (12 hours after it was opened); open the job again from the cluster page or `gpuam status`.';
        return;
      }
      conn.dataset.conn = 'reconnecting';
      conn.textContent = 'reconnecting…';
      conn.title = 'The live connection to the AM dropped; retrying.';
      // Refused (an expired ticket, a busy RM): the browser gives up on this URL, so
      // open the stream again with a fresh ticket.
      if (es.readyState === EventSource.CLOSED) setTimeout(connect, 2000);
    }
  };
  for (const k of ['job', 'task', 'nodes', 'selection']) es.addEventListener(k, ev => onEvent(k, ev));
  es.addEventListener('resync', () => { dirty.all = true; schedule(); });
  // A stream lives a while: open it again with a new ticket (no banner, nothing missed).
  es.addEventListener('reopen', () => { es.close(); connect(); });
  es.onmessage = () => { dirty.all = true; schedule(); };
}

// ---------- kill ----------
function setupKill() {
  state.token = pageToken();
  const kill = $('kill');
  if (state.token) { kill.disabled = false; kill.title = 'Kill this job (asks for confirmation)'; }
  kill.addEventListener('click', () => {
    $('kill-job-name').textContent = state.job ? state.job.name : '';
    $('kill-dialog').showModal();
  });
  $('kill-dialog').addEventListener('close', async () => {
    if ($('kill-dialog').returnValue !== 'kill') return;
    const out = $('kill-result');
    out.hidden = false;
    try {
      const r = await fetch('/api/v1/job/kill', { method: 'POST', headers: { Authorization: 'Bearer ' + state.token } });
      let body = {};
      try { body = await r.json(); } catch (_) { /* empty */ }
      out.dataset.ok = r.ok ? 'true' : 'false';
      out.textContent = r.ok ? 'Kill requested; the job is stopping.' : 'Kill refused: ' + (body.message || r.status);
    } catch (e) {
      out.dataset.ok = 'false';
      out.textContent = 'Kill failed: ' + e.message;
    }
    dirty.job = true; schedule();
  });
}

// ---------- wiring ----------
function setup() {
  const fs = $('f-state');
  for (const s of DISPLAY_STATES) fs.append(h('option', { value: s }, s));
  for (const id of ['f-role', 'f-state']) $(id).addEventListener('change', () => { state.taskPage = 0; renderTasks(); });
  $('f-host').addEventListener('input', () => { state.taskPage = 0; renderTasks(); });
  $('t-prev').addEventListener('click', () => { state.taskPage--; renderTasks(); });
  $('t-next').addEventListener('click', () => { state.taskPage++; renderTasks(); });
  $('f-node').addEventListener('input', () => { state.nodePage = 0; renderNodes(); });
  $('f-node-job').addEventListener('change', () => { state.nodePage = 0; renderNodes(); });
  $('n-prev').addEventListener('click', () => { state.nodePage--; renderNodes(); });
  $('n-next').addEventListener('click', () => { state.nodePage++; renderNodes(); });
  for (const r of document.querySelectorAll('input[name=stream]')) r.addEventListener('change', () => { state.stream = r.value; loadLog(true); });
  setupKill();
  // The running time in the header moves even without events.
  setInterval(() => { if (state.job && !state.job.finishedMs) renderJob(); }, 1000);
  // A slow safety net in case an event is lost.
  setInterval(() => { if (!jobFinal()) { dirty.job = true; schedule(); } }, 10000);
}

async function start() {
  setup();
  await trade();
  for (;;) {
    try {
      await loadJob();
      await Promise.all([loadTasks(), loadNodes()]);
      break;
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        // No (or a wrong) token: retrying will not help. Say what the page needs.
        const conn = $('conn');
        conn.hidden = false;
        conn.dataset.conn = 'auth';
        conn.textContent = 'this page needs its token: open the link gpuam printed (…/#token=…)';
        conn.title = 'The job\'s API answers only the job token, its owner\'s user token or the admin token (' + e.message + ').';
        document.body.dataset.auth = 'needed';
        document.body.dataset.ready = 'true';
        return;
      }
      $('conn').hidden = false;
      $('conn').textContent = 'AM unreachable, retrying…';
      await new Promise(r => setTimeout(r, 2000));
    }
  }
  $('conn').textContent = 'reconnecting…';
  $('conn').hidden = true;
  document.body.dataset.ready = 'true';
  connect();
}

start();
