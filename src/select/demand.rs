//! What the rest of a job still needs, so that each per-task choice can look ahead:
//! the unplaced tasks by shape, and the hosts already holding the job's tasks.

use super::fast_hash::FastMap;

use crate::resources::{CustomResources, GpuMask, GpuShares, Resources, ANY_GPU, WHOLE};
use crate::spec::{JobSpec, TaskResources};

/// The size of one task, as far as "how many fit on this node" is concerned.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TaskShape {
    pub cpu: u32,
    pub memory_mb: u64,
    /// Whole GPUs (0 for a fractional task).
    pub gpus: u32,
    /// A fractional task's share of one GPU in hundredths; 0 for whole-GPU tasks.
    pub gpu_share: u32,
    /// Static and dynamic ports together.
    pub ports: u32,
    pub custom: CustomResources,
}

impl TaskShape {
    pub fn of(r: &TaskResources) -> Self {
        TaskShape {
            cpu: r.cpu,
            memory_mb: r.memory_mb,
            gpus: if r.gpu_share.is_some() { 0 } else { r.gpus },
            gpu_share: r.gpu_share.unwrap_or(0),
            ports: r.static_ports().count() + r.dynamic_port_count(),
            custom: r.custom.clone(),
        }
    }
}

/// The job-level context of one selection.
#[derive(Clone, Debug, Default)]
pub struct JobDemand {
    /// Does any task of the job ask for a GPU (the none-GPU filter is job-level).
    pub job_uses_gpus: bool,
    /// Unplaced tasks (the one being placed included), by shape, in job order.
    remaining: Vec<(TaskShape, u32)>,
    /// Tasks of this job per host (holding or asking for a container).
    hosts: FastMap<String, u32>,
    /// The GPUs those tasks hold or asked for, per host, where known (the union of
    /// the placement order).
    gpus: FastMap<String, GpuMask>,
    /// Some shape asks for a GPU share or a custom resource (else `capacity_with` takes
    /// its plain path).
    shares_or_custom: bool,
}

impl JobDemand {
    pub fn new(job_uses_gpus: bool) -> Self {
        JobDemand {
            job_uses_gpus,
            ..Default::default()
        }
    }

    /// Every task of the job waiting, none placed.
    pub fn for_job(job: &JobSpec) -> Self {
        let mut d = JobDemand::new(job.task_roles.iter().any(|r| r.resources.gpus > 0));
        for role in &job.task_roles {
            d.add_waiting(TaskShape::of(&role.resources), role.instances);
        }
        d
    }

    pub fn add_waiting(&mut self, shape: TaskShape, n: u32) {
        if n == 0 {
            return;
        }
        self.shares_or_custom |= shape.gpu_share > 0 || !shape.custom.is_empty();
        match self.remaining.iter_mut().find(|(s, _)| *s == shape) {
            Some((_, c)) => *c += n,
            None => self.remaining.push((shape, n)),
        }
    }

    pub fn add_host(&mut self, host: &str) {
        *self.hosts.entry(host.to_string()).or_insert(0) += 1;
    }

    /// GPUs the job holds (or asked for) on `host`, on top of [`JobDemand::add_host`].
    pub fn add_held(&mut self, host: &str, mask: GpuMask) {
        if mask != 0 {
            *self.gpus.entry(host.to_string()).or_insert(0) |= mask;
        }
    }

    /// The job's known GPUs on `host`.
    pub fn held_on(&self, host: &str) -> GpuMask {
        if self.gpus.is_empty() {
            return 0;
        }
        self.gpus.get(host).copied().unwrap_or(0)
    }

    /// GPUs the job holds or asked for, on every host.
    pub fn held_gpu_count(&self) -> u32 {
        self.gpus.values().map(|m| m.count_ones()).sum()
    }

    /// One task of `shape` got a place on `host` with GPUs `mask`.
    pub fn placed_with_gpus(&mut self, shape: &TaskShape, host: &str, mask: GpuMask) {
        self.placed(shape, host);
        self.add_held(host, mask);
    }

    /// One task of `shape` got a place on `host`.
    pub fn placed(&mut self, shape: &TaskShape, host: &str) {
        self.remove_waiting(shape);
        self.add_host(host);
    }

    /// One task of `shape` no longer waits (placed elsewhere, or given up).
    pub fn remove_waiting(&mut self, shape: &TaskShape) {
        if let Some(i) = self.remaining.iter().position(|(s, _)| s == shape) {
            self.remaining[i].1 -= 1;
            if self.remaining[i].1 == 0 {
                self.remaining.remove(i);
            }
        }
    }

    /// Unplaced tasks, the current one included.
    pub fn remaining_tasks(&self) -> u32 {
        self.remaining.iter().map(|(_, c)| c).sum()
    }

    /// Whether any of the job's tasks has a host yet.
    pub fn has_hosts(&self) -> bool {
        !self.hosts.is_empty()
    }

    pub fn tasks_on(&self, host: &str) -> u32 {
        if self.hosts.is_empty() {
            return 0;
        }
        self.hosts.get(host).copied().unwrap_or(0)
    }

    /// Tasks of this job (holding or asking for a container) on hosts other than `host`.
    pub fn tasks_elsewhere(&self, host: &str) -> u32 {
        self.hosts
            .iter()
            .filter(|(h, _)| h.as_str() != host)
            .map(|(_, c)| c)
            .sum()
    }

    pub fn hosts(&self) -> impl Iterator<Item = (&str, u32)> {
        self.hosts.iter().map(|(h, c)| (h.as_str(), *c))
    }

    /// How many of the unplaced tasks fit in `free` (greedy, shape by shape).
    pub fn capacity_in(&self, free: &Resources, min_port: u16) -> u32 {
        let ports = if self.remaining.iter().any(|(s, _)| s.ports > 0) {
            free.ports.count_at_least(min_port)
        } else {
            u32::MAX
        };
        self.capacity_with(
            free.cpu,
            free.memory_mb,
            free.whole_gpu_count(),
            &free.gpu_shares,
            ports,
            Some(&free.custom),
        )
    }

    /// [`JobDemand::capacity_in`] from plain amounts (`u32::MAX` = unlimited): `gpus`
    /// wholly free GPUs, `rooms` left on shared ones, `custom` free custom resources
    /// (`None` = unlimited).
    pub fn capacity_with(
        &self,
        cpu: u32,
        mem: u64,
        gpus: u32,
        rooms: &GpuShares,
        ports: u32,
        custom: Option<&CustomResources>,
    ) -> u32 {
        // The select pipeline calls this for every bucket and scored node: without shares
        // or custom resources in the job, the same loop compiled without those dimensions.
        if self.shares_or_custom {
            self.capacity_loop::<true>(cpu, mem, gpus, rooms, ports, custom)
        } else {
            self.capacity_loop::<false>(cpu, mem, gpus, rooms, ports, custom)
        }
    }

    /// The greedy fill of [`JobDemand::capacity_with`]; `EXTRA` = look at shares and
    /// custom resources too.
    fn capacity_loop<const EXTRA: bool>(
        &self,
        mut cpu: u32,
        mut mem: u64,
        mut gpus: u32,
        rooms: &GpuShares,
        mut ports: u32,
        custom: Option<&CustomResources>,
    ) -> u32 {
        let mut custom = custom
            .filter(|_| EXTRA && self.remaining.iter().any(|(s, _)| !s.custom.is_empty()))
            .cloned();
        let mut rooms: Vec<u32> = if EXTRA && self.remaining.iter().any(|(s, _)| s.gpu_share > 0) {
            rooms.iter().filter(|(i, _)| *i < ANY_GPU).map(|(_, h)| h).collect()
        } else {
            Vec::new()
        };
        let mut total = 0;
        for (s, count) in &self.remaining {
            let by_share = (EXTRA && s.gpu_share > 0).then(|| {
                let per_gpu = WHOLE / s.gpu_share;
                let in_rooms: u32 = rooms.iter().map(|r| r / s.gpu_share).sum();
                in_rooms.saturating_add(gpus.saturating_mul(per_gpu))
            });
            let by_custom = custom.as_ref().and_then(|c| {
                s.custom
                    .iter()
                    .map(|(n, q)| u32::try_from(c.get(n) / q).unwrap_or(u32::MAX))
                    .min()
            });
            let fit = [
                cpu.checked_div(s.cpu),
                mem.checked_div(s.memory_mb)
                    .map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
                gpus.checked_div(s.gpus),
                by_share,
                ports.checked_div(s.ports),
                by_custom,
            ]
            .into_iter()
            .flatten()
            .fold(*count, u32::min);
            cpu -= fit * s.cpu;
            mem -= u64::from(fit) * s.memory_mb;
            gpus -= fit * s.gpus;
            if EXTRA && s.gpu_share > 0 {
                gpus -= take_shares(&mut rooms, fit, s.gpu_share);
            }
            ports -= fit * s.ports;
            if let Some(c) = custom.as_mut() {
                for (n, q) in s.custom.iter() {
                    c.set(n, c.get(n).saturating_sub(q.saturating_mul(u64::from(fit))));
                }
            }
            total += fit;
        }
        total
    }
}

/// Places `n` shares of `share` hundredths best fit: into the fullest rooms first, then
/// on wholly free GPUs (whose rest becomes a room). Returns the whole GPUs opened; the
/// caller has checked that `n` fit.
fn take_shares(rooms: &mut Vec<u32>, n: u32, share: u32) -> u32 {
    let mut left = n;
    rooms.sort_unstable();
    for r in rooms.iter_mut() {
        let k = (*r / share).min(left);
        *r -= k * share;
        left -= k;
    }
    rooms.retain(|r| *r > 0);
    if left == 0 {
        return 0;
    }
    let per_gpu = WHOLE / share;
    let opened = left.div_ceil(per_gpu);
    let in_last = left - (opened - 1) * per_gpu;
    if WHOLE - in_last * share > 0 {
        rooms.push(WHOLE - in_last * share);
    }
    if per_gpu > 0 {
        rooms.extend(std::iter::repeat_n(WHOLE - per_gpu * share, opened as usize - 1).filter(|r| *r > 0));
    }
    opened
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::PortSet;

    fn shape(cpu: u32, gpus: u32) -> TaskShape {
        TaskShape {
            cpu,
            memory_mb: 1000,
            gpus,
            ..Default::default()
        }
    }

    #[test]
    fn capacity_counts_shares_best_fit_and_custom_units() {
        let mut d = JobDemand::new(true);
        d.add_waiting(
            TaskShape {
                cpu: 1,
                memory_mb: 1,
                gpu_share: 25,
                ..Default::default()
            },
            10,
        );
        // GPU 0 has 0.5 left, GPU 1 is free: 2 + 4 quarters.
        let free = Resources::with_mask(64, 100_000, 0x3, PortSet::new()).subtract(&Resources::with_share(
            0,
            0,
            0,
            50,
            PortSet::new(),
        ));
        assert_eq!(d.capacity_in(&free, 0), 6);
        // A 2-GPU task behind them finds no whole GPU left.
        d.add_waiting(shape(1, 1), 1);
        assert_eq!(d.capacity_in(&free, 0), 6);
        let mut d = JobDemand::new(false);
        d.add_waiting(
            TaskShape {
                cpu: 1,
                memory_mb: 1,
                custom: CustomResources::from_pairs([("nvme", 1)]),
                ..Default::default()
            },
            5,
        );
        let free = Resources::with_mask(64, 100_000, 0, PortSet::new())
            .with_custom(CustomResources::from_pairs([("nvme", 2)]));
        assert_eq!(d.capacity_in(&free, 0), 2);
        assert_eq!(
            d.capacity_in(&Resources::with_mask(64, 100_000, 0, PortSet::new()), 0),
            0
        );
    }

    #[test]
    fn shares_fill_the_fullest_rooms_first() {
        let mut rooms = vec![50, 30];
        assert_eq!(take_shares(&mut rooms, 1, 25), 0);
        assert_eq!(rooms, vec![5, 50], "the 0.3 room took it");
        assert_eq!(
            take_shares(&mut rooms, 6, 25),
            1,
            "two in the 0.5 room, four on a new GPU"
        );
        assert_eq!(rooms, vec![5]);
        let mut rooms = Vec::new();
        assert_eq!(take_shares(&mut rooms, 3, 40), 2);
        assert_eq!(rooms, vec![60, 20]);
    }

    #[test]
    fn capacity_counts_each_dimension_and_mixed_shapes() {
        let mut d = JobDemand::new(true);
        d.add_waiting(shape(4, 2), 4);
        let free = Resources::with_mask(64, 100_000, 0xff, PortSet::new());
        assert_eq!(d.capacity_in(&free, 0), 4);
        let free = Resources::with_mask(64, 100_000, 0x3f, PortSet::new());
        assert_eq!(d.capacity_in(&free, 0), 3, "6 GPUs hold three 2-GPU tasks");
        let free = Resources::with_mask(5, 100_000, 0xff, PortSet::new());
        assert_eq!(d.capacity_in(&free, 0), 1, "CPU limits");
        d.add_waiting(shape(1, 0), 2);
        let free = Resources::with_mask(10, 100_000, 0xff, PortSet::new());
        assert_eq!(d.capacity_in(&free, 0), 2 + 2);
    }

    #[test]
    fn placed_moves_a_task_from_remaining_to_its_host() {
        let mut d = JobDemand::new(true);
        d.add_waiting(shape(4, 2), 2);
        d.placed(&shape(4, 2), "h1");
        assert_eq!(d.remaining_tasks(), 1);
        assert_eq!(d.tasks_on("h1"), 1);
        d.placed(&shape(4, 2), "h1");
        assert_eq!(d.remaining_tasks(), 0);
        assert_eq!(d.tasks_on("h1"), 2);
    }
}
