// Why a task or a job waits, in the words every surface shows: the one rendering of the
// structured reason (src/reason.rs: kind, detail, sinceMs, untilMs, task) on the pages.
// `Reason::text` writes the same line for the terminal (gpuam status, jobs, run); a test
// holds the two to the same text. Loaded by the job page and the cluster page.
'use strict';

const REASON_LABEL = {
  Starting: 'Starting', Resources: 'Resources', Topology: 'Topology', Gang: 'Gang',
  QueueShare: 'Queue share', Priority: 'Priority', Reclaiming: 'Reclaiming',
  Impossible: 'Impossible', Requested: 'Requested', Retry: 'Retry',
};

// HH:MM:SS UTC of milliseconds since the epoch.
function reasonClock(ms) { return new Date(ms).toISOString().slice(11, 19) + ' UTC'; }

// `Topology (worker/0): holding out … [since 18:30:02 UTC, until 18:35:02 UTC]`; '' for none.
function reasonText(r) {
  if (!r) return '';
  let out = (REASON_LABEL[r.kind] || r.kind) + (r.task ? ' (' + r.task + ')' : '') + ': ' + r.detail;
  const times = [];
  if (r.sinceMs !== undefined && r.sinceMs !== null) times.push('since ' + reasonClock(r.sinceMs));
  if (r.untilMs !== undefined && r.untilMs !== null) times.push('until ' + reasonClock(r.untilMs));
  if (times.length) out += ' [' + times.join(', ') + ']';
  return out;
}

// `90s`, `12m`, `3h05m`, `2d04h` (as the terminal's `short_duration`).
function estimateDuration(ms) {
  const s = Math.floor(ms / 1000);
  const p2 = n => String(n).padStart(2, '0');
  if (s < 120) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm';
  if (s < 86400) return Math.floor(s / 3600) + 'h' + p2(Math.floor(s % 3600 / 60)) + 'm';
  return Math.floor(s / 86400) + 'd' + p2(Math.floor(s % 86400 / 3600)) + 'h';
}

// When a waiting job is expected to start, with the RM's basis (issue 27, the protocol's
// StartEstimate): the words of `gpuam status` (cli::jobs::estimate_line).
function estimateText(e) {
  if (!e) return '';
  if (!e.startMs) return 'expected start: ' + e.text;
  const now = Date.now();
  const at = (t) => new Date(t).toISOString().slice(5, 16).replace('T', ' ') +
    ' UTC (in ' + estimateDuration(t - now) + ')';
  // A job that is no gang: its waiting tasks start one by one.
  const all = e.allStartMs && e.allStartMs > now ? ', all its waiting tasks by ' + at(e.allStartMs) : '';
  if (e.startMs <= now) return 'expected to start now' + all + '; basis: ' + e.text;
  return 'expected to start ' + at(e.startMs) + all + '; basis: ' + e.text;
}
