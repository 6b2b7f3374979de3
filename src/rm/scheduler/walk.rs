//! The queue walk (issue 27, item 4), pure, with time passed in: when each waiting job is
//! expected to start, as the running work's expected ends free room and the jobs in the
//! queue take it in turn. The live RM's start estimates ([`super::reserved::estimates`],
//! one walk for every waiting application) and the simulator's (`sim::reserve`, one walk
//! per submitted job) are this walk.
//!
//! At each time (now, then each expected end), the waiting jobs are tried in queue order;
//! each that fits (its tasks packed by [`reservation`]'s rule on the room then, on the nodes
//! it may use) starts and holds its room for its expected duration (`None`: it never gives
//! it back, as far as the walk knows); a gang starts all its tasks together, a job that is no
//! gang one task after another as each fits. In order (FIFO), the first job that does not fit
//! blocks those behind it; otherwise (backfill) the others are still tried, as the RM's gate
//! lets whoever fits take room that nobody ranked ahead can use now. With a reservation, a
//! job other than its holder starts before the holder only where the reservation lets it
//! ([`Reservation::backfill`], by the job's own expected end), unless the reservation
//! exempts it: the RM's gate exempts the jobs ranked ahead of the holder, the simulator none.
//! A walk may be bounded (distinct times, packing work); the jobs it did not reach are left
//! without a start and the walk says it was cut.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use super::reservation::{pack, Release, Reservation, Room};

/// One waiting job: its tasks, how long each holds its room once started (ms; `None`:
/// unknown, never given back), the nodes it may use (`None`: all), and whether its tasks
/// start one by one (a job that is no gang: each task as it fits, in order) or all together
/// (a gang: all or none).
#[derive(Clone, Copy, Debug)]
pub struct Queued<'a> {
    pub tasks: &'a [Room],
    pub duration_ms: Option<u64>,
    pub eligible: Option<Nodes<'a>>,
    pub one_by_one: bool,
}

impl<'a> Queued<'a> {
    /// A gang that may use every node.
    pub fn gang(tasks: &'a [Room], duration_ms: Option<u64>) -> Self {
        Queued {
            tasks,
            duration_ms,
            eligible: None,
            one_by_one: false,
        }
    }
}

/// The nodes a job may use, by class: node `n` when `ok[class[n]]` (nodes alike for
/// placement share a class, so a job's flags are one per class, not one per node).
#[derive(Clone, Copy, Debug)]
pub struct Nodes<'a> {
    pub class: &'a [usize],
    pub ok: &'a [bool],
}

impl Nodes<'_> {
    fn allows(&self, n: usize) -> bool {
        self.class
            .get(n)
            .and_then(|&c| self.ok.get(c))
            .copied()
            .unwrap_or(false)
    }
}

/// How the walk takes the queue.
#[derive(Clone, Debug, Default)]
pub struct Discipline {
    /// FIFO: the first job that does not fit blocks those behind it.
    pub in_order: bool,
    /// A reservation: until its holder starts, the other jobs start only where it lets
    /// them (those it exempts aside).
    pub reservation: Option<Reserved>,
    /// Stop as soon as the job at this index has started (the others' starts are then
    /// as far as the walk got).
    pub watch: Option<usize>,
    /// At most this many distinct times are walked (`0`: no bound); the jobs not started
    /// by then are left `None`. Bounds the work of one walk on a large, busy cluster.
    pub max_steps: usize,
    /// At most this much packing work (tasks tried × nodes) is done (`0`: no bound); the
    /// walk stops there as at `max_steps`.
    pub max_work: usize,
}

/// The reservation a walk honours.
#[derive(Clone, Debug)]
pub struct Reserved {
    /// The index in the queue of the job that holds it.
    pub holder: usize,
    pub reservation: Reservation,
    /// The jobs at indices below this start freely (the RM's gate: those ranked ahead of
    /// the holder never yield to it; the simulator: none, `0`).
    pub exempt_below: usize,
}

/// A job tried and not fitted at one time: its tasks and where it may go (by address: jobs
/// of one application's shape share them).
type Tried<'a> = (&'a [Room], Option<(*const usize, *const bool)>);

/// A room freed at a time: (end ms, node, GPUs, CPU, memory MB), earliest first.
type End = Reverse<(u64, usize, u32, u32, u64)>;

/// What a walk found: each queued job's expected start (ms), and whether it stopped at its
/// step bound before every job was placed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Starts {
    /// When each job starts: a gang as a whole, a job of tasks one by one with its first.
    pub start_ms: Vec<Option<u64>>,
    /// Each job's node per task started, in task order, and when each started.
    pub nodes: Vec<Vec<usize>>,
    pub task_ms: Vec<Vec<u64>>,
    /// Each job the reservation held back at least once before it started.
    pub held_back: Vec<bool>,
    pub cut: bool,
}

impl Starts {
    /// When job `j`, of `tasks` tasks, has started them all (a gang: its start).
    pub fn last_ms(&self, j: usize, tasks: usize) -> Option<u64> {
        let times = self.task_ms.get(j)?;
        times.last().copied().filter(|_| times.len() == tasks)
    }
}

/// Nodes by free GPUs (the last bucket: that many or more): a necessary test of whether a
/// job can fit, in a few dozen steps instead of a pass over the nodes.
struct ByFree([u32; 65]);

impl ByFree {
    fn of(room: &[Room]) -> ByFree {
        let mut h = ByFree([0; 65]);
        for r in room {
            h.add(r.gpus);
        }
        h
    }

    fn bucket(gpus: u32) -> usize {
        gpus.min(64) as usize
    }

    fn add(&mut self, gpus: u32) {
        self.0[Self::bucket(gpus)] += 1;
    }

    fn moved(&mut self, from: u32, to: u32) {
        self.0[Self::bucket(from)] -= 1;
        self.0[Self::bucket(to)] += 1;
    }

    /// Whether `tasks` might fit: for each task size g, the nodes can hold at least as many
    /// tasks of g GPUs or more (a node of k free GPUs holds at most k / g of them).
    fn might_fit(&self, tasks: &[Room]) -> bool {
        let mut sizes: Vec<u32> = tasks.iter().map(|t| t.gpus).filter(|&g| g > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes.into_iter().all(|g| {
            let need = tasks.iter().filter(|t| t.gpus >= g).count() as u64;
            let slots: u64 = (g as usize..65)
                .map(|k| u64::from(self.0[k]) * (k as u64 / u64::from(g)))
                .sum();
            slots >= need
        })
    }
}

/// Where [`pack`] puts one task — the node that holds it with the fewest free GPUs, then the
/// lowest — found from the nodes ordered by (free GPUs, index) instead of a pass over all
/// of them; `scanned` counts the nodes looked at.
fn fit_one(
    room: &[Room],
    by_gpus: &BTreeSet<(u32, usize)>,
    task: &Room,
    eligible: Option<Nodes>,
    scanned: &mut usize,
) -> Option<usize> {
    by_gpus.range((task.gpus, 0)..).map(|&(_, n)| n).find(|&n| {
        *scanned += 1;
        eligible.is_none_or(|e| e.allows(n)) && room[n].holds(task)
    })
}

/// `room` with no room on the nodes `eligible` rules out.
fn masked(room: &[Room], eligible: Option<Nodes>) -> Option<Vec<Room>> {
    let e = eligible?;
    Some(
        room.iter()
            .enumerate()
            .map(|(n, r)| if e.allows(n) { *r } else { Room::default() })
            .collect(),
    )
}

/// Walks `queue` (in queue order) from the room `free` now, as the running work's `releases`
/// and the started jobs' durations free room (see the module doc).
pub fn starts(free: &[Room], releases: &[Release], queue: &[Queued], now_ms: u64, d: Discipline) -> Starts {
    let mut out = Starts {
        start_ms: vec![None; queue.len()],
        nodes: vec![Vec::new(); queue.len()],
        task_ms: vec![Vec::new(); queue.len()],
        held_back: vec![false; queue.len()],
        cut: false,
    };
    let mut room = free.to_vec();
    let mut ends: BinaryHeap<End> = releases
        .iter()
        .filter(|r| r.node < room.len())
        .filter_map(|r| Some(Reverse((r.end_ms?, r.node, r.room.gpus, r.room.cpu, r.room.memory_mb))))
        .collect();
    let mut free_gpus: u64 = room.iter().map(|r| u64::from(r.gpus)).sum();
    let mut by_free = ByFree::of(&room);
    // The nodes by free GPUs, for one task's fit (kept with `room`).
    let mut by_gpus: BTreeSet<(u32, usize)> = room.iter().enumerate().map(|(n, r)| (r.gpus, n)).collect();
    let mut pending: Vec<usize> = (0..queue.len()).collect();
    let mut reservation = d.reservation;
    let mut t = now_ms;
    let mut steps = 0usize;
    let mut work = 0usize;
    loop {
        if (d.max_steps > 0 && steps >= d.max_steps) || (d.max_work > 0 && work > d.max_work) {
            out.cut = true;
            return out;
        }
        steps += 1;
        while let Some(Reverse((e, node, gpus, cpu, mem))) = ends.peek().copied() {
            if e > t {
                break;
            }
            ends.pop();
            let r = &mut room[node];
            by_free.moved(r.gpus, r.gpus.saturating_add(gpus));
            by_gpus.remove(&(r.gpus, node));
            r.gpus = r.gpus.saturating_add(gpus);
            by_gpus.insert((r.gpus, node));
            r.cpu = r.cpu.saturating_add(cpu);
            r.memory_mb = r.memory_mb.saturating_add(mem);
            free_gpus += u64::from(gpus);
        }
        let mut k = 0;
        // Tasks that did not fit at this time: room only shrinks until the next end, so a
        // later job of the same tasks on the same nodes does not fit either.
        let mut failed: Vec<Tried> = Vec::new();
        while k < pending.len() {
            let j = pending[k];
            let job = &queue[j];
            // What is tried now: a gang's tasks together, else the next task, then the next.
            let mut done = false;
            let mut blocked = false;
            loop {
                let from = out.nodes[j].len();
                let tasks = if job.one_by_one {
                    &job.tasks[from..job.tasks.len().min(from + 1)]
                } else {
                    job.tasks
                };
                if tasks.is_empty() {
                    done = true;
                    break;
                }
                let need: u64 = tasks.iter().map(|r| u64::from(r.gpus)).sum();
                let key = (tasks, job.eligible.map(|e| (e.class.as_ptr(), e.ok.as_ptr())));
                let tried = free_gpus >= need && !failed.contains(&key) && by_free.might_fit(tasks);
                let at = match tasks {
                    _ if !tried => None,
                    // One task: from the ordered nodes, as many looked at as work.
                    [task] => {
                        let mut scanned = 0;
                        let at = fit_one(&room, &by_gpus, task, job.eligible, &mut scanned);
                        work = work.saturating_add(scanned.max(1));
                        at.map(|n| vec![n])
                    }
                    _ => {
                        work = work.saturating_add(tasks.len().saturating_mul(room.len()));
                        match masked(&room, job.eligible) {
                            Some(m) => pack(&m, tasks),
                            None => pack(&room, tasks),
                        }
                    }
                };
                if tried && d.max_work > 0 && work > d.max_work {
                    out.cut = true;
                    return out;
                }
                let Some(at) = at else {
                    if tried {
                        failed.push(key);
                    }
                    blocked = true;
                    break;
                };
                // Behind a reservation's holder that has not started: only what it lets pass.
                let held_back = match &mut reservation {
                    Some(r) if j != r.holder && j >= r.exempt_below => {
                        let takes: Vec<(usize, Room)> = at.iter().copied().zip(tasks.iter().copied()).collect();
                        !r.reservation
                            .backfill(&takes, job.duration_ms.map(|x| t.saturating_add(x)))
                    }
                    _ => false,
                };
                if held_back {
                    out.held_back[j] |= out.start_ms[j].is_none();
                    blocked = true;
                    break;
                }
                out.start_ms[j].get_or_insert(t);
                for (task, &node) in tasks.iter().zip(&at) {
                    let n = &mut room[node];
                    by_free.moved(n.gpus, n.gpus.saturating_sub(task.gpus));
                    by_gpus.remove(&(n.gpus, node));
                    n.gpus = n.gpus.saturating_sub(task.gpus);
                    by_gpus.insert((n.gpus, node));
                    n.cpu = n.cpu.saturating_sub(task.cpu);
                    n.memory_mb = n.memory_mb.saturating_sub(task.memory_mb);
                    free_gpus = free_gpus.saturating_sub(u64::from(task.gpus));
                    if let Some(x) = job.duration_ms {
                        ends.push(Reverse((
                            t.saturating_add(x),
                            node,
                            task.gpus,
                            task.cpu,
                            task.memory_mb,
                        )));
                    }
                }
                out.task_ms[j].extend(std::iter::repeat_n(t, at.len()));
                out.nodes[j].extend(at);
                if !job.one_by_one {
                    done = true;
                    break;
                }
            }
            if !done {
                if d.in_order && blocked {
                    break;
                }
                k += 1;
                continue;
            }
            // (A job with no task to start starts now.)
            out.start_ms[j].get_or_insert(t);
            if reservation.as_ref().is_some_and(|r| r.holder == j) {
                reservation = None;
            }
            pending.remove(k);
            if d.watch == Some(j) || pending.is_empty() {
                return out;
            }
        }
        match ends.peek() {
            Some(e) => t = e.0 .0,
            None => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reservation::tests::{g, rel};
    use super::super::reservation::{reserve, Reservation};
    use super::*;

    fn q<'a>(tasks: &'a [Room], duration_ms: Option<u64>) -> Queued<'a> {
        Queued::gang(tasks, duration_ms)
    }

    fn backfill() -> Discipline {
        Discipline::default()
    }

    #[test]
    fn every_job_gets_its_start_in_one_walk() {
        // Two 8-GPU nodes: node 0 frees 8 at 100, node 1 frees 4 at 50 and 4 at 300.
        let free = [g(0), g(0)];
        let releases = [rel(0, 8, Some(100)), rel(1, 4, Some(50)), rel(1, 4, Some(300))];
        let (eight, four, gang) = ([g(8)], [g(4)], [g(8), g(8)]);
        // An 8-GPU job of 1000 ms takes node 0 at 100; the 4-GPU job behind it backfills
        // node 1's four at 50; the gang waits for both nodes: 1100.
        let queue = [q(&eight, Some(1000)), q(&four, Some(10)), q(&gang, Some(5))];
        let s = starts(&free, &releases, &queue, 0, backfill());
        assert_eq!(s.start_ms, vec![Some(100), Some(50), Some(1100)]);
        assert!(!s.cut);
        // FIFO: the 4-GPU job waits for the one ahead (it starts at 100, on node 1).
        let fifo = Discipline {
            in_order: true,
            ..Discipline::default()
        };
        assert_eq!(
            starts(&free, &releases, &queue, 0, fifo).start_ms,
            vec![Some(100), Some(100), Some(1100)]
        );
        // A job ahead with no known duration never gives node 0 back: no start for the gang.
        let unknown = [q(&eight, None), q(&gang, Some(5))];
        assert_eq!(
            starts(&free, &releases, &unknown, 0, backfill()).start_ms,
            vec![Some(100), None]
        );
        // Watching the 4-GPU job: the walk stops when it starts.
        let watch = Discipline {
            watch: Some(1),
            ..Discipline::default()
        };
        assert_eq!(
            starts(&free, &releases, &queue, 0, watch).start_ms,
            vec![None, Some(50), None]
        );
        // A step bound: only now and 50 are walked.
        let short = Discipline {
            max_steps: 2,
            ..Discipline::default()
        };
        let s = starts(&free, &releases, &queue, 0, short);
        assert_eq!((s.start_ms, s.cut), (vec![None, Some(50), None], true));
        // A work bound of 3: the one-task jobs' fits (a node looked at each) stay within it,
        // the gang's packing (two tasks on two nodes) goes past it.
        let tight = Discipline {
            max_work: 3,
            ..Discipline::default()
        };
        let s = starts(&free, &releases, &queue, 0, tight);
        assert_eq!((s.start_ms, s.cut), (vec![Some(100), Some(50), None], true));
    }

    proptest::proptest! {
        /// One task's fit from the ordered nodes is the reservation rule's packing of it, on
        /// the nodes the job may use.
        #[test]
        fn one_tasks_fit_is_the_packing_rule(
            nodes in proptest::collection::vec((0u32..9, 0u32..4, 0u64..4, 0usize..2), 1..12),
            task in (1u32..9, 0u32..4, 0u64..4),
            typed in proptest::bool::ANY,
        ) {
            let room: Vec<Room> = nodes.iter().map(|&(gpus, cpu, memory_mb, _)| Room { gpus, cpu, memory_mb }).collect();
            let class: Vec<usize> = nodes.iter().map(|n| n.3).collect();
            let ok = [true, false];
            let eligible = typed.then_some(Nodes { class: &class, ok: &ok });
            let task = Room { gpus: task.0, cpu: task.1, memory_mb: task.2 };
            let by_gpus: BTreeSet<(u32, usize)> = room.iter().enumerate().map(|(n, r)| (r.gpus, n)).collect();
            let mut scanned = 0;
            let fit = fit_one(&room, &by_gpus, &task, eligible, &mut scanned);
            let packed = pack(&masked(&room, eligible).unwrap_or_else(|| room.clone()), &[task]).map(|at| at[0]);
            proptest::prop_assert_eq!(fit, packed);
            proptest::prop_assert!(scanned <= room.len());
        }

        /// One job alone starts where the reservation rule says it fits first; watching a
        /// job never changes its start; FIFO starts come in queue order; and no job starts
        /// before now or before room it needs could exist (more GPUs than are free then, as
        /// the running work and the jobs started before it have ended).
        #[test]
        fn the_walk_agrees_with_the_reservation_rule_and_with_itself(
            free in proptest::collection::vec(0u32..9, 1..4),
            rels in proptest::collection::vec((0usize..3, 1u32..9, proptest::option::of(1u64..100)), 0..6),
            jobs in proptest::collection::vec(
                (proptest::collection::vec(1u32..9, 1..4), proptest::option::of(1u64..150), proptest::bool::ANY),
                1..5,
            ),
            in_order in proptest::bool::ANY,
        ) {
            let free: Vec<Room> = free.into_iter().map(g).collect();
            let rels: Vec<Release> = rels.into_iter().map(|(n, k, e)| rel(n % free.len(), k, e)).collect();
            let tasks: Vec<Vec<Room>> = jobs.iter().map(|(t, _, _)| t.iter().copied().map(g).collect()).collect();
            let queue: Vec<Queued> = tasks
                .iter()
                .zip(&jobs)
                .map(|(t, (_, d, one_by_one))| Queued { one_by_one: *one_by_one, ..q(t, *d) })
                .collect();
            let d = Discipline { in_order, ..Discipline::default() };
            let placed = starts(&free, &rels, &queue, 0, d.clone());
            let all = placed.start_ms.clone();
            let alone = starts(&free, &rels, &queue[..1], 0, d.clone());
            let gang = reserve(&free, &rels, &tasks[0], 0).map(|r| r.start_ms);
            if jobs[0].2 {
                // Task by task, it starts no later than as a gang.
                proptest::prop_assert!(gang.is_none_or(|g| alone.start_ms[0].is_some_and(|s| s <= g)));
            } else {
                proptest::prop_assert_eq!(alone.start_ms[0], gang);
            }
            for (k, start) in all.iter().enumerate() {
                let watched = starts(&free, &rels, &queue, 0, Discipline { watch: Some(k), ..d.clone() });
                proptest::prop_assert_eq!(watched.start_ms[k], *start);
                proptest::prop_assert_eq!(&watched.task_ms[k], &placed.task_ms[k]);
                // Its first and last task's starts, as recorded per task; a job's tasks start
                // in order; all of them, or it has no last start.
                let times = &placed.task_ms[k];
                proptest::prop_assert_eq!(times.first().copied(), *start);
                proptest::prop_assert!(times.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert_eq!(placed.nodes[k].len(), times.len());
                proptest::prop_assert!(times.len() <= tasks[k].len());
                if !jobs[k].2 {
                    proptest::prop_assert!(times.iter().all(|&x| Some(x) == *start), "a gang starts whole");
                }
                if in_order && k > 0 {
                    // FIFO: no job starts before the one ahead has started all its tasks.
                    let ahead = placed.last_ms(k - 1, tasks[k - 1].len());
                    if let (Some(a), Some(b)) = (ahead, *start) {
                        proptest::prop_assert!(a <= b, "FIFO: {:?}", placed);
                    }
                    if ahead.is_none() {
                        proptest::prop_assert!(start.is_none(), "FIFO: {:?}", placed);
                    }
                }
            }
            // At each task's start, no node holds more than it has: what is free now and what
            // has ended there by then, less the tasks started by then and not ended.
            for t in placed.task_ms.iter().flatten().copied() {
                let mut room: Vec<i64> = free.iter().map(|r| i64::from(r.gpus)).collect();
                for r in rels.iter().filter(|r| r.end_ms.is_some_and(|e| e <= t)) {
                    room[r.node] += i64::from(r.room.gpus);
                }
                for j in 0..queue.len() {
                    for ((task, &n), &s) in tasks[j].iter().zip(&placed.nodes[j]).zip(&placed.task_ms[j]) {
                        if s <= t && jobs[j].1.is_none_or(|dur| s + dur > t) {
                            room[n] -= i64::from(task.gpus);
                        }
                    }
                }
                proptest::prop_assert!(room.iter().all(|&r| r >= 0), "at {}: {:?} {:?}", t, room, placed);
            }
        }
    }

    #[test]
    fn a_job_only_takes_the_nodes_it_may_use() {
        // Node 0 (type A) frees 8 at 100, node 1 (type B) is free now.
        let free = [g(0), g(8)];
        let releases = [rel(0, 8, Some(100))];
        let (class, only_a) = ([0, 1], [true, false]);
        let eight = [g(8)];
        let a_job = Queued {
            one_by_one: false,
            tasks: &eight,
            duration_ms: Some(500),
            eligible: Some(Nodes {
                class: &class,
                ok: &only_a,
            }),
        };
        // The A job waits for node 0 although node 1 is free; the job behind it, of any
        // type, takes node 1 now; a second A job waits for the first: 600.
        let queue = [a_job, q(&eight, Some(1)), a_job];
        assert_eq!(
            starts(&free, &releases, &queue, 0, backfill()).start_ms,
            vec![Some(100), Some(0), Some(600)]
        );
    }

    #[test]
    fn behind_a_reservation_only_what_it_lets_pass_starts_first() {
        // Two 8-GPU nodes: node 0 frees 8 at 100, node 1 has 4 free and frees 4 at 200. The
        // gang of 2 × 8 (ahead) is reserved for 200.
        let free = [g(0), g(4)];
        let releases = [rel(0, 8, Some(100)), rel(1, 4, Some(200))];
        let (gang, four) = ([g(8), g(8)], [g(4)]);
        let res: Reservation = reserve(&free, &releases, &gang, 0).unwrap();
        assert_eq!(res.start_ms, 200);
        let reserved = |queue: &[Queued]| {
            let d = Discipline {
                reservation: Some(Reserved {
                    holder: 0,
                    reservation: res.clone(),
                    exempt_below: 0,
                }),
                ..Discipline::default()
            };
            starts(&free, &releases, queue, 0, d).start_ms
        };
        // Without the reservation, a long 4-GPU job behind the gang takes node 1's four now
        // and delays the gang; with it, it waits for the gang to start and end.
        let long = [q(&gang, Some(1000)), q(&four, Some(5000))];
        assert_eq!(
            starts(&free, &releases, &long, 0, backfill()).start_ms,
            vec![Some(5000), Some(0)]
        );
        assert_eq!(reserved(&long), vec![Some(200), Some(1200)]);
        // A job declared to end by the gang's start backfills now.
        let short = [q(&gang, Some(1000)), q(&four, Some(150))];
        assert_eq!(reserved(&short), vec![Some(200), Some(0)]);
    }
}
