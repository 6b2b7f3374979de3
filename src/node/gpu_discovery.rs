//! Discovery of this machine's real GPUs for nodes marked `local: true`.
//!
//! Owns running `nvidia-smi` (with a time limit, never panicking) and parsing what it
//! prints: the GPU list (`--query-gpu=index,name --format=csv,noheader`), a short GPU type
//! for the node view, and the raw `nvidia-smi topo -m` matrix for the topology module.
//! A machine without `nvidia-smi` on PATH simply has no local GPUs (`None`).
//!
//! Blocking: [`discover`] waits for `nvidia-smi` (up to [`TIMEOUT`] per call); call it at
//! start-up or from `tokio::task::spawn_blocking`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Longest time one `nvidia-smi` call may take (a wedged driver can hang it for minutes).
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// The GPUs of this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalGpus {
    pub count: u32,
    /// Short type of GPU 0 (see [`short_gpu_type`]); empty when there is no GPU.
    pub gpu_type: String,
    /// Full names, in index order.
    pub names: Vec<String>,
    /// `nvidia-smi topo -m` output (ANSI escapes removed), when it ran and printed something.
    pub topo_text: Option<String>,
}

/// Runs `nvidia-smi` when it is on PATH; `None` when it is not, fails, times out or
/// reports no GPU.
pub fn discover() -> Option<LocalGpus> {
    let program = find_on_path("nvidia-smi")?;
    discover_with(&program, TIMEOUT)
}

/// [`discover`] with an explicit `nvidia-smi` program and time limit.
pub fn discover_with(program: &Path, timeout: Duration) -> Option<LocalGpus> {
    let csv = run_with_timeout(program, &["--query-gpu=index,name", "--format=csv,noheader"], timeout)?;
    let gpus = match parse_query_gpu(&csv) {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!("ignoring the output of {} --query-gpu: {e}", program.display());
            return None;
        }
    };
    if gpus.is_empty() {
        return None;
    }
    let names: Vec<String> = gpus.into_iter().map(|(_, name)| name).collect();
    let topo_text = run_with_timeout(program, &["topo", "-m"], timeout)
        .map(|t| strip_ansi(&t))
        .filter(|t| !t.trim().is_empty());
    Some(LocalGpus {
        count: u32::try_from(names.len()).unwrap_or(u32::MAX),
        gpu_type: short_gpu_type(&names[0]),
        names,
        topo_text,
    })
}

/// Parses `index, name` lines (`nvidia-smi --query-gpu=index,name --format=csv,noheader`)
/// into `(index, name)` sorted by index. Blank lines are skipped; a line without a comma, a
/// non-numeric index, an empty name or a repeated index is an error naming the line.
pub fn parse_query_gpu(csv: &str) -> Result<Vec<(u32, String)>, String> {
    let mut out: Vec<(u32, String)> = Vec::new();
    for (n, line) in csv.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let lineno = n + 1;
        let (index, name) = line
            .split_once(',')
            .ok_or_else(|| format!("line {lineno}: `{line}` is not `index, name`"))?;
        let index: u32 = index
            .trim()
            .parse()
            .map_err(|_| format!("line {lineno}: GPU index `{}` is not a number", index.trim()))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("line {lineno}: GPU {index} has no name"));
        }
        if out.iter().any(|(i, _)| *i == index) {
            return Err(format!("line {lineno}: GPU index {index} appears twice"));
        }
        out.push((index, name.to_string()));
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(out)
}

/// Brand words that say nothing about the model.
const BRANDS: [&str; 5] = ["NVIDIA", "TESLA", "GEFORCE", "QUADRO", "GRID"];
/// Series words that need the following number to mean something (`RTX 3090`).
const SERIES: [&str; 3] = ["RTX", "GTX", "TITAN"];

/// A short GPU type from the full name, for `gpuType` filters.
///
/// Rule: split the name into words, and each word at its first `-` keeping the left part
/// (`V100-SXM2-16GB` → `V100`); drop brand words (NVIDIA, Tesla, GeForce, Quadro, GRID);
/// the type is the first word left, except that a series word (RTX, GTX, TITAN) followed by
/// a word of digits (or of at most two characters) is joined with it (`GeForce RTX 3090` →
/// `RTX3090`, `TITAN V` → `TITANV`), and a series word followed by a model word is dropped
/// (`NVIDIA RTX A6000` → `A6000`). Memory sizes and form factors after the model are
/// ignored (`H100 80GB HBM3` → `H100`). A name with nothing left is returned trimmed with
/// spaces replaced by `-`.
///
/// `"NVIDIA H100 80GB HBM3"` → `H100`, `"Tesla V100-SXM2-16GB"` → `V100`,
/// `"NVIDIA A100-SXM4-40GB"` → `A100`, `"Tesla T4"` → `T4`.
pub fn short_gpu_type(name: &str) -> String {
    let words: Vec<&str> = name
        .split_whitespace()
        .map(|w| w.split('-').next().unwrap_or(w))
        .filter(|w| !w.is_empty() && !BRANDS.contains(&w.to_ascii_uppercase().as_str()))
        .collect();
    let Some(first) = words.first() else {
        return name.split_whitespace().collect::<Vec<_>>().join("-");
    };
    if SERIES.contains(&first.to_ascii_uppercase().as_str()) {
        if let Some(next) = words.get(1) {
            if next.bytes().all(|b| b.is_ascii_digit()) || next.len() <= 2 {
                return format!("{first}{next}");
            }
            return (*next).to_string();
        }
    }
    (*first).to_string()
}

/// The first executable file called `name` in `$PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Runs `program args`, returning its stdout if it exits with 0 within `timeout`; a
/// program that runs longer is killed. stdout is read on a helper thread so that a large
/// output cannot block the child on a full pipe.
fn run_with_timeout(program: &Path, args: &[&str], timeout: Duration) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| tracing::warn!("cannot run {}: {e}", program.display()))
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    // The reader finishes when the child (and anything holding its stdout) exits.
    let output = rx.recv_timeout(timeout);
    let finished = match child.try_wait() {
        Ok(Some(status)) => Some(status),
        _ => {
            // Still running (or its stdout still held open): give it a moment, then kill it.
            let deadline = std::time::Instant::now() + Duration::from_millis(200);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if std::time::Instant::now() < deadline && output.is_ok() => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break None;
                    }
                }
            }
        }
    };
    match (finished, output) {
        (Some(status), Ok(buf)) if status.success() => Some(String::from_utf8_lossy(&buf).into_owned()),
        (Some(status), _) => {
            tracing::info!("{} {} failed: {status}", program.display(), args.join(" "));
            None
        }
        (None, _) => {
            tracing::warn!(
                "{} {} did not finish within {timeout:?}; killed",
                program.display(),
                args.join(" ")
            );
            None
        }
    }
}

/// Removes ANSI escape sequences (`ESC [ ... final`), which newer drivers put around the
/// `topo -m` header.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters and intermediates, up to the final byte in '@'..='~'.
                for c2 in chars.by_ref() {
                    if ('@'..='~').contains(&c2) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    const H100_CSV: &str = "0, NVIDIA H100 80GB HBM3\n1, NVIDIA H100 80GB HBM3\n";

    const DGX1_CSV: &str = "\
0, Tesla V100-SXM2-16GB
1, Tesla V100-SXM2-16GB
2, Tesla V100-SXM2-16GB
3, Tesla V100-SXM2-16GB
4, Tesla V100-SXM2-16GB
5, Tesla V100-SXM2-16GB
6, Tesla V100-SXM2-16GB
7, Tesla V100-SXM2-16GB
";

    const TOPO_2GPU: &str = "\t\u{1b}[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m
GPU0\t X \tNV18\t0-31\t0\t\tN/A
GPU1\tNV18\t X \t0-31\t0\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
";

    #[test]
    fn parses_query_gpu_output() {
        let gpus = parse_query_gpu(H100_CSV).unwrap();
        assert_eq!(
            gpus,
            vec![
                (0, "NVIDIA H100 80GB HBM3".to_string()),
                (1, "NVIDIA H100 80GB HBM3".to_string())
            ]
        );
        assert_eq!(parse_query_gpu(DGX1_CSV).unwrap().len(), 8);
        // Out of order, CRLF and blank lines.
        let gpus = parse_query_gpu("1, Tesla T4\r\n\r\n0, Tesla T4\r\n").unwrap();
        assert_eq!(gpus[0], (0, "Tesla T4".to_string()));
        assert_eq!(gpus[1].0, 1);
        assert_eq!(parse_query_gpu("").unwrap(), vec![]);
    }

    #[test]
    fn query_gpu_errors_name_the_line() {
        let e = parse_query_gpu("0, Tesla T4\nNo devices were found\n").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = parse_query_gpu("x, Tesla T4").unwrap_err();
        assert!(e.contains("line 1") && e.contains("`x`"), "{e}");
        assert!(parse_query_gpu("0, ").unwrap_err().contains("no name"));
        assert!(parse_query_gpu("0, A\n0, B").unwrap_err().contains("twice"));
    }

    #[test]
    fn short_types() {
        let cases = [
            ("NVIDIA H100 80GB HBM3", "H100"),
            ("Tesla V100-SXM2-16GB", "V100"),
            ("NVIDIA A100-SXM4-40GB", "A100"),
            ("NVIDIA A100 80GB PCIe", "A100"),
            ("Tesla P100-PCIE-16GB", "P100"),
            ("Tesla K80", "K80"),
            ("Tesla T4", "T4"),
            ("NVIDIA H200", "H200"),
            ("NVIDIA H200 NVL", "H200"),
            ("NVIDIA H100 PCIe", "H100"),
            ("NVIDIA H100 NVL", "H100"),
            ("NVIDIA GH200 480GB", "GH200"),
            ("NVIDIA L40S", "L40S"),
            ("NVIDIA A10G", "A10G"),
            ("NVIDIA GeForce RTX 3090", "RTX3090"),
            ("GeForce GTX 1080 Ti", "GTX1080"),
            ("NVIDIA RTX A6000", "A6000"),
            ("Quadro RTX 8000", "RTX8000"),
            ("NVIDIA TITAN V", "TITANV"),
            ("NVIDIA", "NVIDIA"),
        ];
        for (name, want) in cases {
            assert_eq!(short_gpu_type(name), want, "{name}");
        }
    }

    #[test]
    fn strips_ansi_escapes() {
        let t = strip_ansi(TOPO_2GPU);
        assert!(t.starts_with("\tGPU0\tGPU1\tCPU Affinity"), "{t:?}");
        assert!(!t.contains('\u{1b}'));
        assert!(t.contains("GPU0\t X \tNV18"));
    }

    /// A fake `nvidia-smi` script answering both calls like a 2×H100 machine.
    fn fake_smi(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let p = dir.join("nvidia-smi");
        let mut f = std::fs::File::create(&p).unwrap();
        write!(f, "#!/bin/sh\n{body}\n").unwrap();
        drop(f);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// Discovery through a fake `nvidia-smi` printing `csv` for the GPU query and `topo` for
    /// `topo -m`.
    fn discover_fake(csv: &str, topo: &str) -> LocalGpus {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("csv"), csv).unwrap();
        std::fs::write(tmp.path().join("topo"), topo).unwrap();
        let dir = tmp.path().display();
        let smi = fake_smi(
            tmp.path(),
            &format!("if [ \"$1\" = topo ]; then cat '{dir}/topo'; else cat '{dir}/csv'; fi"),
        );
        discover_with(&smi, Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn discovers_with_a_fake_nvidia_smi() {
        let gpus = discover_fake(H100_CSV, TOPO_2GPU);
        assert_eq!(gpus.count, 2);
        assert_eq!(gpus.gpu_type, "H100");
        assert_eq!(gpus.names[1], "NVIDIA H100 80GB HBM3");
        let topo = gpus.topo_text.unwrap();
        assert!(topo.contains("GPU1\tNV18\t X "), "{topo}");
        assert!(!topo.contains('\u{1b}'));
    }

    /// `nvidia-smi topo -m` of a one-H200 machine with one NIC, as new drivers print it
    /// (ANSI-underlined header, `GPU NUMA ID` column, a NIC row, `NIC Legend`); the same
    /// file the gpu_check test's fake nvidia-smi prints.
    const H200_TOPO: &str = include_str!("../../integration/gpu_check/h200-topo.txt");

    #[test]
    fn discovers_one_h200_with_its_nic() {
        let gpus = discover_fake("0, NVIDIA H200\n", H200_TOPO);
        assert_eq!((gpus.count, gpus.gpu_type.as_str()), (1, "H200"));
        let topo = crate::topology::Topology::from_spec(&gpus.topo_text.unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(topo.gpu_count(), 1);
        assert_eq!(topo.nics().len(), 1);
        assert_eq!(topo.nics()[0].name, "mlx5_0");
        assert_eq!(topo.affinity()[0].numa, Some(0));
    }

    #[test]
    fn one_gpu_vm_topologies_parse() {
        // A VM: no NIC, the NUMA node unknown.
        let vm = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\tN/A\t\tN/A\n\nLegend:\n\n  X    = Self\n";
        let topo = crate::topology::Topology::from_spec(vm).unwrap().unwrap();
        assert_eq!((topo.gpu_count(), topo.nics().len()), (1, 0));
        assert_eq!(topo.affinity()[0].numa, None);
        // Older drivers: no NUMA columns at all.
        let old = "\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n";
        assert_eq!(
            crate::topology::Topology::from_spec(old).unwrap().unwrap().gpu_count(),
            1
        );
    }

    #[test]
    fn failing_hanging_or_gpu_less_nvidia_smi_gives_none() {
        let tmp = tempfile::tempdir().unwrap();
        // "No devices were found" comes with exit code 6.
        let smi = fake_smi(tmp.path(), "echo 'No devices were found'; exit 6");
        assert!(discover_with(&smi, Duration::from_secs(5)).is_none());

        let smi = fake_smi(tmp.path(), "exec sleep 30");
        let t0 = std::time::Instant::now();
        assert!(discover_with(&smi, Duration::from_millis(300)).is_none());
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "timeout not honoured: {:?}",
            t0.elapsed()
        );

        let smi = fake_smi(tmp.path(), "if [ \"$1\" = topo ]; then exit 1; fi; echo '0, Tesla T4'");
        let gpus = discover_with(&smi, Duration::from_secs(5)).unwrap();
        assert_eq!((gpus.count, gpus.gpu_type.as_str(), gpus.topo_text), (1, "T4", None));

        assert!(discover_with(&tmp.path().join("missing"), Duration::from_secs(1)).is_none());
    }

    #[test]
    fn discover_matches_path() {
        // Without nvidia-smi on PATH (CI, this machine) there are no local GPUs; with one,
        // discovery must not panic whatever it finds.
        let found = discover();
        if find_on_path("nvidia-smi").is_none() {
            assert!(found.is_none());
        }
    }
}

/// Gives nodes marked `local: true` this machine's real GPUs: count, type and
/// topology from `nvidia-smi`. Without `nvidia-smi` (or when it fails) the node keeps
/// what its cluster file says and runs simulated, with a warning.
pub fn apply_to_local_nodes(nodes: &mut [crate::cluster::Node], found: Option<&LocalGpus>) {
    use std::sync::Arc;
    for n in nodes.iter_mut().filter(|n| n.local) {
        let Some(g) = found else {
            tracing::warn!(host = %n.host, "local: true, but no nvidia-smi answered; the node keeps its configured GPUs");
            continue;
        };
        let mut total = n.total().clone();
        total.gpu_mask = crate::resources::mask_of_count(g.count.min(64));
        total.gpus = total.gpu_mask.count_ones();
        n.set_total(total);
        n.gpu_type = Some(g.gpu_type.clone());
        n.topology = g
            .topo_text
            .as_deref()
            .and_then(|t| crate::topology::Topology::parse_nvidia_smi(t).ok())
            .filter(|t| t.gpu_count() == g.count)
            .map(Arc::new);
        tracing::info!(host = %n.host, gpus = g.count, gpu_type = %g.gpu_type, "local node uses this machine's GPUs");
    }
}

#[cfg(test)]
mod apply_tests {
    use super::*;
    use crate::cluster::Node;
    use crate::resources::{PortSet, Resources};

    #[test]
    fn local_nodes_take_the_discovered_gpus_and_others_are_untouched() {
        let mut local = Node::new("me", "/r", Resources::with_mask(8, 1000, 0x3, PortSet::new()));
        local.local = true;
        let other = Node::new("sim", "/r", Resources::with_mask(8, 1000, 0xff, PortSet::new()));
        let mut nodes = vec![local, other];
        let topo = crate::topology::Topology::preset("pcie4").map(|t| t.to_topo_text());
        let g = LocalGpus {
            count: 4,
            gpu_type: "H100".into(),
            names: vec!["NVIDIA H100 80GB HBM3".into(); 4],
            topo_text: topo,
        };
        apply_to_local_nodes(&mut nodes, Some(&g));
        assert_eq!(nodes[0].total().gpu_mask, 0xf);
        assert_eq!(nodes[0].gpu_type.as_deref(), Some("H100"));
        assert_eq!(nodes[0].topology.as_ref().map(|t| t.gpu_count()), Some(4));
        assert_eq!(nodes[1].total().gpu_mask, 0xff);
        apply_to_local_nodes(&mut nodes, None);
        assert_eq!(nodes[0].total().gpu_mask, 0xf, "no nvidia-smi: unchanged");
    }
}
