//! Reading a topology from a spec string (preset name, `none`, or the text of
//! `nvidia-smi topo -m`) and writing one back as that text for the wire.
//!
//! The parser reads the header's `GPU0 … GPUn-1` columns, the NIC columns after them
//! (`mlx5_0`, or `NIC0` … named in the `NIC Legend` of new drivers) and the affinity columns
//! (`CPU Affinity`, `NUMA Affinity`; `GPU NUMA ID` is read past); the rows labelled `GPU<i>`
//! give the GPU–GPU and GPU–NIC links and the affinity values; NIC rows are checked against
//! them. An asymmetric matrix is an error naming the pair: real `nvidia-smi` output is
//! symmetric, so asymmetry means the text was damaged or hand-edited, and silently picking one
//! side would hide that.

use std::fmt::Write as _;

use super::{CpuList, GpuAffinity, Link, Nic, Topology, TopologyError, MAX_GPUS};

impl Topology {
    /// A preset name (`pcie8`, `dgx1v`, ...; see [`Topology::preset_names`]), `none` or the
    /// empty string (no topology → `Ok(None)`), or the multi-line text of `nvidia-smi topo -m`.
    pub fn from_spec(text: &str) -> Result<Option<Topology>, TopologyError> {
        let t = text.trim();
        if t.is_empty() || t.eq_ignore_ascii_case("none") {
            return Ok(None);
        }
        if let Some(p) = Topology::preset(t) {
            return Ok(Some(p));
        }
        if t.lines().count() > 1 || t.contains("GPU0") {
            return Topology::parse_nvidia_smi(t).map(Some);
        }
        Err(TopologyError(format!(
            "unknown topology `{t}`: write a preset ({}), `none`, or paste the output of `nvidia-smi topo -m`",
            Topology::preset_names().join(", ")
        )))
    }

    /// Parses the output of `nvidia-smi topo -m` (any driver generation; `SOC` = `SYS`): the
    /// GPU matrix, the NIC columns (named in the `NIC Legend` when the header says `NIC0`…)
    /// and the `CPU Affinity` / `NUMA Affinity` columns. The result is named `custom`.
    pub fn parse_nvidia_smi(text: &str) -> Result<Topology, TopologyError> {
        let err = |m: String| Err(TopologyError(format!("nvidia-smi topo -m text: {m}")));
        let mut header: Option<Header> = None;
        let mut rows: Vec<Option<GpuRow>> = Vec::new();
        // NIC rows as printed (their GPU cells must agree with the GPU rows' NIC cells).
        let mut nic_rows: Vec<(usize, String, Vec<String>)> = Vec::new();
        let mut legend: Vec<(String, String)> = Vec::new();
        let mut in_legend = false;
        for (lineno, raw) in text.lines().enumerate() {
            let lineno = lineno + 1;
            let line = strip_ansi(raw);
            let toks: Vec<&str> = line.split_whitespace().collect();
            let Some(&first) = toks.first() else { continue };
            if first.starts_with("Legend") || first == "NIC" && toks.get(1) == Some(&"Legend:") {
                in_legend = true;
                continue;
            }
            if in_legend {
                // `NIC0: mlx5_0`
                if let (Some(nic), Some(name)) = (first.strip_suffix(':'), toks.get(1)) {
                    if nic.starts_with("NIC") && toks.len() == 2 {
                        legend.push((nic.to_string(), (*name).to_string()));
                    }
                }
                continue;
            }
            let Some(h) = &header else {
                if gpu_index(first) != Some(0) {
                    continue;
                }
                // Header: starts with GPU0 and is not itself a row (a row has `X` on its
                // diagonal, which for GPU0 is the second token).
                if toks.get(1) == Some(&"X") {
                    return err(format!("line {lineno}: GPU row before the header line (`GPU0 GPU1 …`)"));
                }
                let h =
                    Header::read(&toks, lineno).map_err(|m| TopologyError(format!("nvidia-smi topo -m text: {m}")))?;
                rows = vec![None; h.gpus];
                header = Some(h);
                continue;
            };
            let cols = h.gpus;
            let Some(idx) = gpu_index(first) else {
                if let Some(ni) = h.nics.iter().position(|x| x == first) {
                    let cells = toks[1..].iter().take(cols).map(|c| (*c).to_string()).collect();
                    nic_rows.push((lineno, h.nics[ni].clone(), cells));
                }
                continue;
            };
            if idx >= cols {
                return err(format!(
                    "line {lineno}: row `{first}` but the header has only {cols} GPU columns (GPU0–GPU{})",
                    cols - 1
                ));
            }
            if rows[idx].is_some() {
                return err(format!("line {lineno}: row `{first}` appears twice"));
            }
            let cells = &toks[1..];
            let want = cols + h.nics.len();
            if cells.len() < want {
                let what = if h.nics.is_empty() {
                    "one per GPU column".to_string()
                } else {
                    format!("one per GPU and NIC column: {cols} + {}", h.nics.len())
                };
                return err(format!(
                    "line {lineno}: row `{first}` has {} cells, expected {want} ({what})",
                    cells.len()
                ));
            }
            let mut row = GpuRow::default();
            for (j, &cell) in cells[..want].iter().enumerate() {
                let column = if j < cols {
                    format!("GPU{j}")
                } else {
                    h.nics[j - cols].clone()
                };
                if j == idx {
                    if cell != "X" {
                        return err(format!(
                            "line {lineno}: row GPU{idx}, column GPU{j}: the diagonal must be `X`, found `{cell}`"
                        ));
                    }
                    row.links.push(Link::Nv(0));
                    continue;
                }
                match Link::parse_cell(cell) {
                    Some(Link::Nv(_)) if j >= cols => {
                        return err(format!(
                            "line {lineno}: row GPU{idx}, column {column}: `{cell}` between a GPU and a NIC (expected PIX, PXB, PHB, NODE or SYS)"
                        ))
                    }
                    Some(l) if j < cols => row.links.push(l),
                    Some(l) => row.nic_links.push(l),
                    None if cell == "X" => {
                        return err(format!("line {lineno}: row GPU{idx}, column {column}: `X` is only valid on the diagonal"))
                    }
                    None => {
                        return err(format!(
                            "line {lineno}: row GPU{idx}, column {column}: unknown link `{cell}` (expected X, NV#, PIX, PXB, PHB, NODE, SYS or SOC)"
                        ))
                    }
                }
            }
            let mut rest = cells[want..].iter();
            for (col, at) in &h.affinity {
                let Some(&cell) = rest.next() else { break };
                match col {
                    AffinityColumn::Cpu => match CpuList::parse(cell) {
                        Some(c) => row.affinity.cpus = Some(c),
                        None if na(cell) => {}
                        None => {
                            return err(format!(
                                "line {lineno}: row GPU{idx}, column {at}: `{cell}` is not a CPU list (like 0-19,40-59) or N/A"
                            ))
                        }
                    },
                    AffinityColumn::Numa => match cell.parse::<u32>() {
                        Ok(v) => row.affinity.numa = Some(v),
                        Err(_) if na(cell) => {}
                        Err(_) => {
                            return err(format!(
                                "line {lineno}: row GPU{idx}, column {at}: `{cell}` is not a NUMA node number or N/A"
                            ))
                        }
                    },
                    AffinityColumn::Other => {}
                }
            }
            rows[idx] = Some(row);
        }
        let Some(h) = header else {
            return err("no header line with GPU columns (`GPU0 GPU1 …`) found".to_string());
        };
        let cols = h.gpus;
        let mut matrix = Vec::with_capacity(cols);
        for (i, r) in rows.into_iter().enumerate() {
            match r {
                Some(r) => matrix.push(r),
                None => return err(format!("the header has {cols} GPU columns but row GPU{i} is missing")),
            }
        }
        for (a, row) in matrix.iter().enumerate() {
            for (b, &ab) in row.links.iter().enumerate().skip(a + 1) {
                let ba = matrix[b].links[a];
                if ab != ba {
                    return err(format!(
                        "not symmetric: GPU{a}→GPU{b} is {ab} but GPU{b}→GPU{a} is {ba}; fix the damaged cell"
                    ));
                }
            }
        }
        for (lineno, nic, cells) in &nic_rows {
            let ni = h.nics.iter().position(|x| x == nic).unwrap_or(0);
            for (g, cell) in cells.iter().enumerate() {
                let from_gpu = matrix[g].nic_links[ni];
                if Link::parse_cell(cell) != Some(from_gpu) {
                    return err(format!(
                        "line {lineno}: not symmetric: GPU{g}→{nic} is {from_gpu} but {nic}→GPU{g} is `{cell}`; fix the damaged cell"
                    ));
                }
            }
        }
        let nics = h
            .nics
            .iter()
            .enumerate()
            .map(|(ni, name)| Nic {
                name: legend
                    .iter()
                    .find(|(k, _)| k == name)
                    .map_or_else(|| name.clone(), |(_, v)| v.clone()),
                links: matrix.iter().map(|r| r.nic_links[ni]).collect(),
            })
            .collect();
        let affinity = if h.affinity.is_empty() {
            Vec::new()
        } else {
            matrix.iter().map(|r| r.affinity.clone()).collect()
        };
        // `cols` ≤ 64 was checked with the header; the lengths match by construction.
        Topology::new("custom", cols as u32, |a, b| matrix[a as usize].links[b as usize])?.with_locality(nics, affinity)
    }

    /// Renders the matrix the way `nvidia-smi topo -m` does (tab-separated, ` X ` on the
    /// diagonal, the NIC columns by name, the affinity columns, a short legend), so that
    /// [`Topology::parse_nvidia_smi`] reads it back equal (up to the name, which becomes
    /// `custom`). NIC rows are left out: the GPU rows carry every GPU–NIC link.
    pub fn to_topo_text(&self) -> String {
        let n = self.n;
        let mut s = String::new();
        for j in 0..n {
            let _ = write!(s, "\tGPU{j}");
        }
        for nic in &self.nics {
            let _ = write!(s, "\t{}", nic.name);
        }
        let cpus = self.affinity.iter().any(|a| a.cpus.is_some());
        let numa = self.affinity.iter().any(|a| a.numa.is_some());
        if cpus {
            s.push_str("\tCPU Affinity");
        }
        if numa {
            s.push_str("\tNUMA Affinity");
        }
        s.push('\n');
        for i in 0..n {
            let _ = write!(s, "GPU{i}");
            for j in 0..n {
                if i == j {
                    s.push_str("\t X ");
                } else {
                    let _ = write!(s, "\t{}", self.link(i, j));
                }
            }
            for nic in &self.nics {
                let _ = write!(s, "\t{}", nic.links[i as usize]);
            }
            let a = self.affinity.get(i as usize);
            if cpus {
                match a.and_then(|a| a.cpus.as_ref()) {
                    Some(c) => {
                        let _ = write!(s, "\t{c}");
                    }
                    None => s.push_str("\tN/A"),
                }
            }
            if numa {
                match a.and_then(|a| a.numa) {
                    Some(v) => {
                        let _ = write!(s, "\t{v}");
                    }
                    None => s.push_str("\tN/A"),
                }
            }
            s.push('\n');
        }
        s.push_str(
            "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes\n  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n  PIX  = Connection traversing at most a single PCIe bridge\n  NV#  = Connection traversing a bonded set of # NVLinks\n",
        );
        s
    }
}

/// One GPU row as read: its links to every GPU (diagonal `Nv(0)`), to every NIC, its affinity.
#[derive(Clone, Debug, Default)]
struct GpuRow {
    links: Vec<Link>,
    nic_links: Vec<Link>,
    affinity: GpuAffinity,
}

/// The columns after the GPU and NIC ones, in header order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum AffinityColumn {
    Cpu,
    Numa,
    /// `GPU NUMA ID` (new drivers): read past, not kept.
    Other,
}

/// The header line: how many GPU columns, the NIC columns, the affinity columns.
struct Header {
    gpus: usize,
    nics: Vec<String>,
    affinity: Vec<(AffinityColumn, &'static str)>,
}

impl Header {
    fn read(toks: &[&str], lineno: usize) -> Result<Header, String> {
        let cols = toks.iter().take_while(|t| gpu_index(t).is_some()).count();
        for (i, t) in toks[..cols].iter().enumerate() {
            if gpu_index(t) != Some(i) {
                return Err(format!(
                    "line {lineno}: header column {} is `{t}`, expected `GPU{i}`",
                    i + 1
                ));
            }
        }
        if cols > MAX_GPUS as usize {
            return Err(format!(
                "line {lineno}: {cols} GPU columns; at most {MAX_GPUS} are supported"
            ));
        }
        // NIC columns run until the first affinity column (whose names have spaces).
        let nics: Vec<String> = toks[cols..]
            .iter()
            .take_while(|t| !matches!(**t, "CPU" | "NUMA" | "GPU"))
            .map(|t| (*t).to_string())
            .collect();
        let mut affinity: Vec<(usize, AffinityColumn, &'static str)> = [
            ("CPU Affinity", AffinityColumn::Cpu),
            ("NUMA Affinity", AffinityColumn::Numa),
            ("GPU NUMA ID", AffinityColumn::Other),
        ]
        .into_iter()
        .filter_map(|(name, col)| {
            let words: Vec<&str> = name.split(' ').collect();
            toks.windows(words.len())
                .position(|w| w == words.as_slice())
                .map(|at| (at, col, name))
        })
        .collect();
        affinity.sort_by_key(|a| a.0);
        Ok(Header {
            gpus: cols,
            nics,
            affinity: affinity.into_iter().map(|(_, c, n)| (c, n)).collect(),
        })
    }
}

/// A cell that says "not known".
fn na(cell: &str) -> bool {
    cell.eq_ignore_ascii_case("N/A")
}

/// `GPU12` → 12. Anything else (NIC rows, `mlx5_0`, legend lines) → `None`.
fn gpu_index(tok: &str) -> Option<usize> {
    let d = tok.strip_prefix("GPU")?;
    if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) || (d.len() > 1 && d.starts_with('0')) {
        return None;
    }
    d.parse().ok()
}

/// Removes ANSI escape sequences (`ESC [ … letter`): `nvidia-smi` underlines the header when
/// writing to a terminal, and pasted output keeps the codes.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip `[`, parameters, and the final letter.
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
