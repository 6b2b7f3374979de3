//! What the rest of a job still needs, so that each per-task choice can look ahead:
//! the unplaced tasks by shape, and the hosts already holding the job's tasks.

use super::fast_hash::FastMap;

use crate::resources::{GpuMask, Resources};
use crate::spec::{JobSpec, TaskResources};

/// The size of one task, as far as "how many fit on this node" is concerned.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TaskShape {
    pub cpu: u32,
    pub memory_mb: u64,
    pub gpus: u32,
    /// Static and dynamic ports together.
    pub ports: u32,
}

impl TaskShape {
    pub fn of(r: &TaskResources) -> Self {
        TaskShape {
            cpu: r.cpu,
            memory_mb: r.memory_mb,
            gpus: r.gpus,
            ports: r.static_ports().count() + r.dynamic_port_count(),
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
        self.capacity_with(free.cpu, free.memory_mb, free.gpu_count(), ports)
    }

    /// [`JobDemand::capacity_in`] from plain amounts (`u32::MAX` = unlimited).
    pub fn capacity_with(&self, mut cpu: u32, mut mem: u64, mut gpus: u32, mut ports: u32) -> u32 {
        let mut total = 0;
        for (s, count) in &self.remaining {
            let fit = [
                cpu.checked_div(s.cpu),
                mem.checked_div(s.memory_mb)
                    .map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
                gpus.checked_div(s.gpus),
                ports.checked_div(s.ports),
            ]
            .into_iter()
            .flatten()
            .fold(*count, u32::min);
            cpu -= fit * s.cpu;
            mem -= u64::from(fit) * s.memory_mb;
            gpus -= fit * s.gpus;
            ports -= fit * s.ports;
            total += fit;
        }
        total
    }
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
            ports: 0,
        }
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
