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
