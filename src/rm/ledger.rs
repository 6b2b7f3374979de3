//! The scheduler ledger: every node's total and used resources and every container's
//! life (Allocated → Running → Complete). Pure bookkeeping — no I/O, no clocks of its
//! own (callers pass `now`) — so it can be property-tested.
//!
//! The one rule it exists for: an ask is granted only when every GPU bit, port, CPU
//! and MB it names is free on its host at that moment, and then exactly as asked.
//! An ask must name some CPU or memory, so a node holds a bounded number of containers.
//!
//! Usage is kept incrementally: each node carries the sum of its live containers, a grant
//! adds exactly its resources and a free takes exactly them away, so granting costs the
//! same whatever the node's container count. A node's `used` is its baseline (what the
//! cluster file says is already taken by others) plus that sum. [`Ledger::audit_usage`]
//! recomputes every node's use from its containers and compares: the tests and property
//! tests call it after every step.
//!
//! Freed only when dead (DESIGN.md §9): a container the RM ends while it runs (AM release,
//! kill, node LOST) is [`Ledger::stop`]ped — Complete for its application, but `held`: its
//! resources stay used until its node reports it dead ([`Ledger::complete`]), so the next
//! grant on those GPUs can never overlap a process that still runs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cluster::{Node, NodeState};
use crate::protocol::{exit_status, Ask, Container, ContainerState, Rejection};
use crate::resources::{format_hundredths, mask_hex, Resources, Shortfall};

/// Default time a granted container may stay unstarted (YARN's 10 minutes).
pub const DEFAULT_CONTAINER_EXPIRY: Duration = Duration::from_secs(600);

pub const DIAG_EXPIRED: &str = crate::protocol::AbortCause::Expired.diagnostics();
pub const DIAG_LOST_NODE: &str = crate::protocol::AbortCause::NodeLost.diagnostics();

/// One container as the ledger tracks it (and as the RM's store persists it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LedgerContainer {
    pub container: Container,
    pub app_id: String,
    pub attempt: u32,
    pub state: ContainerState,
    /// For the expiry clock; rebuilt from `allocated_ms` when the RM restarts.
    #[serde(skip, default = "Instant::now")]
    pub allocated_at: Instant,
    /// Wall-clock grant time (milliseconds since the epoch).
    #[serde(default)]
    pub allocated_ms: u64,
    pub exit_status: Option<i32>,
    pub diagnostics: String,
    /// Complete for its application, but its processes may still run: its resources stay
    /// used until the node reports it dead (see the module doc).
    #[serde(default)]
    pub held: bool,
    /// Wall-clock time it ended for its application (milliseconds since the epoch; 0
    /// while live): with `allocated_ms`, the GPU time a job's history row counts.
    #[serde(default)]
    pub ended_ms: u64,
    /// Wall-clock time its executor started it (0 until then, and for containers an
    /// older RM stored): its declared limit runs from here.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub started_ms: u64,
    /// The declared run-time limit its ask carried (`maxRunSec`, issue 27): the RM ends it
    /// past `started_ms` + this, and counts on its room coming back then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_sec: Option<u64>,
}

fn is_zero_ms(ms: &u64) -> bool {
    *ms == 0
}

impl LedgerContainer {
    /// The role of its task ("role/index"), if it serves one.
    pub fn role(&self) -> Option<&str> {
        let (role, index) = crate::protocol::split_task(self.container.task.as_deref()?);
        index.map(|_| role)
    }

    /// How long it ran, when it completed successfully (exit 0, with an end time): what
    /// the RM learns expected run times from (issue 27). `None` otherwise.
    pub fn successful_run_ms(&self) -> Option<u64> {
        (self.state == ContainerState::Complete && self.exit_status == Some(0) && self.ended_ms != 0)
            .then(|| self.ended_ms.saturating_sub(self.run_from_ms()))
    }

    /// What it used of its declared limit (run / limit, at most 1), when it declared one and
    /// ended successfully or by that limit: what calibrates the declared ends of its user's
    /// other runs (issue 27, item 4). `None` otherwise (a failure says little of a habit).
    pub fn used_of_limit(&self) -> Option<f64> {
        let limit_ms = self.max_run_sec.filter(|&s| s > 0)?.saturating_mul(1000);
        if self.state != ContainerState::Complete || self.ended_ms == 0 {
            return None;
        }
        // From where its limit runs ([`Self::declared_end_ms`]).
        let run = self.ended_ms.saturating_sub(self.run_from_ms());
        (self.exit_status == Some(0) || run >= limit_ms).then(|| (run as f64 / limit_ms as f64).min(1.0))
    }

    /// When its run started (ms since the epoch): when its executor started it, else (not
    /// started yet, or stored by an older RM) when it was granted.
    pub fn run_from_ms(&self) -> u64 {
        if self.started_ms > 0 {
            self.started_ms
        } else {
            self.allocated_ms
        }
    }

    /// When it is expected to end by its declared limit (ms since the epoch): `None` when
    /// it declared none; counted from [`Self::run_from_ms`].
    pub fn declared_end_ms(&self) -> Option<u64> {
        Some(
            self.run_from_ms()
                .saturating_add(self.max_run_sec?.saturating_mul(1000)),
        )
    }
}

/// When a node whose live containers declare these ends is whole again (issue 27, the drain
/// term of the placement order): the latest end; 0 with nothing live; `None` when one of them
/// declared no limit.
fn drain_by(mut ends: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    ends.try_fold(0, |acc, end| end.map(|e| acc.max(e)))
}

/// A node's drain: [`drain_by`] of its live containers' declared ends, `None` where
/// something outside the RM holds GPUs there for good (its baseline): never whole.
fn node_drain(baseline: &Resources, ends: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    if baseline.gpu_count() > 0 {
        None
    } else {
        drain_by(ends)
    }
}

/// What changed in the ledger since the last [`Ledger::take_changes`]: the RM's store
/// writes exactly these.
#[derive(Debug, Default, PartialEq)]
pub struct LedgerChanges {
    pub containers: Vec<String>,
    pub nodes: Vec<String>,
}

impl LedgerChanges {
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty() && self.nodes.is_empty()
    }
}

/// What the RM learns from ended runs (issue 27): successful run times by application and
/// role (learned ends), and what runs that declared a limit used of it (calibrated ends).
/// Each container is noted once, when it completes (or is restored complete).
#[derive(Debug, Default)]
struct RunIndex {
    by_role: HashMap<String, HashMap<String, Vec<u64>>>,
    used: HashMap<String, Vec<f64>>,
    /// Bumped whenever `used` changes (what is computed from it may be kept until then).
    used_version: u64,
}

impl RunIndex {
    fn note(&mut self, c: &LedgerContainer) {
        if let (Some(run), Some(role)) = (c.successful_run_ms(), c.role()) {
            self.by_role
                .entry(c.app_id.clone())
                .or_default()
                .entry(role.to_string())
                .or_default()
                .push(run);
        }
        if let Some(u) = c.used_of_limit() {
            self.used.entry(c.app_id.clone()).or_default().push(u);
            self.used_version += 1;
        }
    }

    fn forget(&mut self, app_id: &str) {
        self.by_role.remove(app_id);
        if self.used.remove(app_id).is_some() {
            self.used_version += 1;
        }
    }
}

/// A container that just ended, for the RM to report to its application.
#[derive(Clone, Debug, PartialEq)]
pub struct Ended {
    pub container_id: String,
    pub app_id: String,
    pub attempt: u32,
    pub host: String,
    /// The state it was in before it ended (Running ones need stopping).
    pub was: ContainerState,
    pub exit_status: i32,
    pub diagnostics: String,
}

/// Misuse of a container's life cycle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("container {0} is not known")]
    UnknownContainer(String),
    #[error("container {id} is {state:?}, not {expected:?}")]
    WrongState {
        id: String,
        state: ContainerState,
        expected: ContainerState,
    },
}

struct LedgerNode {
    node: Node,
    /// Taken by something outside this RM (the cluster file's `used:`); never freed.
    baseline: Resources,
    live: BTreeSet<String>,
    /// The sum of the live containers' resources (kept incrementally; see the module doc).
    live_sum: Resources,
    /// Value of `Ledger::epoch` when this node's used resources or state last changed.
    changed_at: u64,
}

/// One entry of the grant audit log (see [`Ledger::enable_audit`]).
#[derive(Clone, Debug, PartialEq)]
pub enum AuditEvent {
    Grant {
        container_id: String,
        host: String,
        resources: Resources,
    },
    Free {
        container_id: String,
    },
}

/// Nodes and containers of the RM.
pub struct Ledger {
    nodes: BTreeMap<String, LedgerNode>,
    containers: HashMap<String, LedgerContainer>,
    next_container: u64,
    expiry: Duration,
    epoch: u64,
    /// Every grant and free in ledger order, when auditing is on (tests, load runs).
    audit: Option<Vec<AuditEvent>>,
    /// Containers and nodes changed since the last `take_changes`.
    touched: BTreeSet<String>,
    touched_nodes: BTreeSet<String>,
    /// Nodes removed for good ([`Ledger::remove_node`]), as DECOMMISSIONED, with the epoch
    /// of their removal: [`Ledger::changed_since`] reports them once to each application
    /// that had seen them, so no AM keeps choosing a host that is gone.
    removed: BTreeMap<String, (Node, u64)>,
    /// Each node under the epoch of its last change (`changed_at`): what changed since an
    /// epoch is a range of it, O(changes) whatever the cluster's size.
    by_change: BTreeMap<u64, String>,
    /// The run times of the containers that completed successfully
    /// ([`LedgerContainer::successful_run_ms`]), by application and role, and what those
    /// that declared a limit used of it ([`LedgerContainer::used_of_limit`]), kept as they
    /// complete: learning and calibrating expected ends read these, not every container.
    runs: RunIndex,
}

impl Ledger {
    /// Starts with no containers. A node's `used` in the input is kept as its
    /// baseline: taken by others, never granted, never freed.
    pub fn new(nodes: impl IntoIterator<Item = Node>, expiry: Duration) -> Self {
        let nodes = nodes
            .into_iter()
            .map(|mut n| {
                n.set_requested(Resources::default());
                n.drain_by_ms = node_drain(n.used(), std::iter::empty());
                let host = n.host.clone();
                (
                    host,
                    LedgerNode {
                        baseline: n.used().clone(),
                        node: n,
                        live: BTreeSet::new(),
                        live_sum: Resources::default(),
                        changed_at: 0,
                    },
                )
            })
            .collect();
        Ledger {
            nodes,
            containers: HashMap::new(),
            next_container: 1,
            expiry,
            epoch: 0,
            audit: None,
            touched: BTreeSet::new(),
            touched_nodes: BTreeSet::new(),
            removed: BTreeMap::new(),
            by_change: BTreeMap::new(),
            runs: RunIndex::default(),
        }
    }

    /// Whether a container or node state changed since the last [`Ledger::take_changes`].
    pub fn has_changes(&self) -> bool {
        !self.touched.is_empty() || !self.touched_nodes.is_empty()
    }

    /// The containers and node states changed since the last call (for persisting).
    pub fn take_changes(&mut self) -> LedgerChanges {
        LedgerChanges {
            containers: std::mem::take(&mut self.touched).into_iter().collect(),
            nodes: std::mem::take(&mut self.touched_nodes).into_iter().collect(),
        }
    }

    /// Puts back a container recovered from the store (RM restart), after the node
    /// states were restored. A live container whose host is gone from the cluster, is
    /// no longer usable, or whose resources collide with what is already restored there
    /// cannot be honoured: it is completed (ABORTED, with the reason) and returned so
    /// its application hears of it. `allocated_at` is rebuilt from `allocated_ms`.
    pub fn restore(&mut self, mut c: LedgerContainer, now: Instant, now_ms: u64) -> Option<Ended> {
        let id = c.container.container_id.clone();
        let age = Duration::from_millis(now_ms.saturating_sub(c.allocated_ms));
        c.allocated_at = now.checked_sub(age).unwrap_or(now);
        let live = c.state != ContainerState::Complete || c.held;
        let host = c.container.host.clone();
        let held = c.held;
        // Numbering goes on after the highest id restored (ids end in `_<seq>`).
        if let Some(seq) = container_seq(&id) {
            self.next_container = self.next_container.max(seq.saturating_add(1));
        }
        self.runs.note(&c);
        self.containers.insert(id.clone(), c);
        if !live {
            return None;
        }
        let problem = match self.nodes.get(&host) {
            None if held => None,
            None => Some(format!("host `{host}` is no longer in the cluster")),
            // Still held: whatever runs there keeps its resources, usable node or not.
            Some(_) if held => None,
            Some(ln) if ln.node.state.is_unusable() => Some(DIAG_LOST_NODE.to_string()),
            Some(ln) => {
                let res = &self.containers[&id].container.resources;
                match ln.node.used().try_add(res) {
                    Ok(sum) if within(&sum, ln.node.total()) => None,
                    _ => Some(format!(
                        "its resources on `{host}` collide with another container's or exceed the node"
                    )),
                }
            }
        };
        match problem {
            None => {
                let res = self.containers[&id].container.resources.clone();
                self.add_live(&host, &id, &res);
                None
            }
            Some(why) => {
                // Not live anywhere yet: only its record changes.
                let c = self.containers.get_mut(&id)?;
                let was = c.state;
                c.state = ContainerState::Complete;
                c.exit_status = Some(exit_status::ABORTED);
                c.diagnostics = format!("could not be restored after an RM restart: {why}");
                self.touched.insert(id.clone());
                Some(Ended {
                    container_id: id,
                    app_id: c.app_id.clone(),
                    attempt: c.attempt,
                    host,
                    was,
                    exit_status: exit_status::ABORTED,
                    diagnostics: c.diagnostics.clone(),
                })
            }
        }
    }

    /// Starts recording every grant and free (in the order the ledger applied them),
    /// so a test can check independently that no GPU bit or port was ever held twice.
    pub fn enable_audit(&mut self) {
        self.audit.get_or_insert_with(Vec::new);
    }

    /// The audit log so far (empty when auditing is off).
    pub fn audit_log(&self) -> &[AuditEvent] {
        self.audit.as_deref().unwrap_or(&[])
    }

    pub fn expiry(&self) -> Duration {
        self.expiry
    }

    pub fn node(&self, host: &str) -> Option<&Node> {
        self.nodes.get(host).map(|n| &n.node)
    }

    /// Every node with its number of live containers, ordered by host.
    pub fn nodes(&self) -> impl Iterator<Item = (&Node, u32)> {
        self.nodes.values().map(|n| (&n.node, n.live.len() as u32))
    }

    pub fn num_containers(&self, host: &str) -> u32 {
        self.nodes.get(host).map_or(0, |n| n.live.len() as u32)
    }

    /// A change counter: it grows whenever some node's used resources or state change.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many nodes there are (O(1)).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Nodes that changed after epoch `since`, with their live container counts, in the
    /// order they last changed: O(changes), not O(nodes).
    pub fn changed_since(&self, since: u64) -> impl Iterator<Item = (&Node, u32)> {
        let removed = self
            .removed
            .values()
            .filter(move |(_, at)| *at > since)
            .map(|(n, _)| (n, 0));
        self.by_change
            .range(since.saturating_add(1)..)
            .filter_map(|(at, host)| self.nodes.get(host).filter(|n| n.changed_at == *at))
            .map(|n| (&n.node, n.live.len() as u32))
            .chain(removed)
    }

    /// A change of `host`'s used resources or state: a new epoch, the node's mark.
    fn mark_changed(&mut self, host: &str) {
        let Some(ln) = self.nodes.get_mut(host) else {
            return;
        };
        self.epoch += 1;
        if ln.changed_at > 0 {
            self.by_change.remove(&ln.changed_at);
        }
        ln.changed_at = self.epoch;
        self.by_change.insert(self.epoch, host.to_string());
    }

    pub fn container(&self, id: &str) -> Option<&LedgerContainer> {
        self.containers.get(id)
    }

    /// Every container (live or completed) of an application, by id.
    pub fn containers_of(&self, app_id: &str) -> Vec<&LedgerContainer> {
        let mut v: Vec<&LedgerContainer> = self.containers.values().filter(|c| c.app_id == app_id).collect();
        v.sort_by(|a, b| a.container.container_id.cmp(&b.container.container_id));
        v
    }

    /// Ids of the live (Allocated or Running) containers of an application.
    pub fn live_containers_of(&self, app_id: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .containers
            .values()
            .filter(|c| c.app_id == app_id && c.state != ContainerState::Complete)
            .map(|c| c.container.container_id.clone())
            .collect();
        v.sort();
        v
    }

    /// Ids of every live container.
    pub fn live_containers(&self) -> Vec<String> {
        self.nodes.values().flat_map(|n| n.live.iter().cloned()).collect()
    }

    /// The componentwise largest node total (YARN's maximum allocation).
    pub fn max_capability(&self) -> Resources {
        let mut best = Resources::default();
        for n in self.nodes.values() {
            let t = n.node.total();
            best.cpu = best.cpu.max(t.cpu);
            best.memory_mb = best.memory_mb.max(t.memory_mb);
            if t.gpu_count() > best.gpu_count() {
                best.gpus = t.gpu_count();
                best.gpu_mask = t.gpu_mask;
            }
            best.ports = best.ports.union(&t.ports);
            for (name, units) in t.custom.iter() {
                if units > best.custom.get(name) {
                    best.custom.set(name, units);
                }
            }
        }
        best
    }

    /// True when no container is live and every node's used amount is its baseline.
    pub fn all_free(&self) -> bool {
        self.nodes
            .values()
            .all(|n| n.live.is_empty() && *n.node.used() == n.baseline)
            && self.containers.values().all(|c| c.state == ContainerState::Complete)
    }

    /// Grants `ask` to `app_id`/`attempt` if every requested unit is free on its host
    /// right now, exactly as asked; otherwise rejects with the reason.
    pub fn grant(&mut self, app_id: &str, attempt: u32, ask: &Ask, now: Instant) -> Result<Container, Rejection> {
        let reject = |retryable: bool, reason: String| Rejection {
            request_id: ask.request_id,
            reason,
            retryable,
            wait: None,
        };
        let Some(ln) = self.nodes.get(&ask.host) else {
            return Err(reject(false, format!("unknown host `{}`", ask.host)));
        };
        let node = &ln.node;
        match node.state {
            NodeState::Running => {}
            s @ (NodeState::Lost | NodeState::Decommissioned | NodeState::Decommissioning | NodeState::Shutdown) => {
                return Err(reject(
                    false,
                    format!("host `{}` is {s:?} and takes no new containers", ask.host),
                ));
            }
            s => {
                return Err(reject(true, format!("host `{}` is {s:?}, not RUNNING", ask.host)));
            }
        }
        let want = ask.resources();
        if want.cpu == 0 && want.memory_mb == 0 {
            return Err(reject(
                false,
                "an ask must request some CPU or memory (cpu >= 1 or memoryMB >= 1)".to_string(),
            ));
        }
        if let Some(why) = malformed_shares(&want) {
            return Err(reject(false, format!("host `{}`: {why}", ask.host)));
        }
        let total = node.total();
        // The one shortfall rule (Resources::shortfalls), against the total (never fits)
        // and then against what is free now (busy).
        let never: Vec<String> = want
            .shortfalls(total, 0, 0)
            .iter()
            .map(|s| match s {
                Shortfall::GpuBits => format!(
                    "GPU bits {} do not exist on the node (it has {})",
                    mask_hex(want.gpu_mask & !total.gpu_mask),
                    mask_hex(total.gpu_mask)
                ),
                Shortfall::Gpus => format!("{} GPUs asked, the node has {}", want.gpus, total.gpu_count()),
                Shortfall::GpuShare => format!(
                    "a share of GPU {} asked, the node has GPUs {}",
                    want.gpu_shares,
                    mask_hex(total.gpu_mask)
                ),
                Shortfall::Cpu => format!("{} CPUs asked, the node has {}", want.cpu, total.cpu),
                Shortfall::Memory => format!("{} MB asked, the node has {}", want.memory_mb, total.memory_mb),
                Shortfall::Custom => format!(
                    "custom resources {} asked, the node offers {}",
                    want.custom.to_text(),
                    none_if_empty(total.custom.to_text())
                ),
                Shortfall::Ports | Shortfall::DynamicPorts => format!(
                    "ports [{}] are not offered by the node",
                    want.ports.subtract(&total.ports)
                ),
            })
            .collect();
        if !never.is_empty() {
            return Err(reject(false, format!("host `{}`: {}", ask.host, never.join("; "))));
        }
        let free = total.subtract(node.used());
        let busy: Vec<String> = want
            .shortfalls(&free, 0, 0)
            .iter()
            .map(|s| match s {
                Shortfall::GpuBits => format!(
                    "GPU bits {} are in use",
                    mask_hex(want.whole_gpu_mask() & !free.whole_gpu_mask())
                ),
                Shortfall::Gpus => format!("{} GPUs asked, {} wholly free", want.gpus, free.whole_gpu_count()),
                Shortfall::GpuShare => format!(
                    "GPU share {} asked, {} left",
                    want.gpu_shares,
                    match want.gpu_shares.single() {
                        Some((i, _)) if i < crate::resources::ANY_GPU =>
                            format_hundredths(free.gpu_hundredths(u32::from(i))),
                        _ => format_hundredths(free.largest_gpu_room()),
                    }
                ),
                Shortfall::Cpu => format!("{} CPUs asked, {} free", want.cpu, free.cpu),
                Shortfall::Memory => format!("{} MB asked, {} free", want.memory_mb, free.memory_mb),
                Shortfall::Custom => format!(
                    "custom resources {} asked, {} free",
                    want.custom.to_text(),
                    none_if_empty(free.custom.to_text())
                ),
                Shortfall::Ports | Shortfall::DynamicPorts => {
                    format!("ports [{}] are in use", want.ports.intersect(&node.used().ports))
                }
            })
            .collect();
        if !busy.is_empty() {
            return Err(reject(true, format!("host `{}`: {}", ask.host, busy.join("; "))));
        }

        let Some(next) = self.next_container.checked_add(1) else {
            return Err(reject(false, "the container id sequence is exhausted".to_string()));
        };
        let seq = std::mem::replace(&mut self.next_container, next);
        let container = Container {
            container_id: container_id(app_id, attempt, seq),
            request_id: ask.request_id,
            host: ask.host.clone(),
            node_http_address: node.http_address.clone(),
            node_ip: node.ip,
            resources: want,
            task: ask.task.clone(),
            task_attempt: ask.task_attempt,
        };
        self.containers.insert(
            container.container_id.clone(),
            LedgerContainer {
                container: container.clone(),
                app_id: app_id.to_string(),
                attempt,
                state: ContainerState::Allocated,
                allocated_at: now,
                allocated_ms: crate::protocol::now_ms(),
                exit_status: None,
                diagnostics: String::new(),
                held: false,
                ended_ms: 0,
                started_ms: 0,
                max_run_sec: ask.max_run_sec,
            },
        );
        self.add_live(&ask.host, &container.container_id, &container.resources);
        self.touched.insert(container.container_id.clone());
        if let Some(a) = &mut self.audit {
            a.push(AuditEvent::Grant {
                container_id: container.container_id.clone(),
                host: container.host.clone(),
                resources: container.resources.clone(),
            });
        }
        Ok(container)
    }

    /// Allocated → Running (the executor started it).
    pub fn mark_running(&mut self, id: &str) -> Result<(), LedgerError> {
        let c = self
            .containers
            .get_mut(id)
            .ok_or_else(|| LedgerError::UnknownContainer(id.to_string()))?;
        if c.state != ContainerState::Allocated {
            return Err(LedgerError::WrongState {
                id: id.to_string(),
                state: c.state,
                expected: ContainerState::Allocated,
            });
        }
        c.state = ContainerState::Running;
        c.started_ms = crate::protocol::now_ms();
        self.touched.insert(id.to_string());
        Ok(())
    }

    /// Ends a live container and frees exactly its resources. `None` when it is
    /// unknown or already complete (completing twice is harmless).
    ///
    /// This is the "it is dead" call: a container [`Ledger::stop`] held is freed now (and
    /// `None` returned: its application already heard of its end).
    pub fn complete(&mut self, id: &str, exit: i32, diagnostics: &str) -> Option<Ended> {
        let c = self.containers.get_mut(id)?;
        if c.state == ContainerState::Complete {
            if c.held {
                c.held = false;
                let host = c.container.host.clone();
                self.free(id, &host);
            }
            return None;
        }
        let was = c.state;
        c.state = ContainerState::Complete;
        c.ended_ms = crate::protocol::now_ms();
        c.exit_status = Some(exit);
        c.diagnostics = diagnostics.to_string();
        self.runs.note(c);
        let ended = Ended {
            container_id: id.to_string(),
            app_id: c.app_id.clone(),
            attempt: c.attempt,
            host: c.container.host.clone(),
            was,
            exit_status: exit,
            diagnostics: diagnostics.to_string(),
        };
        self.free(id, &ended.host);
        Some(ended)
    }

    /// Ends a live container for its application. One that was only Allocated (no
    /// process) is freed at once, as by [`Ledger::complete`]; a Running one becomes
    /// Complete but `held`: its resources stay used until `complete` says it is dead.
    /// `None` when it is unknown or already complete — and then nothing changes: a held
    /// one stays held (an AM releasing or stopping a container the RM had already ended,
    /// say after a start whose answer was lost, frees nothing its process may still use).
    pub fn stop(&mut self, id: &str, exit: i32, diagnostics: &str) -> Option<Ended> {
        let c = self.containers.get_mut(id)?;
        match c.state {
            ContainerState::Complete => return None,
            ContainerState::Allocated => return self.complete(id, exit, diagnostics),
            ContainerState::Running => {}
        }
        c.state = ContainerState::Complete;
        c.held = true;
        c.ended_ms = crate::protocol::now_ms();
        c.exit_status = Some(exit);
        c.diagnostics = diagnostics.to_string();
        self.runs.note(c);
        self.touched.insert(id.to_string());
        Some(Ended {
            container_id: id.to_string(),
            app_id: c.app_id.clone(),
            attempt: c.attempt,
            host: c.container.host.clone(),
            was: ContainerState::Running,
            exit_status: exit,
            diagnostics: diagnostics.to_string(),
        })
    }

    /// Ids of the containers held on `host` (ended, not yet reported dead), sorted.
    pub fn held_on(&self, host: &str) -> Vec<String> {
        self.nodes.get(host).map_or_else(Vec::new, |ln| {
            ln.live
                .iter()
                .filter(|id| self.containers.get(*id).is_some_and(|c| c.held))
                .cloned()
                .collect()
        })
    }

    /// Adds a node that registered (a node agent), or, for a known host, takes its new
    /// description (address, totals, labels) and marks it RUNNING again; its containers
    /// stay as they are. Returns true for a new host.
    pub fn add_node(&mut self, mut node: Node) -> bool {
        node.set_requested(Resources::default());
        node.state = NodeState::Running;
        let host = node.host.clone();
        self.removed.remove(&host);
        let new = match self.nodes.get_mut(&host) {
            Some(ln) => {
                ln.node = node;
                false
            }
            None => {
                self.nodes.insert(
                    host.clone(),
                    LedgerNode {
                        baseline: node.used().clone(),
                        node,
                        live: BTreeSet::new(),
                        live_sum: Resources::default(),
                        changed_at: 0,
                    },
                );
                true
            }
        };
        self.touched_nodes.insert(host.clone());
        self.refresh_used(&host);
        new
    }

    /// Drops a container from its node's used resources (it is dead).
    fn free(&mut self, id: &str, host: &str) {
        let res = self
            .containers
            .get(id)
            .map(|c| c.container.resources.clone())
            .unwrap_or_default();
        if let Some(ln) = self.nodes.get_mut(host) {
            if ln.live.remove(id) {
                ln.live_sum = ln.live_sum.subtract(&res);
            }
        }
        self.touched.insert(id.to_string());
        if let Some(a) = &mut self.audit {
            a.push(AuditEvent::Free {
                container_id: id.to_string(),
            });
        }
        self.refresh_used(host);
    }

    /// Adds a container to its node's live set and usage (O(1) in the node's containers).
    fn add_live(&mut self, host: &str, id: &str, res: &Resources) {
        if let Some(ln) = self.nodes.get_mut(host) {
            if ln.live.insert(id.to_string()) {
                // Grants never overlap (checked against `used` before), so this cannot
                // fail; if it ever did, keep the larger claim rather than under-count.
                ln.live_sum = match ln.live_sum.try_add(res) {
                    Ok(sum) => sum,
                    Err(_) => {
                        tracing::error!(container = %id, "ledger: overlapping containers on {host}");
                        ln.live_sum.clone()
                    }
                };
            }
        }
        self.refresh_used(host);
    }

    /// The containers that stayed Allocated longer than the expiry at `now`, sorted: the
    /// RM ends each ([`Ledger::complete`], ABORTED, [`DIAG_EXPIRED`]).
    pub fn expired(&self, now: Instant) -> Vec<String> {
        let mut due: Vec<String> = self
            .containers
            .values()
            .filter(|c| {
                c.state == ContainerState::Allocated && now.saturating_duration_since(c.allocated_at) > self.expiry
            })
            .map(|c| c.container.container_id.clone())
            .collect();
        due.sort();
        due
    }

    /// Completes every container that stayed Allocated longer than the expiry.
    pub fn expire(&mut self, now: Instant) -> Vec<Ended> {
        self.expired(now)
            .iter()
            .filter_map(|id| self.complete(id, exit_status::ABORTED, DIAG_EXPIRED))
            .collect()
    }

    /// Sets a node's state and returns the containers that must end with it: under an
    /// unusable state (LOST, UNHEALTHY, ...) every live one not already held, which the RM
    /// ends with -100 as YARN does ([`Ledger::stop`], [`DIAG_LOST_NODE`]). Unknown hosts
    /// give `None`.
    pub fn mark_node(&mut self, host: &str, state: NodeState) -> Option<Vec<String>> {
        let ln = self.nodes.get_mut(host)?;
        ln.node.state = state;
        self.touched_nodes.insert(host.to_string());
        let ids: Vec<String> = if state.is_unusable() {
            let containers = &self.containers;
            ln.live
                .iter()
                .filter(|id| containers.get(*id).is_some_and(|c| !c.held))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        self.mark_changed(host);
        Some(ids)
    }

    /// Sets a node's state ([`Ledger::mark_node`]) and stops the containers that end with
    /// it (running ones stay held until the node reports them dead).
    pub fn set_node_state(&mut self, host: &str, state: NodeState) -> Option<Vec<Ended>> {
        let ids = self.mark_node(host, state)?;
        Some(
            ids.iter()
                .filter_map(|id| self.stop(id, exit_status::ABORTED, DIAG_LOST_NODE))
                .collect(),
        )
    }

    /// The containers a node holds (live, or ended and held), sorted; `None` for an
    /// unknown host.
    pub fn held_or_live_on(&self, host: &str) -> Option<Vec<String>> {
        Some(self.nodes.get(host)?.live.iter().cloned().collect())
    }

    /// Takes a node out for good (the admin's removal): every container still on it is
    /// completed and freed here — one still live for its application ends with -100 and
    /// `diagnostics` (returned, so its application hears of it), one already ended and
    /// held is freed without a second report — and the node leaves the view. `None` for
    /// an unknown host. Whatever is reported about those containers later frees nothing
    /// ([`Ledger::complete`] of a complete, unheld container is a no-op).
    pub fn remove_node(&mut self, host: &str, diagnostics: &str) -> Option<Vec<Ended>> {
        let ids = self.held_or_live_on(host)?;
        let ended = ids
            .iter()
            .filter_map(|id| self.complete(id, exit_status::ABORTED, diagnostics))
            .collect();
        self.forget_node(host);
        Some(ended)
    }

    /// The last step of [`Ledger::remove_node`], once every container on `host` was
    /// completed: the node leaves the view (reported DECOMMISSIONED to those that saw it).
    pub fn forget_node(&mut self, host: &str) {
        self.epoch += 1;
        if let Some(mut ln) = self.nodes.remove(host) {
            self.by_change.remove(&ln.changed_at);
            ln.node.state = NodeState::Decommissioned;
            ln.node.set_used(Resources::default());
            self.removed.insert(host.to_string(), (ln.node, self.epoch));
        }
        self.touched_nodes.insert(host.to_string());
    }

    /// Marks a node LOST (its containers complete with -100).
    pub fn mark_node_lost(&mut self, host: &str) -> Option<Vec<Ended>> {
        self.set_node_state(host, NodeState::Lost)
    }

    /// used = baseline + the live containers' sum (kept incrementally).
    fn refresh_used(&mut self, host: &str) {
        let Some(ln) = self.nodes.get_mut(host) else {
            return;
        };
        let used = ln.baseline.try_add(&ln.live_sum).unwrap_or_else(|_| {
            tracing::error!("ledger: the containers on {host} overlap its baseline");
            ln.live_sum.clone()
        });
        ln.node.set_used(used);
        ln.node.drain_by_ms = node_drain(
            &ln.baseline,
            ln.live
                .iter()
                .map(|id| self.containers.get(id).and_then(LedgerContainer::declared_end_ms)),
        );
        self.mark_changed(host);
    }

    /// The audit of the incremental usage: every node's `used` recomputed from scratch as
    /// its baseline plus the sum of the containers it holds (live, or ended but held),
    /// which must equal what the ledger keeps. `Err` names the first node that differs.
    /// O(containers); tests and property tests call it after every step.
    pub fn audit_usage(&self) -> Result<(), String> {
        for (host, ln) in &self.nodes {
            let mut used = ln.baseline.clone();
            let holding: BTreeSet<&String> = self
                .containers
                .values()
                .filter(|c| c.container.host == *host && (c.state != ContainerState::Complete || c.held))
                .map(|c| &c.container.container_id)
                .collect();
            if holding.len() != ln.live.len() || holding.iter().any(|id| !ln.live.contains(*id)) {
                return Err(format!(
                    "{host}: the live set {:?} is not the containers holding resources {holding:?}",
                    ln.live
                ));
            }
            for id in &holding {
                let res = &self.containers[*id].container.resources;
                used = used
                    .try_add(res)
                    .map_err(|o| format!("{host}: container {id} overlaps others ({o:?})"))?;
            }
            if *ln.node.used() != used {
                return Err(format!(
                    "{host}: used {:?} but its containers add up to {used:?}",
                    ln.node.used()
                ));
            }
            if ln.changed_at > 0 && self.by_change.get(&ln.changed_at) != Some(host) {
                return Err(format!(
                    "{host}: changed at epoch {} but the change index does not say so",
                    ln.changed_at
                ));
            }
        }
        // The change index answers exactly as a scan of every node would.
        let scanned: BTreeSet<&str> = self
            .nodes
            .values()
            .filter(|n| n.changed_at > 0)
            .map(|n| n.node.host.as_str())
            .collect();
        let indexed: BTreeSet<&str> = self
            .changed_since(0)
            .filter(|(n, _)| self.nodes.contains_key(&n.host))
            .map(|(n, _)| n.host.as_str())
            .collect();
        if self.by_change.values().any(|h| !self.nodes.contains_key(h)) {
            return Err("the change index names a node that is gone".into());
        }
        if scanned != indexed {
            return Err(format!("changed nodes {scanned:?}, but the index gives {indexed:?}"));
        }
        Ok(())
    }

    /// The sequence number the next container id gets (persisted by the RM's store, so an
    /// id is never handed out twice, even when the grants that used it were not stored).
    pub fn next_container_seq(&self) -> u64 {
        self.next_container
    }

    /// Continues numbering at `seq` or later (never goes back).
    pub fn continue_container_seq(&mut self, seq: u64) {
        self.next_container = self.next_container.max(seq);
    }

    /// Every container the ledger knows (live and completed), in no particular order.
    pub fn all_containers(&self) -> impl Iterator<Item = &LedgerContainer> {
        self.containers.values()
    }

    /// Drops the completed containers of a finished application that the history no
    /// longer keeps (history retention); their store rows go with the application's
    /// (`Batch::forget_apps`). Held or live ones stay. Returns how many were dropped.
    pub fn forget_app(&mut self, app_id: &str) -> usize {
        let before = self.containers.len();
        self.containers
            .retain(|_, c| c.app_id != app_id || c.state != ContainerState::Complete || c.held);
        // Its runs go with them; those of its held ones stay.
        self.runs.forget(app_id);
        for c in self.containers.values().filter(|c| c.app_id == app_id) {
            self.runs.note(c);
        }
        before - self.containers.len()
    }

    /// The run times (ms) of application `app_id`'s containers of `role` that completed
    /// successfully, in no particular order.
    pub fn runs_of(&self, app_id: &str, role: &str) -> &[u64] {
        self.runs
            .by_role
            .get(app_id)
            .and_then(|r| r.get(role))
            .map_or(&[], Vec::as_slice)
    }

    /// Changes whenever [`Self::used_of`] of some application does.
    pub fn used_version(&self) -> u64 {
        self.runs.used_version
    }

    /// What application `app_id`'s ended runs that declared a limit used of it (run / limit,
    /// at most 1: [`LedgerContainer::used_of_limit`]), in no particular order.
    pub fn used_of(&self, app_id: &str) -> &[f64] {
        self.runs.used.get(app_id).map_or(&[], Vec::as_slice)
    }

    /// Every node's host and state (for writing the whole state).
    pub fn node_states(&self) -> impl Iterator<Item = (&str, NodeState)> {
        self.nodes.iter().map(|(h, ln)| (h.as_str(), ln.node.state))
    }
}

/// Whether `used` stays inside `total` in every dimension (per GPU, at most what the
/// node has of it: a used amount's hundredths never pass 100, [`Resources::try_add`]).
fn within(used: &Resources, total: &Resources) -> bool {
    used.cpu <= total.cpu
        && used.memory_mb <= total.memory_mb
        && used.gpu_mask & !total.gpu_mask == 0
        && used.custom.fits_in(&total.custom)
        && used.ports.subtract(&total.ports).is_empty()
}

/// An ask's shares must be one share on the one GPU of its mask (a fractional container);
/// anything else is refused as written.
fn malformed_shares(want: &Resources) -> Option<String> {
    if want.gpu_shares.is_empty() {
        return None;
    }
    match want.gpu_shares.single() {
        Some((i, _)) if i < crate::resources::ANY_GPU && want.gpu_mask == 1u64 << i => None,
        _ => Some(format!(
            "gpuShares {} must be one share of the one GPU in gpuMask {}",
            want.gpu_shares,
            mask_hex(want.gpu_mask)
        )),
    }
}

fn none_if_empty(s: String) -> String {
    if s.is_empty() {
        "none".into()
    } else {
        s
    }
}

/// Replays an audit log and checks, independently of the ledger's own accounting,
/// that no GPU bit or port was granted while another live container on the same host
/// held it, that the shares of one GPU never passed one GPU, and that every grant was
/// freed at most once. Returns (grants, frees).
pub fn verify_audit(log: &[AuditEvent]) -> Result<(usize, usize), String> {
    let mut live: HashMap<&str, (&str, &Resources)> = HashMap::new();
    let (mut grants, mut frees) = (0, 0);
    for (i, e) in log.iter().enumerate() {
        match e {
            AuditEvent::Grant {
                container_id,
                host,
                resources,
            } => {
                // The live containers of the host together, then this grant on top: a GPU
                // bit held twice, shares above one GPU or a port held twice all fail.
                let mut held = Resources::default();
                let mut others = Vec::new();
                for (other, (h, r)) in &live {
                    if h == host {
                        held = held.try_add(r).unwrap_or(held);
                        others.push(*other);
                    }
                }
                if let Err(o) = held.try_add(resources) {
                    others.sort_unstable();
                    return Err(format!(
                        "event {i}: {container_id} on {host} overlaps live {} (GPUs {} vs {}, ports [{}])",
                        others.join(", "),
                        resources.gpu_text(),
                        held.gpu_text(),
                        o.ports
                    ));
                }
                if live.insert(container_id, (host, resources)).is_some() {
                    return Err(format!("event {i}: {container_id} granted twice"));
                }
                grants += 1;
            }
            AuditEvent::Free { container_id } => {
                if live.remove(container_id.as_str()).is_none() {
                    return Err(format!("event {i}: {container_id} freed while not live"));
                }
                frees += 1;
            }
        }
    }
    Ok((grants, frees))
}

/// The sequence number of a container id made by [`container_id`] for an
/// `application_<clusterTs>_<appSeq>` id: `container_<digits>_<digits>_<digits>_<seq>`,
/// every part plain ASCII digits (at most 20). `None` for anything else, so an id such as
/// `../..` or one whose sequence overflows could not have been issued.
pub fn container_seq(id: &str) -> Option<u64> {
    let parts: Vec<&str> = id.strip_prefix("container_")?.split('_').collect();
    let digits = |p: &&str| !p.is_empty() && p.len() <= 20 && p.bytes().all(|b| b.is_ascii_digit());
    if parts.len() != 4 || !parts.iter().all(digits) {
        return None;
    }
    parts[3].parse().ok()
}

/// YARN-style id: `container_<clusterTs>_<appSeq>_<attempt:02>_<seq:06>` for
/// `application_<clusterTs>_<appSeq>` ids; other ids are embedded as they are.
pub fn container_id(app_id: &str, attempt: u32, seq: u64) -> String {
    let base = app_id.strip_prefix("application_").unwrap_or(app_id);
    format!("container_{base}_{attempt:02}_{seq:06}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::PortSet;
    use proptest::prelude::*;

    fn node(host: &str, cpu: u32, mem: u64, mask: u64, ports: &str) -> Node {
        Node::new(
            host,
            "/r",
            Resources::with_mask(cpu, mem, mask, PortSet::parse(ports).unwrap()),
        )
    }

    fn ledger() -> Ledger {
        Ledger::new(
            [
                node("a", 8, 1000, 0xf, "2000-2009"),
                node("b", 4, 500, 0x3, "3000-3001"),
            ],
            Duration::from_secs(10),
        )
    }

    fn ask(id: u64, host: &str, cpu: u32, mem: u64, mask: u64, ports: &str) -> Ask {
        Ask {
            request_id: id,
            host: host.into(),
            cpu,
            memory_mb: mem,
            gpu_mask: mask,
            ports: PortSet::parse(ports).unwrap(),
            ..Default::default()
        }
    }

    /// A node's `drain_by_ms` (issue 27, the drain term): the latest declared end of what
    /// runs there, `None` while a container declared no limit, 0 once nothing runs; it goes
    /// out with the node's changes.
    #[test]
    fn a_nodes_drain_is_the_latest_declared_end_of_its_live_containers() {
        let now = Instant::now();
        let mut l = ledger();
        let drain = |l: &Ledger| l.node("a").and_then(|n| n.drain_by_ms);
        assert_eq!(drain(&l), Some(0), "nothing runs");
        let limited = |i: u64, sec: u64| Ask {
            max_run_sec: Some(sec),
            ..ask(i, "a", 1, 10, 1 << (i - 1), "")
        };
        let long = l.grant("app", 1, &limited(1, 3600), now).unwrap().container_id;
        let short = l.grant("app", 1, &limited(2, 60), now).unwrap().container_id;
        let end_of = |l: &Ledger, id: &str| l.container(id).and_then(LedgerContainer::declared_end_ms);
        assert_eq!(drain(&l), end_of(&l, &long));
        assert!(end_of(&l, &long) > end_of(&l, &short));
        let epoch = l.epoch();
        let open = l
            .grant("app", 1, &ask(3, "a", 1, 10, 0x4, ""), now)
            .unwrap()
            .container_id;
        assert_eq!(drain(&l), None, "a container without a limit: unknown");
        assert!(l
            .changed_since(epoch)
            .any(|(n, _)| n.host == "a" && n.drain_by_ms.is_none()));
        l.complete(&open, 0, "");
        assert_eq!(drain(&l), end_of(&l, &long));
        l.complete(&long, 0, "");
        assert_eq!(drain(&l), end_of(&l, &short));
        l.complete(&short, 0, "");
        assert_eq!(drain(&l), Some(0));
        // Something outside the RM holds GPUs for good: never whole.
        let mut base = node("c", 8, 1000, 0xf, "");
        base.set_used(Resources::with_mask(1, 10, 0x1, PortSet::new()));
        let mut l = Ledger::new([base], Duration::from_secs(10));
        l.grant(
            "app",
            1,
            &Ask {
                max_run_sec: Some(60),
                ..ask(1, "c", 1, 10, 0x2, "")
            },
            now,
        )
        .unwrap();
        assert_eq!(l.node("c").and_then(|n| n.drain_by_ms), None);
        assert_eq!(drain_by([Some(5), Some(9), Some(7)].into_iter()), Some(9));
        assert_eq!(drain_by([Some(5), None].into_iter()), None);
    }

    /// The runs learned from: successful ends by application and role, noted once however
    /// the container ends (stopped and then reported dead; restored complete), and kept for
    /// a held container when its application's history is forgotten.
    #[test]
    fn successful_runs_are_indexed_once_by_application_and_role() {
        let now = Instant::now();
        let mut l = Ledger::new([node("n1", 4, 1000, 0xf, "")], DEFAULT_CONTAINER_EXPIRY);
        let app = "application_1_0001";
        let grant = |l: &mut Ledger, i: u64, task: &str| {
            let a = Ask {
                task: Some(task.into()),
                ..ask(i, "n1", 1, 10, 1 << (i - 1), "")
            };
            l.grant(app, 1, &a, now).unwrap().container_id
        };
        let (ok, failed, held) = (
            grant(&mut l, 1, "w/0"),
            grant(&mut l, 2, "w/1"),
            grant(&mut l, 3, "ps/0"),
        );
        l.complete(&ok, 0, "");
        l.complete(&failed, 1, "");
        l.mark_running(&held).unwrap();
        l.stop(&held, 0, "stopped");
        l.complete(&held, 0, "dead");
        assert_eq!((l.runs_of(app, "w").len(), l.runs_of(app, "ps").len()), (1, 1));
        assert!(l.runs_of(app, "x").is_empty() && l.runs_of("application_1_0002", "w").is_empty());
        // A restarted ledger rebuilds the index from the containers it restores.
        let mut again = Ledger::new([node("n1", 4, 1000, 0xf, "")], DEFAULT_CONTAINER_EXPIRY);
        for c in l.all_containers().cloned().collect::<Vec<_>>() {
            again.restore(c, now, crate::protocol::now_ms());
        }
        assert_eq!((again.runs_of(app, "w").len(), again.runs_of(app, "ps").len()), (1, 1));
        // Forgetting the history drops the runs of what it drops, not a held one's.
        let last = grant(&mut l, 4, "ps/1");
        l.mark_running(&last).unwrap();
        l.stop(&last, 0, "stopped");
        l.forget_app(app);
        assert_eq!((l.runs_of(app, "w").len(), l.runs_of(app, "ps").len()), (0, 1));
    }

    /// What ended runs used of their declared limits (calibrated ends, issue 27 item 4): a
    /// success counts its run / limit, a run ended by its limit 1, a failure nothing, a run
    /// that declared nothing nothing; kept across a restart and forgotten with its history.
    #[test]
    fn what_runs_used_of_their_limits_is_indexed_by_application() {
        let now = Instant::now();
        let mut l = Ledger::new([node("n1", 8, 1000, 0xff, "")], DEFAULT_CONTAINER_EXPIRY);
        let app = "application_1_0001";
        // (limit s, ran s, exit)
        let runs = [
            (Some(100), 25, 0),
            (Some(100), 150, 137),
            (Some(100), 40, 1),
            (None, 30, 0),
        ];
        for (i, (limit, ran, exit)) in runs.into_iter().enumerate() {
            let a = Ask {
                task: Some(format!("w/{i}")),
                max_run_sec: limit,
                ..ask(i as u64 + 1, "n1", 1, 10, 1 << i, "")
            };
            let id = l.grant(app, 1, &a, now).unwrap().container_id;
            l.mark_running(&id).unwrap();
            if let Some(c) = l.containers.get_mut(&id) {
                c.started_ms -= ran * 1000;
            }
            l.complete(&id, exit, "");
        }
        let mut used = l.used_of(app).to_vec();
        used.sort_by(f64::total_cmp);
        assert_eq!(used.len(), 2, "{used:?}");
        assert!((used[0] - 0.25).abs() < 0.01 && used[1] == 1.0, "{used:?}");
        let mut again = Ledger::new([node("n1", 8, 1000, 0xff, "")], DEFAULT_CONTAINER_EXPIRY);
        for c in l.all_containers().cloned().collect::<Vec<_>>() {
            again.restore(c, now, crate::protocol::now_ms());
        }
        assert_eq!(again.used_of(app).len(), 2);
        // What is computed from the index may be kept until its version changes.
        let v = l.used_version();
        l.forget_app(app);
        assert!(l.used_of(app).is_empty());
        assert!(l.used_version() > v);
        let v = l.used_version();
        l.forget_app(app);
        assert_eq!(l.used_version(), v, "nothing changed");
    }

    #[test]
    fn restore_puts_back_live_grants_and_refuses_what_no_longer_fits() {
        let now = Instant::now();
        let mut first = Ledger::new(
            [node("n1", 4, 1000, 0x3, "100-101"), node("n2", 4, 1000, 0x3, "")],
            DEFAULT_CONTAINER_EXPIRY,
        );
        let a = first
            .grant("application_1_0001", 1, &ask(1, "n1", 1, 10, 0x1, "100"), now)
            .unwrap();
        let b = first
            .grant("application_1_0001", 1, &ask(2, "n2", 1, 10, 0x1, ""), now)
            .unwrap();
        let done = first
            .grant("application_1_0001", 1, &ask(3, "n1", 1, 10, 0x2, ""), now)
            .unwrap();
        first.complete(&done.container_id, 0, "");
        let saved: Vec<LedgerContainer> = [&a, &b, &done]
            .iter()
            .map(|c| first.container(&c.container_id).unwrap().clone())
            .collect();

        // The restarted RM's cluster file no longer has n2.
        let mut second = Ledger::new([node("n1", 4, 1000, 0x3, "100-101")], DEFAULT_CONTAINER_EXPIRY);
        let ended: Vec<Ended> = saved
            .into_iter()
            .filter_map(|c| second.restore(c, now, crate::protocol::now_ms()))
            .collect();
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].container_id, b.container_id);
        assert!(
            ended[0].diagnostics.contains("no longer in the cluster"),
            "{:?}",
            ended[0]
        );
        let n1 = second.node("n1").unwrap();
        assert_eq!(
            (n1.used().gpu_mask, n1.used().ports.to_string()),
            (0x1, "100".to_string())
        );
        assert!(second
            .grant("application_1_0001", 1, &ask(4, "n1", 1, 10, 0x1, ""), now)
            .is_err());
        // Numbering goes on after the restored ids.
        let next = second
            .grant("application_1_0001", 1, &ask(5, "n1", 1, 10, 0x2, ""), now)
            .unwrap();
        assert_eq!(next.container_id, container_id("application_1_0001", 1, 4));
        assert_eq!(
            second.take_changes().containers.len(),
            2,
            "the refused one and the new grant"
        );
    }

    #[test]
    fn audit_log_records_grants_and_frees_and_the_verifier_catches_overlap() {
        let mut l = ledger();
        l.enable_audit();
        let now = Instant::now();
        let c1 = l.grant("app", 1, &ask(1, "a", 1, 10, 0x1, "2000"), now).unwrap();
        assert!(l.grant("app", 1, &ask(2, "a", 1, 10, 0x1, ""), now).is_err());
        l.complete(&c1.container_id, 0, "");
        let _c2 = l.grant("app", 1, &ask(3, "a", 1, 10, 0x1, "2000"), now).unwrap();
        let log = l.audit_log().to_vec();
        assert_eq!(log.len(), 3, "rejections are not grants: {log:?}");
        assert_eq!(verify_audit(&log), Ok((2, 1)));
        // A forged log with the second grant before the free: caught.
        let forged = vec![log[0].clone(), log[2].clone(), log[1].clone()];
        let err = verify_audit(&forged).unwrap_err();
        assert!(err.contains("overlaps"), "{err}");
        let twice = vec![log[0].clone(), log[1].clone(), log[1].clone()];
        assert!(verify_audit(&twice).unwrap_err().contains("freed while not live"));
    }

    /// Removing a node completes what still runs there (reported once), frees what was
    /// held (not reported again), frees nothing twice afterwards, and reports the node
    /// gone (DECOMMISSIONED) to those who had seen it; a host added again is a new node.
    #[test]
    fn a_removed_node_frees_its_containers_once_and_is_reported_gone() {
        let mut l = ledger();
        l.enable_audit();
        let now = Instant::now();
        let run = l.grant("app", 1, &ask(1, "a", 1, 10, 0x1, "2000"), now).unwrap();
        l.mark_running(&run.container_id).unwrap();
        let held = l.grant("app", 1, &ask(2, "a", 1, 10, 0x2, ""), now).unwrap();
        l.mark_running(&held.container_id).unwrap();
        l.stop(&held.container_id, exit_status::ABORTED, DIAG_LOST_NODE)
            .unwrap();
        let other = l.grant("app", 1, &ask(3, "b", 1, 10, 0x1, ""), now).unwrap();
        let seen = l.epoch();
        let ended = l.remove_node("a", "gone").unwrap();
        assert_eq!(ended.len(), 1, "only the one still live is reported: {ended:?}");
        assert_eq!(
            (ended[0].container_id.as_str(), ended[0].exit_status),
            (run.container_id.as_str(), exit_status::ABORTED)
        );
        assert!(l.node("a").is_none() && l.nodes().count() == 1);
        assert!(l.remove_node("a", "gone").is_none(), "unknown now");
        // Late reports of the removed host's containers free nothing.
        assert!(l.complete(&run.container_id, 0, "").is_none());
        assert!(l.complete(&held.container_id, 0, "").is_none());
        l.audit_usage().unwrap();
        assert_eq!(verify_audit(l.audit_log()), Ok((3, 2)));
        assert!(l.live_containers() == vec![other.container_id.clone()]);
        let gone: Vec<(String, NodeState, u32)> = l
            .changed_since(seen)
            .map(|(n, c)| (n.host.clone(), n.state, c))
            .collect();
        assert_eq!(gone, vec![("a".to_string(), NodeState::Decommissioned, 0)]);
        assert_eq!(l.changed_since(l.epoch()).count(), 0, "reported once");
        // The same host registering again is a fresh, empty node.
        assert!(l.add_node(node("a", 8, 1000, 0xf, "2000-2009")));
        assert_eq!(l.node("a").unwrap().used().gpu_mask, 0);
        l.grant("app", 1, &ask(4, "a", 1, 10, 0x3, "2000"), now).unwrap();
        l.audit_usage().unwrap();
    }

    #[test]
    fn an_ask_for_no_cpu_and_no_memory_is_refused() {
        let mut l = ledger();
        let now = Instant::now();
        let r = l.grant("app", 1, &ask(1, "a", 0, 0, 0x1, "2000"), now).unwrap_err();
        assert!(!r.retryable && r.reason.contains("some CPU or memory"), "{r:?}");
        assert_eq!(l.num_containers("a"), 0);
        // One CPU, or one MB, is enough.
        l.grant("app", 1, &ask(2, "a", 1, 0, 0, ""), now).unwrap();
        l.grant("app", 1, &ask(3, "a", 0, 1, 0, ""), now).unwrap();
        assert_eq!(l.audit_usage(), Ok(()));
    }

    #[test]
    fn usage_is_kept_incrementally_and_the_audit_catches_drift() {
        let mut l = ledger();
        let now = Instant::now();
        let mut ids = Vec::new();
        for i in 0..4u64 {
            let c = l
                .grant("app", 1, &ask(i, "a", 1, 10, 1 << i, &format!("{}", 2000 + i)), now)
                .unwrap();
            ids.push(c.container_id);
        }
        l.mark_running(&ids[1]).unwrap();
        l.stop(&ids[1], -100, "released"); // held: still counted
        l.complete(&ids[2], 0, "");
        assert_eq!(l.audit_usage(), Ok(()));
        let used = l.node("a").unwrap().used().clone();
        assert_eq!((used.cpu, used.memory_mb, used.gpu_mask), (3, 30, 0b1011));
        // A node whose kept usage no longer matches its containers is reported.
        l.nodes.get_mut("a").unwrap().live_sum.cpu += 1;
        l.refresh_used("a");
        let err = l.audit_usage().unwrap_err();
        assert!(err.starts_with("a: used"), "{err}");
    }

    #[test]
    fn container_ids_that_could_not_have_been_issued_have_no_sequence() {
        assert_eq!(container_seq(&container_id("application_17_0003", 2, 41)), Some(41));
        for bad in [
            "../..",
            "container_1_2_3",
            "container_1_2_3_x",
            "container_1_2_3_-4",
            "container_1_2_3_+4",
            "container_1_2_3_99999999999999999999",
            "container_a_2_3_4",
            "container_1_2_3_4_5",
        ] {
            assert_eq!(container_seq(bad), None, "{bad}");
        }
    }

    #[test]
    fn grants_exactly_what_was_asked() {
        let mut l = ledger();
        let now = Instant::now();
        let c = l
            .grant("application_1_0001", 1, &ask(7, "a", 2, 100, 0x6, "2003,2005"), now)
            .unwrap();
        assert_eq!(c.request_id, 7);
        assert_eq!(c.host, "a");
        assert_eq!(c.container_id, "container_1_0001_01_000001");
        assert_eq!(c.resources.gpu_mask, 0x6);
        assert_eq!(c.resources.gpus, 2);
        assert_eq!(c.resources.ports, PortSet::parse("2003,2005").unwrap());
        let used = l.node("a").unwrap().used();
        assert_eq!((used.cpu, used.memory_mb, used.gpu_mask), (2, 100, 0x6));
        assert_eq!(l.num_containers("a"), 1);
        assert!(!l.all_free());
    }

    #[test]
    fn busy_is_retryable_impossible_is_not() {
        let mut l = ledger();
        let now = Instant::now();
        l.grant("app1", 1, &ask(1, "a", 2, 100, 0x1, "2000"), now).unwrap();
        let r = l.grant("app2", 1, &ask(2, "a", 1, 1, 0x3, ""), now).unwrap_err();
        assert!(r.retryable && r.reason.contains("GPU bits 0x1 are in use"), "{r:?}");
        let r = l.grant("app2", 1, &ask(3, "a", 1, 1, 0, "2000"), now).unwrap_err();
        assert!(r.retryable && r.reason.contains("ports [2000]"), "{r:?}");
        let r = l.grant("app2", 1, &ask(4, "a", 7, 1, 0, ""), now).unwrap_err();
        assert!(r.retryable && r.reason.contains("CPUs"), "{r:?}");
        let r = l.grant("app2", 1, &ask(5, "a", 1, 901, 0, ""), now).unwrap_err();
        assert!(r.retryable && r.reason.contains("MB"), "{r:?}");

        for (a, what) in [
            (ask(6, "zz", 1, 1, 0, ""), "unknown host"),
            (ask(7, "b", 1, 1, 0x4, ""), "GPU bits 0x4 do not exist"),
            (ask(8, "b", 5, 1, 0, ""), "5 CPUs asked, the node has 4"),
            (ask(9, "b", 1, 501, 0, ""), "501 MB asked"),
            (ask(10, "b", 1, 1, 0, "2000"), "ports [2000] are not offered"),
        ] {
            let r = l.grant("app2", 1, &a, now).unwrap_err();
            assert!(!r.retryable && r.reason.contains(what), "{r:?} should say {what}");
            assert_eq!(r.request_id, a.request_id);
        }
        assert_eq!(l.num_containers("b"), 0, "rejections leave nothing behind");
    }

    #[test]
    fn complete_frees_exactly_and_only_once() {
        let mut l = ledger();
        let now = Instant::now();
        let c1 = l.grant("app", 1, &ask(1, "a", 2, 100, 0x1, "2000"), now).unwrap();
        let c2 = l.grant("app", 1, &ask(2, "a", 3, 200, 0x6, "2001-2002"), now).unwrap();
        let e = l.complete(&c1.container_id, 0, "done").unwrap();
        assert_eq!(
            (e.exit_status, e.was, e.app_id.as_str()),
            (0, ContainerState::Allocated, "app")
        );
        let used = l.node("a").unwrap().used();
        assert_eq!((used.cpu, used.memory_mb, used.gpu_mask), (3, 200, 0x6));
        assert_eq!(used.ports, PortSet::parse("2001-2002").unwrap());
        assert_eq!(l.complete(&c1.container_id, 0, "again"), None);
        assert_eq!(l.container(&c1.container_id).unwrap().exit_status, Some(0));
        l.mark_running(&c2.container_id).unwrap();
        assert!(matches!(
            l.mark_running(&c2.container_id),
            Err(LedgerError::WrongState { .. })
        ));
        assert_eq!(
            l.complete(&c2.container_id, 1, "x").unwrap().was,
            ContainerState::Running
        );
        assert!(l.all_free());
        // The freed bits can be granted again.
        l.grant("other", 1, &ask(3, "a", 8, 1000, 0xf, "2000-2009"), now)
            .unwrap();
    }

    #[test]
    fn unused_containers_expire() {
        let mut l = ledger();
        let t0 = Instant::now();
        let c1 = l.grant("app", 1, &ask(1, "a", 1, 1, 0x1, ""), t0).unwrap();
        let c2 = l.grant("app", 1, &ask(2, "a", 1, 1, 0x2, ""), t0).unwrap();
        l.mark_running(&c2.container_id).unwrap();
        assert!(l.expire(t0 + Duration::from_secs(5)).is_empty());
        let ended = l.expire(t0 + Duration::from_secs(11));
        assert_eq!(ended.len(), 1, "only the never-started one");
        assert_eq!(ended[0].container_id, c1.container_id);
        assert_eq!(ended[0].exit_status, -100);
        assert_eq!(ended[0].diagnostics, DIAG_EXPIRED);
        assert_eq!(l.node("a").unwrap().used().gpu_mask, 0x2);
    }

    /// Stopping a container already ended and held (its AM releases it, or stops it, after
    /// the RM ended it on a start whose answer was lost) keeps its resources held: only its
    /// node's report that it is dead frees them. Stopping it again changed nothing before
    /// it was dead and changes nothing after.
    #[test]
    fn a_held_container_stopped_again_stays_held_until_it_is_dead() {
        let mut l = ledger();
        let now = Instant::now();
        let c = l.grant("app", 1, &ask(1, "a", 1, 1, 0x3, ""), now).unwrap();
        l.mark_running(&c.container_id).unwrap();
        assert!(l.stop(&c.container_id, -100, "launch failed").is_some());
        let held = l.node("a").unwrap().used().gpu_mask;
        assert_ne!(held, 0, "held while its process may run");
        assert!(
            l.stop(&c.container_id, -100, "released by its AM").is_none(),
            "no second end"
        );
        assert_eq!(
            l.node("a").unwrap().used().gpu_mask,
            held,
            "still held after a second stop"
        );
        assert!(
            l.grant("app2", 1, &ask(2, "a", 1, 1, 0x1, ""), now).is_err(),
            "its GPUs are not granted again"
        );
        l.audit_usage().unwrap();
        assert!(
            l.complete(&c.container_id, 137, "reported dead").is_none(),
            "its app heard already"
        );
        assert!(l.node("a").unwrap().used().is_zero(), "freed once dead");
        assert!(l.stop(&c.container_id, -100, "again").is_none());
        assert!(l.node("a").unwrap().used().is_zero());
        l.audit_usage().unwrap();
    }

    #[test]
    fn lost_node_releases_its_containers() {
        let mut l = ledger();
        let now = Instant::now();
        let c = l.grant("app", 1, &ask(1, "b", 1, 1, 0x1, ""), now).unwrap();
        l.grant("app", 1, &ask(2, "a", 1, 1, 0x1, ""), now).unwrap();
        let e0 = l.epoch();
        let ended = l.mark_node_lost("b").unwrap();
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].container_id, c.container_id);
        assert_eq!(
            (ended[0].exit_status, ended[0].diagnostics.as_str()),
            (-100, DIAG_LOST_NODE)
        );
        assert_eq!(l.node("b").unwrap().state, NodeState::Lost);
        assert!(l.node("b").unwrap().used().is_zero());
        let changed: Vec<&str> = l.changed_since(e0).map(|(n, _)| n.host.as_str()).collect();
        assert_eq!(changed, vec!["b"]);
        let r = l.grant("app", 1, &ask(3, "b", 1, 1, 0, ""), now).unwrap_err();
        assert!(!r.retryable);
        assert!(l.mark_node_lost("nope").is_none());
        assert_eq!(l.live_containers_of("app").len(), 1);
    }

    #[test]
    fn baseline_used_is_never_granted_nor_freed() {
        let mut n = node("a", 8, 1000, 0xf, "2000-2009");
        n.set_used(Resources::with_mask(2, 100, 0x1, PortSet::parse("2000").unwrap()));
        let mut l = Ledger::new([n], Duration::from_secs(10));
        assert!(l.all_free(), "nothing of ours is live");
        let now = Instant::now();
        let r = l.grant("app", 1, &ask(1, "a", 1, 1, 0x1, ""), now).unwrap_err();
        assert!(r.retryable && r.reason.contains("0x1 are in use"), "{r:?}");
        let r = l.grant("app", 1, &ask(2, "a", 7, 1, 0, ""), now).unwrap_err();
        assert!(r.retryable, "6 CPUs free, 7 asked: {r:?}");
        let c = l.grant("app", 1, &ask(3, "a", 6, 900, 0xe, "2001"), now).unwrap();
        assert_eq!(l.node("a").unwrap().used().gpu_mask, 0xf);
        l.complete(&c.container_id, 0, "");
        let used = l.node("a").unwrap().used();
        assert_eq!((used.cpu, used.memory_mb, used.gpu_mask), (2, 100, 0x1));
        assert!(l.all_free());
    }

    #[test]
    fn max_capability_is_componentwise() {
        let l = ledger();
        let m = l.max_capability();
        assert_eq!((m.cpu, m.memory_mb, m.gpus, m.gpu_mask), (8, 1000, 4, 0xf));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Ask {
            app: u8,
            host: u8,
            cpu: u32,
            mem: u64,
            mask: u64,
            /// A share of the mask's lowest GPU, in hundredths (0 = whole GPUs).
            share: u32,
            nvme: u64,
            ports: Vec<u16>,
        },
        Release(usize),
        Dead(usize),
        Start(usize),
        Expire(u64),
        Lose(u8),
        /// The RM restarts: a new ledger recovers from the store.
        Restart,
        /// History retention forgets an application's completed containers.
        Forget(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..3, 0u8..3, 0u32..5, 0u64..400, 0u64..0x20, prop_oneof![Just(0u32), 1u32..100], 0u64..3, proptest::collection::vec(1998u16..2008, 0..3))
                .prop_map(|(app, host, cpu, mem, mask, share, nvme, ports)| Op::Ask { app, host, cpu, mem, mask, share, nvme, ports }),
            2 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::Dead),
            1 => any::<usize>().prop_map(Op::Start),
            1 => (0u64..20).prop_map(Op::Expire),
            1 => (0u8..4).prop_map(Op::Lose),
            1 => Just(Op::Restart),
            1 => (0u8..3).prop_map(Op::Forget),
        ]
    }

    fn nvme(n: u64) -> crate::resources::CustomResources {
        crate::resources::CustomResources::from_pairs([("nvme", n)])
    }

    /// The nodes of the property tests: `a` and `c` offer NVMe drives, `b` none.
    fn prop_nodes() -> Vec<Node> {
        let mut a = node("a", 8, 1000, 0xf, "2000-2005");
        a.set_total(a.total().clone().with_custom(nvme(2)));
        let mut c = node("c", 2, 300, 0x1f, "");
        c.set_total(c.total().clone().with_custom(nvme(1)));
        vec![a, node("b", 4, 500, 0x3, "2003-2007"), c]
    }

    fn prop_ask(i: usize, host: &str, (cpu, mem): (u32, u64), mask: u64, share: u32, n: u64, ports: Vec<u16>) -> Ask {
        let gpu_mask = if share > 0 && mask != 0 {
            mask & mask.wrapping_neg()
        } else {
            mask
        };
        Ask {
            request_id: i as u64,
            host: host.into(),
            cpu,
            memory_mb: mem,
            gpu_mask,
            gpu_shares: if share > 0 && gpu_mask != 0 {
                crate::resources::GpuShares::one(gpu_mask.trailing_zeros() as u8, share)
            } else {
                Default::default()
            },
            custom_resources: nvme(n),
            ports: PortSet::from_ports(ports),
            // Two roles, so the run index keeps roles apart.
            task: Some(format!("{}/{i}", ["w", "ps"][i % 2])),
            ..Default::default()
        }
    }

    /// The ledger's run index, and the same recomputed from every container, each sorted.
    #[allow(clippy::type_complexity)]
    fn run_index(l: &Ledger) -> (Vec<(String, String, Vec<u64>)>, Vec<(String, String, Vec<u64>)>) {
        let mut kept: Vec<(String, String, Vec<u64>)> = l
            .runs
            .by_role
            .iter()
            .flat_map(|(a, roles)| roles.iter().map(move |(r, v)| (a.clone(), r.clone(), v.clone())))
            .filter(|(_, _, v)| !v.is_empty())
            .collect();
        let mut fresh: HashMap<(String, String), Vec<u64>> = HashMap::new();
        for c in l.all_containers() {
            if let (Some(run), Some(role)) = (c.successful_run_ms(), c.role()) {
                fresh.entry((c.app_id.clone(), role.to_string())).or_default().push(run);
            }
        }
        let mut fresh: Vec<(String, String, Vec<u64>)> = fresh.into_iter().map(|((a, r), v)| (a, r, v)).collect();
        for v in [&mut kept, &mut fresh] {
            for (_, _, runs) in v.iter_mut() {
                runs.sort_unstable();
            }
            v.sort();
        }
        (kept, fresh)
    }

    /// Every node's books, from its live containers alone: per GPU index the hundredths
    /// held (whole = 100), NVMe drives, CPU, memory, ports. Checks on the way that no GPU
    /// passes one GPU, that no whole holder shares its GPU, and that nothing passes the
    /// node's total; and that the ledger's own `used` says the same.
    fn check_books(l: &Ledger) -> Result<(), TestCaseError> {
        for (n, count) in l.nodes() {
            let live: Vec<&LedgerContainer> = l
                .containers
                .values()
                .filter(|c| c.container.host == n.host && (c.state != ContainerState::Complete || c.held))
                .collect();
            prop_assert_eq!(live.len() as u32, count);
            let mut ports = PortSet::new();
            let (mut cpu, mut mem, mut drives) = (0u32, 0u64, 0u64);
            for g in 0..64u32 {
                let holders: Vec<u32> = live
                    .iter()
                    .map(|c| c.container.resources.gpu_hundredths(g))
                    .filter(|h| *h > 0)
                    .collect();
                let sum: u32 = holders.iter().sum();
                prop_assert!(sum <= 100, "GPU {} of {} holds {} hundredths", g, n.host, sum);
                prop_assert!(
                    holders.len() <= 1 || holders.iter().all(|h| *h < 100),
                    "a whole-GPU container shares GPU {} of {}: {:?}",
                    g,
                    n.host,
                    holders
                );
                prop_assert_eq!(n.used().gpu_hundredths(g), sum, "used GPU {} of {}", g, n.host);
                prop_assert!(sum == 0 || n.total().gpu_hundredths(g) == 100);
            }
            for c in &live {
                let r = &c.container.resources;
                prop_assert!(!ports.intersects(&r.ports));
                ports = ports.union(&r.ports);
                cpu += r.cpu;
                mem += r.memory_mb;
                drives += r.custom.get("nvme");
            }
            prop_assert!(cpu <= n.total().cpu && mem <= n.total().memory_mb);
            prop_assert!(drives <= n.total().custom.get("nvme"), "{} nvme on {}", drives, n.host);
            prop_assert!(ports.is_subset(&n.total().ports));
            prop_assert_eq!(
                (n.used().cpu, n.used().memory_mb, n.used().custom.get("nvme")),
                (cpu, mem, drives)
            );
            prop_assert_eq!(&n.used().ports, &ports);
        }
        Ok(())
    }

    /// What a node holds, per GPU index in hundredths and in custom units.
    fn books(l: &Ledger) -> Vec<(String, Vec<u32>, u64, u32, u64)> {
        l.nodes()
            .map(|(n, _)| {
                let u = n.used();
                (
                    n.host.clone(),
                    (0..8).map(|g| u.gpu_hundredths(g)).collect(),
                    u.custom.get("nvme"),
                    u.cpu,
                    u.memory_mb,
                )
            })
            .collect()
    }

    /// Writes what changed, as the RM does after each locked step.
    fn persist(l: &mut Ledger, store: &mut crate::rm::store::Store) {
        let changes = l.take_changes();
        let batch = crate::rm::store::Batch {
            meta: Some(crate::rm::store::Meta {
                cluster_ts: 1,
                next_app_seq: 1,
                reserved: Vec::new(),
                next_container_seq: l.next_container_seq(),
                reserved_by: Default::default(),
                removed_hosts: Default::default(),
            }),
            apps: Vec::new(),
            containers: changes.containers.iter().filter_map(|id| l.container(id)).collect(),
            nodes: changes
                .nodes
                .iter()
                .filter_map(|h| l.node(h).map(|n| (h.as_str(), n.state)))
                .collect(),
            agent_nodes: Vec::new(),
            forget_nodes: Vec::new(),
            whole: false,
        };
        store.write(&batch).expect("the test store takes every write");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// Grants, releases, deaths, expiries, lost nodes and RM restarts (recovery from
        /// the SQLite store), with whole GPUs, GPU shares and custom resources: never more
        /// than one GPU's hundredths on a GPU, never a whole-GPU container on a shared GPU,
        /// never more of anything than the node has; a restart neither loses nor creates a
        /// hundredth or an NVMe drive; in the end everything is free again.
        #[test]
        fn never_over_allocates(ops in proptest::collection::vec(op(), 1..80)) {
            let hosts = ["a", "b", "c"];
            let dir = tempfile::tempdir().expect("a temp dir");
            let mut store = crate::rm::store::Store::open(dir.path()).expect("a store");
            let mut l = Ledger::new(prop_nodes(), Duration::from_secs(10));
            let t0 = Instant::now();
            let mut granted: Vec<String> = Vec::new();
            let mut clock = 0u64;
            for (i, o) in ops.into_iter().enumerate() {
                let now = t0 + Duration::from_secs(clock);
                match o {
                    Op::Ask { app, host, cpu, mem, mask, share, nvme, ports } => {
                        let a = prop_ask(i, hosts[host as usize], (cpu, mem), mask, share, nvme, ports);
                        let free_before = l.node(&a.host).map(|n| n.total().subtract(n.used()));
                        match l.grant(&crate::rm::apps::app_id(1, u32::from(app) + 1), 1, &a, now) {
                            Ok(c) => {
                                prop_assert_eq!(&c.resources, &a.resources());
                                prop_assert!(a.resources().fits_in(&free_before.unwrap()));
                                granted.push(c.container_id);
                            }
                            Err(r) => prop_assert_eq!(r.request_id, a.request_id),
                        }
                    }
                    Op::Release(k) if !granted.is_empty() => {
                        // Half end successfully (their runs are learned from), half not.
                        let id = granted[k % granted.len()].clone();
                        l.stop(&id, if k % 2 == 0 { 0 } else { -100 }, "released");
                    }
                    Op::Dead(k) if !granted.is_empty() => {
                        let id = granted[k % granted.len()].clone();
                        l.complete(&id, 0, "dead");
                    }
                    Op::Start(k) if !granted.is_empty() => {
                        let id = granted[k % granted.len()].clone();
                        let _ = l.mark_running(&id);
                    }
                    Op::Expire(dt) => { clock += dt; l.expire(t0 + Duration::from_secs(clock)); }
                    Op::Lose(h) if (h as usize) < hosts.len() => { l.mark_node_lost(hosts[h as usize]); }
                    Op::Forget(app) => {
                        let id = crate::rm::apps::app_id(1, u32::from(app) + 1);
                        l.forget_app(&id);
                        granted.retain(|c| l.container(c).is_some());
                    }
                    Op::Restart => {
                        persist(&mut l, &mut store);
                        let before = books(&l);
                        let live_before = { let mut v = l.live_containers(); v.sort(); v };
                        drop(store);
                        store = crate::rm::store::Store::open(dir.path()).expect("the store opens again");
                        let r = store.recover().expect("recovered").expect("a saved state");
                        let mut next = Ledger::new(prop_nodes(), Duration::from_secs(10));
                        for (h, st) in &r.node_states {
                            next.set_node_state(h, *st);
                        }
                        let refused: Vec<Ended> = r.containers.into_iter()
                            .filter_map(|c| next.restore(c, now, crate::protocol::now_ms()))
                            .collect();
                        prop_assert!(refused.is_empty(), "nothing the ledger held is refused: {:?}", refused);
                        prop_assert_eq!(books(&next), before, "a restart keeps every hundredth and unit");
                        let live_after = { let mut v = next.live_containers(); v.sort(); v };
                        prop_assert_eq!(live_after, live_before);
                        l = next;
                    }
                    _ => {}
                }
                persist(&mut l, &mut store);
                check_books(&l)?;
                // The incremental usage equals the recomputed one after every step, and so
                // does the index of successful runs.
                prop_assert_eq!(l.audit_usage(), Ok(()));
                let (kept, fresh) = run_index(&l);
                prop_assert_eq!(kept, fresh);
            }
            for id in l.live_containers() {
                l.complete(&id, 0, "end");
            }
            prop_assert!(l.all_free());
        }
    }

    #[test]
    fn shares_fill_a_gpu_and_keep_whole_tasks_off_it() {
        let mut l = Ledger::new(prop_nodes(), Duration::from_secs(10));
        let now = Instant::now();
        let quarter = |id| prop_ask(id, "a", (1, 10), 0x1, 25, 0, vec![]);
        let mut held = Vec::new();
        for id in 0..4 {
            held.push(l.grant("app", 1, &quarter(id), now).expect("four quarters of GPU 0"));
        }
        let r = l.grant("app", 1, &quarter(4), now).unwrap_err();
        assert!(
            r.retryable && r.reason.contains("GPU share 0:0.25 asked, 0 left"),
            "{r:?}"
        );
        l.complete(&held[0].container_id, 0, "");
        let r = l.grant("app", 1, &ask(5, "a", 1, 10, 0x1, ""), now).unwrap_err();
        assert!(
            r.retryable && r.reason.contains("GPU bits 0x1 are in use"),
            "whole beside shares: {r:?}"
        );
        let c = l.grant("app", 1, &quarter(6), now).expect("the freed quarter");
        assert_eq!(c.resources.gpu_text(), "0x1 (0:0.25)");
        let used = l.node("a").unwrap().used();
        assert_eq!((used.gpu_mask, used.gpu_hundredths(0)), (0x1, 100));
        // Malformed: a share on a GPU the mask does not name.
        let mut bad = quarter(7);
        bad.gpu_mask = 0x2;
        let r = l.grant("app", 1, &bad, now).unwrap_err();
        assert!(!r.retryable && r.reason.contains("must be one share"), "{r:?}");
    }

    #[test]
    fn custom_resources_are_granted_only_where_free_and_impossible_where_absent() {
        let mut l = Ledger::new(prop_nodes(), Duration::from_secs(10));
        let now = Instant::now();
        let drive = |id, host| prop_ask(id, host, (1, 10), 0, 0, 1, vec![]);
        let c1 = l.grant("app", 1, &drive(1, "c"), now).expect("c has one drive");
        let r = l.grant("app", 1, &drive(2, "c"), now).unwrap_err();
        assert!(
            r.retryable && r.reason.contains("custom resources nvme=1 asked, none free"),
            "{r:?}"
        );
        let r = l.grant("app", 1, &drive(3, "b"), now).unwrap_err();
        assert!(
            !r.retryable && r.reason.contains("nvme=1 asked, the node offers none"),
            "{r:?}"
        );
        l.complete(&c1.container_id, 0, "");
        l.grant("app", 1, &drive(4, "c"), now).expect("freed again");
        assert_eq!(l.max_capability().custom.get("nvme"), 2);
    }

    proptest! {
        /// Freed only when dead: after `stop`, a running container's GPUs and ports are
        /// granted to no one until `complete` reports it dead; an allocated one (no
        /// process) is free at once.
        #[test]
        fn a_stopped_running_container_is_held_until_dead(
            start in any::<bool>(),
            asks_before_dead in 1usize..4,
        ) {
            let mut l = ledger();
            let now = Instant::now();
            let c = l.grant("app1", 1, &ask(1, "a", 1, 10, 0x3, "2000"), now).unwrap();
            if start {
                l.mark_running(&c.container_id).unwrap();
            }
            let ended = l.stop(&c.container_id, -100, "killed").unwrap();
            prop_assert_eq!(ended.was, if start { ContainerState::Running } else { ContainerState::Allocated });
            prop_assert_eq!(l.container(&c.container_id).unwrap().state, ContainerState::Complete);
            prop_assert!(l.live_containers_of("app1").is_empty(), "ended for its application");
            for i in 0..asks_before_dead {
                let got = l.grant("app2", 1, &ask(10 + i as u64, "a", 1, 10, 0x1, "2000"), now);
                prop_assert_eq!(got.is_ok(), !start, "held resources must not be granted: {:?}", got);
                if let Ok(g) = got {
                    l.complete(&g.container_id, 0, "");
                }
            }
            prop_assert_eq!(l.held_on("a").len(), usize::from(start));
            // Dead: freed, and not reported a second time.
            prop_assert!(l.complete(&c.container_id, 137, "dead").is_none());
            prop_assert!(l.held_on("a").is_empty());
            prop_assert!(l.grant("app2", 1, &ask(99, "a", 1, 10, 0x1, "2000"), now).is_ok());
        }
    }
}
