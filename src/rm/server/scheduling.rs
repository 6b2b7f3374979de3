//! The RM's scheduling shell (issue 16): what connects the I/O-free decisions of
//! [`crate::rm::scheduler`] to the ledger, the applications and the nodes.
//!
//! - [`snapshot`]: the scheduler's view of the state (nodes, live containers, every
//!   application's queue, priority and fresh waiting tasks);
//! - [`admit`]: the queue gate of one ask or gang of asks in `allocate`;
//! - [`tick`] (every [`TICK`]): preemption deadlines (the RM stops what was not given back),
//!   new victims (their notices go out in their AMs' next allocate answers and to their
//!   nodes, which create the tasks' `GPUAM_PREEMPT_FILE`), and why each application waits;
//! - [`queue_view`]: shares, use and waiting per queue, for the cluster page and `/metrics`.

use super::transactions::{end_container, Ending, Tell};
use super::*;
use crate::protocol::{now_ms, ContainerState};
use crate::protocol::{Ask, PreemptNotice, WaitingTasks};
use crate::resources::GpuAmount;
use crate::rm::ledger::Ended;
use crate::rm::scheduler::reserved::{self, EndBasis, Expected};
use crate::rm::scheduler::{self, queues::QueueTree, AppDemand, Held, NodeCap, Shares, Snapshot};
use serde::Serialize;
use std::collections::BTreeMap;

/// How often the scheduling pass runs.
pub const TICK: Duration = Duration::from_millis(250);
/// Waiting tasks an AM reported longer ago than this are forgotten (an AM heartbeats
/// every few hundred milliseconds while it has work).
pub const WAITING_TTL: Duration = Duration::from_secs(10);

/// The queues and what the scheduler is doing now (part of [`RmState`]).
pub(super) struct SchedState {
    pub(super) tree: QueueTree,
    pub(super) grace: Duration,
    /// Containers under a preemption notice, by id.
    pub(super) preempting: BTreeMap<String, Preempting>,
    /// Containers taken back so far, per queue they were taken from.
    pub(super) preempted_from: BTreeMap<String, u64>,
    /// Whether some application waited at the last full pass (whose reasons a pass with
    /// nobody waiting must then clear).
    pub(super) waited_last_pass: bool,
    /// Which waiting gangs get a reservation (`rm.reserve_*`, issue 27).
    pub(super) reserve: scheduler::reservation::Policy,
    /// When the start estimates were last computed, and how long that took (see
    /// [`estimates_due`]).
    pub(super) estimated: Option<(Instant, Duration)>,
    /// Whether an [`EstimatePass`] is out (taken, not yet handed back to [`estimated`]):
    /// no other is taken meanwhile.
    pub(super) estimating: bool,
    /// Each user's calibration of declared limits ([`calibrations`]), as of the ledger's
    /// [`crate::rm::ledger::Ledger::used_version`]: computed again (one pass over the
    /// applications) only when an ended run that declared a limit was noted or forgotten,
    /// not at every allocate call that asks for a reservation.
    pub(super) calibrations: std::sync::Mutex<Option<(u64, HashMap<String, Calibration>)>>,
    /// No new preemption victims before this (a restarted RM: see
    /// [`SchedState::quiet_after_restart`]).
    pub(super) no_victims_before: Option<Instant>,
}

/// The reservation policy of the default settings (`rm.reserve_wait_sec`, `rm.reserve_min_gpus`).
pub fn default_reserve_policy() -> scheduler::reservation::Policy {
    let d = crate::config::RmSettings::default();
    reserved::policy(d.reserve_wait_sec, d.reserve_min_gpus)
}

/// How many `POST /ws/v1/cluster/estimate`s are computed at once, at most (one per user).
pub(super) const ESTIMATES: usize = 2;

/// How often the waiting applications' start estimates are computed again, at most.
const ESTIMATE_EVERY: Duration = Duration::from_secs(1);

/// The share of the time the estimates may hold the RM's state, at most: after a pass that
/// took `d`, the next comes no sooner than `d` × this.
const ESTIMATE_SPACING: u32 = 20;

/// Whether the start estimates are due at `now`, after the last ones (when, and how long
/// they took): once per [`ESTIMATE_EVERY`], and on a cluster where they take long (a large,
/// busy one: its walks run off the state, but they still take a CPU) no more than
/// 1/[`ESTIMATE_SPACING`] of the time.
pub(super) fn estimates_due(last: Option<(Instant, Duration)>, now: Instant) -> bool {
    last.is_none_or(|(t, took)| {
        now.saturating_duration_since(t) >= ESTIMATE_EVERY.max(took.saturating_mul(ESTIMATE_SPACING))
    })
}

impl SchedState {
    pub(super) fn new(tree: QueueTree, grace: Duration) -> Self {
        SchedState {
            tree,
            grace,
            preempting: BTreeMap::new(),
            preempted_from: BTreeMap::new(),
            waited_last_pass: true,
            reserve: default_reserve_policy(),
            estimated: None,
            estimating: false,
            calibrations: std::sync::Mutex::new(None),
            no_victims_before: None,
        }
    }

    /// A restarted RM does not know the preemption notices its predecessor gave (they live
    /// in memory): their AMs may be giving the containers back right now, and the agents
    /// reporting them dead. Choosing victims at once would notice others for the same
    /// room, and both would go (tenth pass: three of alice's containers for bob's two
    /// GPUs). So for one grace after `now` it chooses none; what was given back in answer
    /// is seen first, and what still lacks room is noticed then.
    pub(super) fn quiet_after_restart(&mut self, now: Instant) {
        self.no_victims_before = Some(now + self.grace);
    }

    /// Whether new preemption victims may be chosen at `now`.
    pub(super) fn may_choose_victims(&self, now: Instant) -> bool {
        self.no_victims_before.is_none_or(|t| now >= t)
    }

    /// The leaf queue an application's report names (the first leaf when the settings
    /// no longer have it, e.g. after a restart with other queues).
    pub(super) fn leaf_of(&self, report: &crate::protocol::AppReport) -> usize {
        self.tree
            .resolve(Some(&report.queue))
            .unwrap_or_else(|_| self.tree.leaves().next().unwrap_or(0))
    }
}

/// A container being taken back.
#[derive(Clone, Debug)]
pub(super) struct Preempting {
    pub(super) app_id: String,
    pub(super) host: String,
    pub(super) from_queue: String,
    pub(super) for_queue: String,
    pub(super) deadline: Instant,
    pub(super) deadline_ms: u64,
    pub(super) reason: String,
}

/// A snapshot with the ids its indices stand for.
pub(super) struct Built {
    pub(super) snap: Snapshot,
    pub(super) apps: HashMap<String, usize>,
}

/// The scheduler's view of the RM's state now.
pub(super) fn snapshot(st: &RmState, now: Instant) -> Built {
    let wall = now_ms();
    let mut snap = Snapshot::default();
    let mut hosts: HashMap<&str, usize> = HashMap::new();
    for (n, _) in st.ledger.nodes() {
        hosts.insert(&n.host, snap.nodes.len());
        snap.nodes.push(NodeCap::of(n));
    }
    let mut apps: HashMap<String, usize> = HashMap::new();
    let mut add_app = |snap: &mut Snapshot, app: &App| -> usize {
        *apps.entry(app.report.id.clone()).or_insert_with(|| {
            let live = !app.report.state.is_final() && app.registered;
            snap.apps.push(AppDemand {
                id: app.report.id.clone(),
                queue: st.sched.leaf_of(&app.report),
                priority: app.report.priority,
                submitted_ms: app.report.started_time,
                gang: app.gang,
                waiting: if live {
                    app.waiting.current(now, WAITING_TTL).to_vec()
                } else {
                    Vec::new()
                },
            });
            snap.apps.len() - 1
        })
    };
    for app in st.apps.values().filter(|a| !a.report.state.is_final()) {
        add_app(&mut snap, app);
    }
    let mut ids = st.ledger.live_containers();
    ids.sort();
    for id in ids {
        let Some(c) = st.ledger.container(&id) else { continue };
        let Some(&node) = hosts.get(c.container.host.as_str()) else {
            continue;
        };
        let app = match st.apps.get(&c.app_id) {
            Some(a) => add_app(&mut snap, a),
            None => continue,
        };
        let r = &c.container.resources;
        // The GPUs it holds whole, and apart those it holds in part: its queue counts both
        // (in hundredths), and a shared GPU is room again once its last share goes.
        let gpus = if r.gpu_mask != 0 {
            r.whole_gpu_mask()
        } else {
            crate::resources::mask_of_count(r.whole_gpu_count())
        };
        let ended = c.state == ContainerState::Complete;
        let for_queue = st
            .sched
            .preempting
            .get(&id)
            .and_then(|p| st.sched.tree.resolve(Some(&p.for_queue)).ok());
        let preempt_deadline = st.sched.preempting.get(&id).map(|p| p.deadline_ms);
        snap.ends.push(if ended {
            Expected {
                end_ms: Some(wall),
                basis: EndBasis::Leaving,
            }
        } else if let Some(d) = preempt_deadline {
            Expected {
                end_ms: Some(d),
                basis: EndBasis::Leaving,
            }
        } else if let Some(e) = c.declared_end_ms() {
            Expected {
                end_ms: Some(e),
                basis: EndBasis::Declared,
            }
        } else {
            Expected::default()
        });
        snap.held.push(Held {
            container_id: id,
            app,
            node,
            gpus,
            gpu_shares: r.gpu_shares.clone(),
            cpu: r.cpu,
            memory_mb: r.memory_mb,
            ports: r.ports.clone(),
            custom: r.custom.clone(),
            run_ms: if c.state == ContainerState::Running {
                wall.saturating_sub(c.allocated_ms)
            } else {
                0
            },
            leaving: ended || for_queue.is_some(),
            for_queue,
        });
    }
    Built { snap, apps }
}

/// Fills in learned ends (issue 27) for the held containers of `built` whose end is
/// unknown: the median run time of their application's containers of the same role that
/// already completed successfully (else of the same user's earlier runs of the job,
/// [`learned_run_ms`]), from their start; and calibrates declared ends by what their users'
/// ended runs used of their limits ([`calibrations`]).
pub(super) fn learn_ends(st: &RmState, built: &mut Built) {
    learn(st, built, Learn::Ends, None);
}

/// A job not yet submitted (`gpuam plan --rm`), in a snapshot as application [`GUEST`]: whose
/// it is and its name, so its runs are learned from its user's earlier runs of that name.
#[derive(Clone, Copy)]
pub(super) struct Guest<'a> {
    pub user: &'a str,
    /// Its name, when it has one (its runs are learned from its user's runs of that name).
    pub name: Option<&'a str>,
}

/// What [`learn`] fills in besides the held containers' expected ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Learn {
    /// Nothing more (the reservation's pass).
    Ends,
    /// Each waiting application's expected run too, and the draws of the calibrated ends
    /// and runs (an estimate).
    Draws,
}

/// [`learn_ends`], and with [`Learn::Draws`], how long each application of `built` is
/// expected to hold its room once its waiting tasks start ([`reserved::run_of`]: each
/// role's declared `maxRunSec`, calibrated by its user's ended runs when every role declares
/// one, else learned as above), learned together, and the draws of the calibrated ends and
/// runs ([`draw_calibrated`]; a pass over the held containers, so not for the reservation's
/// pass). `guest`: an application of `built` the state does not hold yet.
pub(super) fn learn(st: &RmState, built: &mut Built, what: Learn, guest: Option<Guest>) -> reserved::Expectations {
    // Runs and draws: only for an estimate.
    let estimate = what == Learn::Draws;
    let wall = now_ms();
    let unknown: Vec<usize> = (0..built.snap.held.len())
        .filter(|&h| built.snap.ends.get(h).is_some_and(|e| e.basis == EndBasis::Unknown))
        .collect();
    let held_want = unknown.iter().filter_map(|&h| {
        let c = st.ledger.container(&built.snap.held[h].container_id)?;
        Some((c.app_id.clone(), c.role()?.to_string()))
    });
    let waiting_want = built.snap.apps.iter().filter(|_| estimate).flat_map(|a| {
        a.waiting
            .iter()
            .filter(|w| w.count > 0 && w.max_run_sec.is_none())
            .map(|w| (a.id.clone(), w.role.clone()))
    });
    let learned = learned_run_ms(st, held_want.chain(waiting_want), guest);
    for &h in &unknown {
        let Some(c) = st.ledger.container(&built.snap.held[h].container_id) else {
            continue;
        };
        let ms = c.role().and_then(|r| learned.get(&c.app_id)?.get(r));
        if let Some(ms) = ms {
            // Past the role's median: twice as long again, not "now" at every estimate
            // (`expected_end` lies after `wall`).
            let end = scheduler::reservation::expected_end(c.run_from_ms() as f64, *ms as f64, wall as f64);
            built.snap.ends[h] = Expected {
                end_ms: Some(end as u64),
                basis: EndBasis::Learned,
            };
        }
    }
    let user_of = |id: &str| -> Option<&str> {
        match st.apps.get(id) {
            Some(a) => Some(a.report.user.as_str()),
            None => guest.filter(|_| id == GUEST).map(|g| g.user),
        }
    };
    let mut runs_out: Vec<reserved::Run> = if estimate {
        built
            .snap
            .apps
            .iter()
            .map(|a| reserved::run_of(a, |role| learned.get(&a.id)?.get(role).copied()))
            .collect()
    } else {
        Vec::new()
    };
    // Declared ends and runs, calibrated by what their users' ended runs used of their
    // limits (computed only when something declared one).
    let declares = built.snap.ends.iter().any(|e| e.basis == EndBasis::Declared)
        || runs_out.iter().any(|r| r.basis == EndBasis::Declared);
    if !declares {
        return runs_out.into();
    }
    let cals = calibrations(st);
    let Some((_, cals)) = cals.as_ref() else {
        return runs_out.into();
    };
    let cal_of = |id: &str| user_of(id).and_then(|u| Some((u, cals.get(u)?)));
    // What the draws need: the held containers calibrated (held index, user, share of the
    // limit run so far, limit in ms) and the applications (index, user, declared run in ms).
    let mut held_cal: Vec<(usize, &str, f64, f64)> = Vec::new();
    for h in 0..built.snap.held.len() {
        if built.snap.ends[h].basis != EndBasis::Declared {
            continue;
        }
        let Some(c) = st.ledger.container(&built.snap.held[h].container_id) else {
            continue;
        };
        if let (Some(limit), Some((user, cal))) = (c.max_run_sec, cal_of(&c.app_id)) {
            let (from, limit_ms) = (c.run_from_ms() as f64, limit.saturating_mul(1000) as f64);
            let end = scheduler::reservation::calibrated_end(from, limit_ms, cal.ratio, wall as f64);
            built.snap.ends[h] = Expected {
                end_ms: Some(end.ceil() as u64),
                basis: EndBasis::Calibrated,
            };
            if estimate && limit_ms > 0.0 {
                held_cal.push((h, user, (wall as f64 - from) / limit_ms, limit_ms));
            }
        }
    }
    let mut runs_cal: Vec<(usize, &str, f64)> = Vec::new();
    for (a, (run, app)) in runs_out.iter_mut().zip(&built.snap.apps).enumerate() {
        if let (EndBasis::Declared, Some(ms), Some((user, cal))) = (run.basis, run.ms, cal_of(&app.id)) {
            run.ms = Some(((ms as f64) * cal.ratio).ceil().max(1.0) as u64);
            run.basis = EndBasis::Calibrated;
            if estimate {
                runs_cal.push((a, user, ms as f64));
            }
        }
    }
    let mut out = reserved::Expectations::from(runs_out);
    draw_calibrated(
        &mut out,
        &built.snap,
        &held_cal,
        &runs_cal,
        |u| cals.get(u).map(|c| &c.used[..]),
        wall,
    );
    out
}

/// The draws of the calibrated ends and runs (issue 27, item 4; [`reserved::Expectations`]):
/// per user, a [`Survival`](scheduler::survival::Survival) of the shares of their limits
/// their ended runs used (`used`), their held containers counted as censored at the share
/// run so far; each held container's end is now plus its drawn share left of its limit
/// ([`scheduler::survival::share_left`], at least a second), each application's run its
/// drawn share of its declared run. The draws are seeded by the container's or
/// application's id: the same state gives the same estimate.
fn draw_calibrated<'a>(
    out: &mut reserved::Expectations,
    snap: &Snapshot,
    held: &[(usize, &'a str, f64, f64)],
    runs: &[(usize, &'a str, f64)],
    used: impl Fn(&str) -> Option<&'a [f64]>,
    wall: u64,
) {
    use scheduler::survival::{self, Survival};
    // Each user's held shares (censored), in one pass over the held containers.
    let mut censored: HashMap<&str, Vec<f64>> = runs.iter().map(|r| (r.1, Vec::new())).collect();
    for h in held {
        censored.entry(h.1).or_default().push(h.2.clamp(0.0, 1.0));
    }
    let dists: HashMap<&str, Survival> = censored
        .into_iter()
        .filter_map(|(user, running)| Some((user, Survival::learn(used(user)?, &running)?)))
        .collect();
    let floor = 1000.0;
    for &(h, user, elapsed, limit_ms) in held {
        let Some(d) = dists.get(user) else { continue };
        let Some(u) = survival::hypercube(1, survival::seed_of(&snap.held[h].container_id)).pop() else {
            continue;
        };
        let ends =
            u.map(|u| wall.saturating_add((survival::share_left(d, elapsed, u) * limit_ms).max(floor).ceil() as u64));
        out.drawn_ends.insert(h, ends);
    }
    for &(a, user, run_ms) in runs {
        let Some(d) = dists.get(user) else { continue };
        let Some(u) = survival::hypercube(1, survival::seed_of(&snap.apps[a].id)).pop() else {
            continue;
        };
        out.drawn_runs.insert(
            a,
            u.map(|u| (survival::share_left(d, 0.0, u) * run_ms).max(floor).ceil() as u64),
        );
    }
}

/// A user's calibration of declared limits: the shares of their limits their ended runs
/// used (sorted) and their median ([`scheduler::reservation::calibration`]).
pub(super) struct Calibration {
    ratio: f64,
    used: Vec<f64>,
}

/// Every user's calibration ([`scheduler::reservation::calibration`]): the median of what
/// their ended runs that declared a limit used of it (the ledger's index per application),
/// over their applications the RM keeps; a user with too few such runs has none. Computed
/// in one pass over the applications only when the ledger's index changed since the last
/// time ([`SchedState::calibrations`]), and kept with the index's version.
fn calibrations(st: &RmState) -> std::sync::MutexGuard<'_, Option<(u64, HashMap<String, Calibration>)>> {
    let version = st.ledger.used_version();
    let mut cache = st.sched.calibrations.lock().unwrap_or_else(|e| e.into_inner());
    if cache.as_ref().is_none_or(|(v, _)| *v != version) {
        let mut used: HashMap<&str, Vec<f64>> = HashMap::new();
        for a in st.apps.values() {
            let u = st.ledger.used_of(&a.report.id);
            if !u.is_empty() {
                used.entry(a.report.user.as_str()).or_default().extend_from_slice(u);
            }
        }
        let all = used
            .into_iter()
            .filter_map(|(u, mut used)| {
                let ratio = scheduler::reservation::calibration(&mut used)?;
                Some((u.to_string(), Calibration { ratio, used }))
            })
            .collect();
        *cache = Some((version, all));
    }
    cache
}

/// Learned run times: for each wanted (application, role), the median run time (ms) of that
/// application's containers of the role that completed successfully; where none has yet, of
/// the same user's other runs of the same job name (the RM keeps finished applications and
/// their containers): a job run again is expected to take what it took before. Never another
/// user's: how long their jobs run is theirs. Reads the ledger's index of successful runs
/// ([`crate::rm::ledger::Ledger::runs_of`]) per wanted role, and passes over the
/// applications once when some kin is wanted: never over every container.
fn learned_run_ms<'a>(
    st: &'a RmState,
    want: impl Iterator<Item = (String, String)>,
    guest: Option<Guest<'a>>,
) -> HashMap<String, HashMap<String, u64>> {
    // Whose an application is and its name: the state's, or the guest's.
    let key_of = |id: &str| -> Option<(&str, &str)> {
        match st.apps.get(id) {
            Some(a) => Some((a.report.user.as_str(), a.report.name.as_str())),
            None => guest.filter(|_| id == GUEST).and_then(|g| Some((g.user, g.name?))),
        }
    };
    // Each wanted role's own runs: the ledger keeps each application's successful runs by
    // role (no pass over every container).
    let mut own: HashMap<String, HashMap<String, Vec<u64>>> = HashMap::new();
    for (app, role) in want {
        // The same role is wanted once per held container of it: its runs are copied once.
        if own.get(&app).is_some_and(|roles| roles.contains_key(&role)) {
            continue;
        }
        let runs = st.ledger.runs_of(&app, &role).to_vec();
        own.entry(app).or_default().insert(role, runs);
    }
    if own.is_empty() {
        return HashMap::new();
    }
    // Where a role has none yet: (user, job name) of its application, the roles wanted of
    // it, then one pass over the applications for the same user's runs of that name.
    let mut kin: HashMap<(&str, &str), HashMap<String, Vec<u64>>> = HashMap::new();
    for (id, roles) in &own {
        let Some(key) = key_of(id) else { continue };
        for (r, _) in roles.iter().filter(|(_, v)| v.is_empty()) {
            kin.entry(key).or_default().entry(r.clone()).or_default();
        }
    }
    if !kin.is_empty() {
        for a in st.apps.values() {
            let key = (a.report.user.as_str(), a.report.name.as_str());
            if let Some(roles) = kin.get_mut(&key) {
                for (role, v) in roles.iter_mut() {
                    v.extend_from_slice(st.ledger.runs_of(&a.report.id, role));
                }
            }
        }
    }
    let median = |v: &mut Vec<u64>| -> Option<u64> {
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    let mut out: HashMap<String, HashMap<String, u64>> = HashMap::new();
    for (app, roles) in own {
        let key = key_of(&app);
        let mut medians = HashMap::new();
        for (role, mut runs) in roles {
            let m = median(&mut runs).or_else(|| {
                let runs = kin.get_mut(&key?)?.get_mut(&role)?;
                median(runs)
            });
            if let Some(m) = m {
                medians.insert(role, m);
            }
        }
        out.insert(app, medians);
    }
    out
}

/// Some application besides `app_id`, not ended, has tasks waiting by its AM's fresh report.
/// Also told to each AM in its allocate answer (`othersWaiting`), where its placement packs
/// nodes first while others wait (issue 27).
pub(super) fn others_waiting(st: &RmState, app_id: &str, now: Instant) -> bool {
    st.apps
        .any_reporting_waiting(|a| a.report.id != app_id && !a.waiting.current(now, WAITING_TTL).is_empty())
}

/// The queue gate of one ask, or of one gang's asks (all or none), of `app_id` (see
/// [`scheduler::gate`]); a gang must also fit now as a whole. `Err`: why it waits.
pub(super) fn admit(st: &RmState, app_id: &str, asks: &[&Ask], now: Instant) -> Result<(), crate::reason::Reason> {
    if asks.len() > 1 {
        gang_fits(&st.ledger, asks).map_err(|e| crate::reason::Reason::new(crate::reason::Kind::Resources, e))?;
    }
    // Fast path: no cap on the way and nobody else waiting: nothing to keep room for.
    let capped = st.apps.get(app_id).is_some_and(|a| {
        let leaf = st.sched.leaf_of(&a.report);
        st.sched
            .tree
            .lineage(leaf)
            .any(|q| st.sched.tree.get(q).max_gpus.is_some())
    });
    if !capped && !others_waiting(st, app_id, now) {
        return Ok(());
    }
    // Room for everyone waiting besides this ask: the gate would pass it (without the
    // snapshot's O(nodes + containers) and the reservation's O(waiting × nodes)).
    if !capped && room_for_others(st, app_id, asks, now) {
        return Ok(());
    }
    let built = snapshot(st, now);
    let Some(&app) = built.apps.get(app_id) else {
        return Ok(());
    };
    let hosts: HashMap<&str, usize> = built
        .snap
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.host.as_str(), i))
        .collect();
    let mapped: Vec<(usize, crate::resources::Resources)> = asks
        .iter()
        .filter_map(|a| Some((*hosts.get(a.host.as_str())?, a.resources())))
        .collect();
    let mut built = built;
    let shares = Shares::compute(&st.sched.tree, &built.snap);
    let wall = now_ms();
    let holder = if reserved::candidates(&built.snap, &st.sched.reserve, wall) {
        learn_ends(st, &mut built);
        reserved::holder(&built.snap, &shares, &st.sched.reserve, wall)
    } else {
        None
    };
    // The asks' declared end: the latest of theirs (`None` when one declares none).
    let end_ms = asks
        .iter()
        .map(|a| a.max_run_sec.map(|s| wall.saturating_add(s.saturating_mul(1000))))
        .try_fold(wall, |acc, e| e.map(|e| acc.max(e)));
    scheduler::gate_reserved(
        &st.sched.tree,
        &built.snap,
        &shares,
        app,
        &mapped,
        holder.as_ref(),
        end_ms,
        wall,
    )
    .map_err(|w| w.reason())
}

/// [`scheduler::room_for_all_waiting`] for an ask of `app_id`: the other live
/// applications' waiting tasks against the nodes the asks do not touch, in the pool (GPU
/// type) of the first ask that takes GPUs (whole or in part, as the gate picks it).
fn room_for_others(st: &RmState, app_id: &str, asks: &[&Ask], now: Instant) -> bool {
    let waiting = st
        .apps
        .values()
        .filter(|a| a.report.id != app_id && !a.report.state.is_final())
        .flat_map(|a| a.waiting.current(now, WAITING_TTL));
    let pool = asks
        .iter()
        .find(|a| a.resources().hundredths() > 0)
        .map(|a| st.ledger.node(&a.host).map(|n| n.gpu_type.clone().unwrap_or_default()));
    let nodes = st
        .ledger
        .nodes()
        .map(|(n, _)| n)
        .filter(|n| asks.iter().all(|a| a.host != n.host))
        .filter(|n| match &pool {
            Some(Some(p)) => n.gpu_type.as_deref().unwrap_or_default() == p,
            // The ask's node is gone: the gate decides.
            Some(None) => false,
            None => true,
        })
        .map(NodeCap::of);
    scheduler::room_for_all_waiting(waiting, nodes)
}

/// Whether every ask of a gang fits now, together (each on what the earlier ones leave).
fn gang_fits(ledger: &Ledger, asks: &[&Ask]) -> Result<(), String> {
    let mut free: HashMap<&str, crate::resources::Resources> = HashMap::new();
    for a in asks {
        let Some(node) = ledger.node(&a.host) else {
            return Err(format!("gang not granted whole: unknown host `{}`", a.host));
        };
        let f = free
            .entry(a.host.as_str())
            .or_insert_with(|| node.total().subtract(node.used()));
        let want = a.resources();
        if node.state != crate::cluster::NodeState::Running || !want.fits_in(f) {
            return Err(format!(
                "gang not granted whole: its ask {} does not fit on `{}` now",
                a.request_id, a.host
            ));
        }
        *f = f.subtract(&want);
    }
    Ok(())
}

/// Groups an allocate's asks: each gang id's asks together (at the place of its first),
/// every other ask alone.
pub(super) fn group_asks(asks: &[Ask]) -> Vec<Vec<&Ask>> {
    let mut out: Vec<Vec<&Ask>> = Vec::new();
    let mut gangs: HashMap<&str, usize> = HashMap::new();
    for a in asks {
        match a.gang.as_deref() {
            Some(g) => match gangs.get(g) {
                Some(&i) => out[i].push(a),
                None => {
                    gangs.insert(g, out.len());
                    out.push(vec![a]);
                }
            },
            None => out.push(vec![a]),
        }
    }
    out
}

/// The notices an application's allocate answer carries: its containers under notice
/// that still run for it.
pub(super) fn notices_for(st: &RmState, app_id: &str) -> Vec<PreemptNotice> {
    st.sched
        .preempting
        .iter()
        .filter(|(id, p)| {
            p.app_id == app_id
                && st
                    .ledger
                    .container(id)
                    .is_some_and(|c| c.state != ContainerState::Complete)
        })
        .map(|(id, p)| PreemptNotice {
            container_id: id.clone(),
            deadline_ms: p.deadline_ms,
            reason: p.reason.clone(),
        })
        .collect()
}

/// Diagnostics of a preempted container's end.
pub(super) fn preempted_diagnostics(p: &Preempting) -> String {
    format!("Container preempted for queue `{}`: {}", p.for_queue, p.reason)
}

/// How a container's end is reported: one under a preemption notice was preempted (its
/// task may have checkpointed and exited by itself, with any code), so it is retried as
/// such whatever its application saw first.
pub(super) fn exit_of(st: &RmState, id: &str, exit: i32, diagnostics: String) -> (i32, String) {
    match st.sched.preempting.get(id) {
        Some(p) => (
            exit_status::PREEMPTED,
            format!("{} (the task exited {exit})", preempted_diagnostics(p)),
        ),
        None => (exit, diagnostics),
    }
}

/// What one pass asks the I/O side to do.
#[derive(Default)]
pub(super) struct TickWork {
    /// Containers stopped at their deadline (or freed when never started).
    pub(super) ended: Vec<Ended>,
    /// (host, container, deadline, reason) of new notices for running containers.
    pub(super) notify: Vec<(String, String, u64, String)>,
    /// The start estimates due, to walk off the state ([`EstimatePass::walk`]) and then
    /// hand back ([`estimated`]).
    pub(super) estimates: Option<EstimatePass>,
}

/// One scheduling pass's start estimates (issue 27), taken out of the state: the
/// snapshot, the reservation and what was learned of the ends and runs. Their walks (the
/// point walk and, with drawn ends, [`scheduler::survival::DRAWS`] more: 10–40 ms each on a
/// busy 10,000-node cluster) run off the RM's state lock and off the async workers; only
/// [`estimated`] takes the lock again, to write what they found.
pub(super) struct EstimatePass {
    input: EstimateInput,
    /// Why the pass's plan found each application of the snapshot waiting (by its index).
    why: Vec<Option<scheduler::WaitReason>>,
    /// When the pass was taken (its spacing counts from here).
    began: Instant,
}

/// What an [`EstimatePass`]'s walks found: every application's estimate, and what the
/// walks cost.
pub(super) struct Walked {
    pass: EstimatePass,
    estimates: Vec<Option<reserved::StartEstimate>>,
    took: Duration,
}

impl EstimatePass {
    /// The walks: the only part that takes long, and needs nothing of the state.
    pub(super) fn walk(self) -> Walked {
        let t = Instant::now();
        let estimates = self.input.walk();
        Walked {
            pass: self,
            estimates,
            took: t.elapsed(),
        }
    }
}

/// Writes what an [`EstimatePass`]'s walks found (`None`: they failed; nothing is written),
/// and lets the next pass be taken once [`estimates_due`]. An application that has started
/// or gone since the pass was taken gets nothing; one still waiting gets its estimate and,
/// where it waits behind the reservation and nothing else names a cause, that cause.
pub(super) fn estimated(st: &mut RmState, walked: Option<Walked>) {
    st.sched.estimating = false;
    let Some(Walked {
        pass,
        mut estimates,
        took,
    }) = walked
    else {
        return;
    };
    st.sched.estimated = Some((pass.began, took));
    let EstimatePass { input, why, .. } = pass;
    let wall = input.wall;
    for (id, &a) in &input.built.apps {
        let Some(app) = st.apps.get_mut(id) else { continue };
        let why = why.get(a).cloned().flatten();
        if app.report.state.is_final() || app.waiting.since_ms.is_none() {
            app.waiting.estimate = None;
            continue;
        }
        let queue_cause = why.as_ref().filter(|w| w.reason().kind.is_queue()).map(|w| w.code());
        let est = estimates
            .get_mut(a)
            .and_then(Option::take)
            .map(|e| reserved::held_by_queue(e, queue_cause, wall));
        let behind_reservation = est.as_ref().is_some_and(|e| e.after_reservation_of.is_some())
            && matches!(why, None | Some(scheduler::WaitReason::NothingFits));
        match (&input.holder, behind_reservation) {
            (Some(h), true) => app.waiting.set_why(Some(&scheduler::WaitReason::Reserved {
                gang: reserved::holder_label(&input.built.snap, h),
                start_ms: h.reservation.start_ms,
                now_ms: wall,
            })),
            // A reservation cause kept from the last estimates that no longer holds.
            _ if app.waiting.why.as_ref().is_some_and(|(c, _)| *c == "reserved") => app.waiting.set_why(why.as_ref()),
            _ => {}
        }
        app.waiting.estimate = est;
    }
}

/// The running containers past their declared run-time limit at `wall` (ms since the
/// epoch): (id, limit in seconds). See [`crate::rm::ledger::LedgerContainer::declared_end_ms`].
fn past_limit(st: &RmState, wall: u64) -> Vec<(String, u64)> {
    st.ledger
        .live_containers()
        .into_iter()
        .filter_map(|id| {
            let c = st.ledger.container(&id)?;
            let limit = c.max_run_sec?;
            let due = c.state == ContainerState::Running && c.started_ms > 0 && c.declared_end_ms()? <= wall;
            due.then_some((id, limit))
        })
        .collect()
}

/// Ends the containers past their declared limit (issue 27): stopped by the RM, their
/// application told with the typed cause's words ([`crate::protocol::EndCause::RunLimit`]),
/// which the AM counts as the task's failure.
fn end_past_limit(st: &mut RmState, wall: u64) -> Vec<Ended> {
    let mut ended = Vec::new();
    for (id, max_run_sec) in past_limit(st, wall) {
        let why = crate::protocol::EndCause::RunLimit { max_run_sec }.diagnostics();
        if let Some(e) = end_container(
            st,
            &id,
            Ending::Stopped,
            exit_status::KILLED_BY_RESOURCEMANAGER,
            &why,
            Tell::App,
        ) {
            tracing::info!(container = %id, "{why}: stopping the container");
            ended.push(e);
        }
    }
    ended
}

/// One scheduling pass under the lock (see the module doc).
pub(super) fn tick(st: &mut RmState, now: Instant) -> TickWork {
    let mut work = TickWork::default();
    // Forget notices of containers that are dead; stop those past their deadline.
    let ids: Vec<String> = st.sched.preempting.keys().cloned().collect();
    for id in ids {
        let Some(c) = st.ledger.container(&id) else {
            st.sched.preempting.remove(&id);
            continue;
        };
        let dead = c.state == ContainerState::Complete && !c.held;
        if dead {
            st.sched.preempting.remove(&id);
            continue;
        }
        let due = st.sched.preempting.get(&id).is_some_and(|p| now >= p.deadline);
        if due && c.state != ContainerState::Complete {
            let diag = st
                .sched
                .preempting
                .get(&id)
                .map(preempted_diagnostics)
                .unwrap_or_default();
            if let Some(e) = end_container(st, &id, Ending::Stopped, exit_status::PREEMPTED, &diag, Tell::App) {
                tracing::info!(container = %id, "preemption deadline passed: stopping the container");
                work.ended.push(e);
            }
        }
    }
    work.ended.extend(end_past_limit(st, now_ms()));
    // New victims and why each application waits: only while some application waits
    // (and once more after, to clear the reasons), so that an idle pass costs
    // O(applications), not O(nodes) (issue 29).
    let waiting = st
        .apps
        .values()
        .any(|a| a.registered && !a.report.state.is_final() && !a.waiting.current(now, WAITING_TTL).is_empty());
    let estimates_left = st.apps.values().any(|a| a.waiting.estimate.is_some());
    if !waiting && !st.sched.waited_last_pass && !estimates_left {
        return work;
    }
    st.sched.waited_last_pass = waiting;
    // New victims and why each application waits.
    let built = snapshot(st, now);
    let shares = Shares::compute(&st.sched.tree, &built.snap);
    let plan = scheduler::plan(&st.sched.tree, &built.snap, &shares);
    let deadline_ms = now_ms() + st.sched.grace.as_millis() as u64;
    let victims = if st.sched.may_choose_victims(now) {
        &plan.victims[..]
    } else {
        &[]
    };
    for v in victims {
        let from = st.sched.tree.get(built.snap.apps[v.app].queue).path.clone();
        let for_queue = st.sched.tree.get(v.for_queue).path.clone();
        for &h in &v.held {
            let held = &built.snap.held[h];
            let Some(c) = st.ledger.container(&held.container_id) else {
                continue;
            };
            let (host, state, app_id) = (c.container.host.clone(), c.state, c.app_id.clone());
            tracing::info!(
                container = %held.container_id, from = %from, to = %for_queue,
                "preempting: {}", v.reason
            );
            *st.sched.preempted_from.entry(from.clone()).or_default() += 1;
            if state == ContainerState::Running {
                work.notify
                    .push((host.clone(), held.container_id.clone(), deadline_ms, v.reason.clone()));
            }
            if let Some(app) = st.apps.get(&app_id) {
                app.wake.notify_one();
            }
            st.sched.preempting.insert(
                held.container_id.clone(),
                Preempting {
                    app_id,
                    host,
                    from_queue: from.clone(),
                    for_queue: for_queue.clone(),
                    deadline: now + st.sched.grace,
                    deadline_ms,
                    reason: v.reason.clone(),
                },
            );
        }
    }
    for (id, &a) in &built.apps {
        let Some(app) = st.apps.get_mut(id) else { continue };
        let why = plan.why.get(a).cloned().flatten();
        // Keep the last estimates' reservation cause until they are computed again.
        let reserved_kept = app.waiting.why.as_ref().is_some_and(|(c, _)| *c == "reserved")
            && matches!(why, None | Some(scheduler::WaitReason::NothingFits));
        if !reserved_kept {
            app.waiting.set_why(why.as_ref());
        }
    }
    // Start estimates (issue 27), when due and none are out: one reservation, then each
    // waiting application's expected start by the same rule, walked off the state
    // ([`EstimatePass`]).
    if !st.sched.estimating && estimates_due(st.sched.estimated, now) {
        let mut built = built;
        let wall = now_ms();
        let runs = learn(st, &mut built, Learn::Draws, None);
        let holder = reserved::holder(&built.snap, &shares, &st.sched.reserve, wall);
        let why = (0..built.snap.apps.len())
            .map(|a| plan.why.get(a).cloned().flatten())
            .collect();
        st.sched.estimating = true;
        work.estimates = Some(EstimatePass {
            input: EstimateInput {
                built,
                shares,
                holder,
                runs,
                me: None,
                wall,
            },
            why,
            began: now,
        });
    }
    work
}

/// One queue as the cluster page and `/metrics` show it.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct QueueView {
    pub(super) name: String,
    pub(super) parent: Option<String>,
    pub(super) leaf: bool,
    pub(super) weight: f64,
    pub(super) guaranteed_gpus: u32,
    pub(super) max_gpus: Option<u32>,
    pub(super) users: Option<Vec<String>>,
    pub(super) priority_preemption: bool,
    /// Summed over the pools.
    pub(super) deserved_gpus: f64,
    /// Fractional where the queue holds GPU shares (an integer on the wire when whole).
    pub(super) used_gpus: GpuAmount,
    pub(super) waiting_gpus: GpuAmount,
    pub(super) waiting_tasks: u32,
    /// Containers taken back from it so far, and those under notice now.
    pub(super) preempted: u64,
    pub(super) preempting_now: u32,
    pub(super) pools: Vec<PoolView>,
}

/// One queue's share of one GPU type.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PoolView {
    pub(super) gpu_type: String,
    pub(super) capacity: u32,
    pub(super) deserved: f64,
    /// GPUs held, and GPUs of waiting tasks: fractional where shares count (an integer on
    /// the wire when whole, so whole-GPU figures read as before).
    pub(super) used: GpuAmount,
    pub(super) waiting: GpuAmount,
}

/// Every queue's deserved share, use, waiting work and preemptions now.
pub(super) fn queue_view(st: &RmState, now: Instant) -> Vec<QueueView> {
    let built = snapshot(st, now);
    let shares = Shares::compute(&st.sched.tree, &built.snap);
    let tree = &st.sched.tree;
    tree.iter()
        .map(|(q, queue)| {
            let pools: Vec<PoolView> = shares
                .pools
                .iter()
                .enumerate()
                .map(|(p, name)| PoolView {
                    gpu_type: name.clone(),
                    capacity: shares.capacity[p],
                    deserved: shares.deserved[p][q],
                    used: shares.used_gpus(p, q),
                    waiting: GpuAmount(shares.waiting[p][q]),
                })
                .collect();
            let in_queue = |path: &str| {
                path == queue.path || tree.resolve(Some(path)).is_ok_and(|l| tree.lineage(l).any(|x| x == q))
            };
            QueueView {
                name: queue.path.clone(),
                parent: queue.parent.map(|p| tree.get(p).path.clone()),
                leaf: queue.is_leaf(),
                weight: queue.weight,
                guaranteed_gpus: queue.guaranteed_gpus,
                max_gpus: queue.max_gpus,
                users: queue.users.clone(),
                priority_preemption: queue.priority_preemption,
                deserved_gpus: pools.iter().map(|p| p.deserved).sum(),
                used_gpus: GpuAmount(shares.used_total[q]),
                waiting_gpus: pools.iter().map(|p| p.waiting).max().unwrap_or_default(),
                waiting_tasks: shares.waiting_tasks[q],
                preempted: st
                    .sched
                    .preempted_from
                    .iter()
                    .filter(|(from, _)| in_queue(from))
                    .map(|(_, n)| n)
                    .sum(),
                preempting_now: st.sched.preempting.values().filter(|p| in_queue(&p.from_queue)).count() as u32,
                pools,
            }
        })
        .collect()
}

/// `POST /ws/v1/cluster/estimate` (issue 27): when a job not yet submitted would start if
/// it were submitted now, by the same rule as a waiting one's estimate (the caller's own
/// job, added to the state's snapshot as the newest application of its queue).
pub(super) async fn post_estimate(
    axum::extract::State(rm): Rm,
    caller: super::http::Caller,
    super::http::ApiJson(req): super::http::ApiJson<crate::protocol::EstimateRequest>,
) -> Result<axum::Json<crate::protocol::StartEstimate>, ApiError> {
    check_waiting(&req.waiting).map_err(ApiError::bad_request)?;
    if let Some(name) = req.name.as_deref() {
        crate::spec::validate::check_job_name(name)
            .map_err(|(what, fix)| ApiError::bad_request(format!("`name`: {what}; {fix}")))?;
    }
    let Some(turn) = rm.estimating.try_acquire(caller.name()) else {
        let mut busy = ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "busy",
            "as many start estimates as the RM computes at once are being computed (or one of \
             yours is); try again in a second",
        );
        busy.retry_after = Some(1);
        return Err(busy);
    };
    // The snapshot and what is learned need the state; the walk does not: it runs after
    // the lock is let go, off the async workers, so a caller asking again and again never
    // holds the RM's state for the walk's time.
    let input = {
        let st = rm.lock();
        // Only a queue the caller may submit to (the admin: any), as at submit: another
        // queue's state is none of theirs.
        let queue = st
            .sched
            .tree
            .admit(req.queue.as_deref(), caller.name())
            .map_err(super::applications::queue_refused)?;
        estimate_input(&st, queue, caller.name(), &req, Instant::now())
    };
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        input.estimate()
    })
    .await
    .map(axum::Json)
    .map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("the start estimate failed: {e}"),
        )
    })
}

/// What [`reserved::estimates`] needs, taken from the state: for a scheduling pass
/// ([`EstimatePass`]), or for a job not yet submitted ([`post_estimate`]: the state's
/// snapshot with the job added as the newest application of its queue, `me`).
struct EstimateInput {
    built: Built,
    shares: Shares,
    holder: Option<reserved::Holder>,
    runs: reserved::Expectations,
    me: Option<usize>,
    wall: u64,
}

impl EstimateInput {
    /// Every application's estimate (their walks: no state needed).
    fn walk(&self) -> Vec<Option<reserved::StartEstimate>> {
        reserved::estimates(
            &self.built.snap,
            &self.shares,
            self.holder.as_ref(),
            &self.runs,
            self.wall,
            self.me,
        )
    }

    /// The job not yet submitted's estimate.
    fn estimate(self) -> crate::protocol::StartEstimate {
        let me = self.me;
        me.and_then(|me| self.walk().into_iter().nth(me).flatten())
            .unwrap_or_else(|| reserved::nothing_waits(self.wall))
    }
}

/// The application id a job not yet submitted has in an estimate's snapshot (no real id
/// has parentheses).
pub(super) const GUEST: &str = "(this job)";

fn estimate_input(
    st: &RmState,
    queue: usize,
    user: &str,
    req: &crate::protocol::EstimateRequest,
    now: Instant,
) -> EstimateInput {
    let wall = now_ms();
    let mut built = snapshot(st, now);
    built.snap.apps.push(AppDemand {
        id: GUEST.into(),
        queue,
        priority: req.priority,
        submitted_ms: wall,
        gang: req.gang,
        waiting: req.waiting.clone(),
    });
    let me = built.snap.apps.len() - 1;
    let guest = Some(Guest {
        user,
        name: req.name.as_deref(),
    });
    let runs = learn(st, &mut built, Learn::Draws, guest);
    let shares = Shares::compute(&st.sched.tree, &built.snap);
    let holder = reserved::holder(&built.snap, &shares, &st.sched.reserve, wall);
    EstimateInput {
        built,
        shares,
        holder,
        runs,
        me: Some(me),
        wall,
    }
}

/// The waiting tasks of an allocate request, checked: counts and sizes within reason.
pub(super) fn check_waiting(tasks: &[WaitingTasks]) -> Result<(), String> {
    if tasks.len() > crate::spec::limits::MAX_TASK_ROLES * 4 {
        return Err(format!(
            "`waiting` has {} entries; at most one per task role",
            tasks.len()
        ));
    }
    for (i, t) in tasks.iter().enumerate() {
        if u64::from(t.count) > crate::spec::limits::MAX_TOTAL_TASKS || u64::from(t.gpus) > 64 {
            return Err(format!(
                "`waiting[{i}]`: count {} or gpus {} is out of range (count ≤ {}, gpus ≤ 64)",
                t.count,
                t.gpus,
                crate::spec::limits::MAX_TOTAL_TASKS
            ));
        }
        let max = crate::spec::limits::MAX_RUN_SEC as u64;
        if let Some(s) = t.max_run_sec.filter(|s| !(1..=max).contains(s)) {
            return Err(format!(
                "`waiting[{i}].maxRunSec`: {s} is out of range (whole seconds, 1..={max})"
            ));
        }
    }
    Ok(())
}
