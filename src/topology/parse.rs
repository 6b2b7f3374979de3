//! Reading a topology from a spec string (preset name, `none`, or the text of
//! `nvidia-smi topo -m`) and writing one back as that text for the wire.
//!
//! The parser reads only what it needs: the header's leading `GPU0 … GPUn-1` columns and the
//! rows labelled `GPU<i>`. NIC columns and rows, the affinity columns (whose names contain
//! spaces) and the legend after the matrix are ignored. An asymmetric matrix is an error naming
//! the pair: real `nvidia-smi` output is symmetric, so asymmetry means the text was damaged or
//! hand-edited, and silently picking one side would hide that.

use std::fmt::Write as _;

use super::{Link, Topology, TopologyError, MAX_GPUS};

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

    /// Parses the output of `nvidia-smi topo -m` (any driver generation; `SOC` = `SYS`).
    /// The result is named `custom`.
    pub fn parse_nvidia_smi(text: &str) -> Result<Topology, TopologyError> {
        let err = |m: String| Err(TopologyError(format!("nvidia-smi topo -m text: {m}")));
        let mut n: Option<usize> = None;
        let mut rows: Vec<Option<Vec<Link>>> = Vec::new();
        for (lineno, raw) in text.lines().enumerate() {
            let lineno = lineno + 1;
            let line = strip_ansi(raw);
            let toks: Vec<&str> = line.split_whitespace().collect();
            let Some(&first) = toks.first() else { continue };
            if first.starts_with("Legend") {
                break;
            }
            let Some(idx) = gpu_index(first) else {
                continue;
            };
            let Some(cols) = n else {
                // Header: starts with GPU0 and is not itself a row (a row has `X` on its
                // diagonal, which for GPU0 is the second token).
                if toks.get(1) == Some(&"X") {
                    return err(format!("line {lineno}: GPU row before the header line (`GPU0 GPU1 …`)"));
                }
                let cols = toks.iter().take_while(|t| gpu_index(t).is_some()).count();
                for (i, t) in toks[..cols].iter().enumerate() {
                    if gpu_index(t) != Some(i) {
                        return err(format!(
                            "line {lineno}: header column {} is `{t}`, expected `GPU{i}`",
                            i + 1
                        ));
                    }
                }
                if cols > MAX_GPUS as usize {
                    return err(format!(
                        "line {lineno}: {cols} GPU columns; at most {MAX_GPUS} are supported"
                    ));
                }
                n = Some(cols);
                rows = vec![None; cols];
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
            if cells.len() < cols {
                return err(format!(
                    "line {lineno}: row `{first}` has {} cells, expected {cols} (one per GPU column)",
                    cells.len()
                ));
            }
            let mut row = Vec::with_capacity(cols);
            for (j, &cell) in cells[..cols].iter().enumerate() {
                if j == idx {
                    if cell != "X" {
                        return err(format!(
                            "line {lineno}: row GPU{idx}, column GPU{j}: the diagonal must be `X`, found `{cell}`"
                        ));
                    }
                    row.push(Link::Nv(0));
                    continue;
                }
                match Link::parse_cell(cell) {
                    Some(l) => row.push(l),
                    None if cell == "X" => {
                        return err(format!("line {lineno}: row GPU{idx}, column GPU{j}: `X` is only valid on the diagonal"))
                    }
                    None => {
                        return err(format!(
                            "line {lineno}: row GPU{idx}, column GPU{j}: unknown link `{cell}` (expected X, NV#, PIX, PXB, PHB, NODE, SYS or SOC)"
                        ))
                    }
                }
            }
            rows[idx] = Some(row);
        }
        let Some(cols) = n else {
            return err("no header line with GPU columns (`GPU0 GPU1 …`) found".to_string());
        };
        if cols == 0 {
            return err("the header has no GPU columns".to_string());
        }
        let mut matrix = Vec::with_capacity(cols);
        for (i, r) in rows.into_iter().enumerate() {
            match r {
                Some(r) => matrix.push(r),
                None => return err(format!("the header has {cols} GPU columns but row GPU{i} is missing")),
            }
        }
        for (a, row) in matrix.iter().enumerate() {
            for (b, &ab) in row.iter().enumerate().skip(a + 1) {
                let ba = matrix[b][a];
                if ab != ba {
                    return err(format!(
                        "not symmetric: GPU{a}→GPU{b} is {ab} but GPU{b}→GPU{a} is {ba}; fix the damaged cell"
                    ));
                }
            }
        }
        // `cols` ≤ 64 was checked above.
        Topology::new("custom", cols as u32, |a, b| matrix[a as usize][b as usize])
    }

    /// Renders the matrix the way `nvidia-smi topo -m` does (tab-separated, ` X ` on the
    /// diagonal, a short legend), so that [`Topology::parse_nvidia_smi`] reads it back equal
    /// (up to the name, which becomes `custom`).
    pub fn to_topo_text(&self) -> String {
        let n = self.n;
        let mut s = String::new();
        for j in 0..n {
            let _ = write!(s, "\tGPU{j}");
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
            s.push('\n');
        }
        s.push_str(
            "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes\n  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n  PIX  = Connection traversing at most a single PCIe bridge\n  NV#  = Connection traversing a bonded set of # NVLinks\n",
        );
        s
    }
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
