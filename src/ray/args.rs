//! `gpuam ray-node-args`: the extra `ray start` arguments that make a machine a gpuam node
//! of a Ray cluster (see `scheme.rs` for what they mean).
//!
//! `auto` values come from this machine's `nvidia-smi` (GPU count, type, `topo -m`); a
//! machine without it has no GPUs unless told (`--gpus N`, `--topology PRESET`).

use crate::node::gpu_discovery::LocalGpus;
use crate::resources::{CustomResources, PortSet};
use crate::topology::Topology;

use super::scheme::{ray_start_args, NodeDescription};

/// What the operator asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeArgsRequest {
    pub host: String,
    /// `auto` or a count.
    pub gpus: String,
    /// `auto`, `none` or a preset name.
    pub topology: String,
    pub rack: Option<String>,
    pub gpu_type: Option<String>,
    pub ports: String,
    /// `--resource NAME=QTY` flags.
    pub resources: Vec<String>,
}

/// Resolves `auto` against `found` (this machine's GPUs, if any) into a node description.
pub fn describe(req: &NodeArgsRequest, found: Option<&LocalGpus>) -> Result<NodeDescription, String> {
    let topology = match req.topology.trim() {
        "auto" => found
            .and_then(|g| g.topo_text.as_deref())
            .map(Topology::parse_nvidia_smi)
            .transpose()
            .map_err(|e| format!("--topology auto: {e}"))?,
        spec if Topology::preset(spec).is_some() || spec.eq_ignore_ascii_case("none") => {
            Topology::from_spec(spec).map_err(|e| format!("--topology: {e}"))?
        }
        other => {
            return Err(format!(
                "--topology `{other}`: use auto, none or a preset ({})",
                Topology::preset_names().join(", ")
            ))
        }
    };
    let gpus = match req.gpus.trim() {
        "auto" => match (found, &topology) {
            (Some(g), _) => g.count,
            (None, Some(t)) => t.gpu_count(),
            (None, None) => 0,
        },
        n => n
            .parse::<u32>()
            .map_err(|_| format!("--gpus `{n}`: use auto or a number of GPUs"))?,
    };
    // A discovered topology that disagrees with an explicit count is dropped, not guessed.
    let topology = topology.filter(|t| t.gpu_count() == gpus || req.topology.trim() != "auto");
    let gpu_type = req
        .gpu_type
        .clone()
        .or_else(|| found.map(|g| g.gpu_type.clone()).filter(|t| !t.is_empty()));
    let ports = PortSet::parse(&req.ports).map_err(|e| format!("--ports `{}`: {e}", req.ports))?;
    Ok(NodeDescription {
        host: req.host.clone(),
        gpus,
        topology,
        rack: req.rack.clone(),
        gpu_type,
        ports,
        custom: CustomResources::parse_flags(&req.resources)?,
    })
}

/// The arguments as one line of words separated by spaces, written so that
/// `ray start ... $(gpuam ray-node-args ...)` passes each as one argument: a command
/// substitution's result is split at blanks and globbed, but no quote is removed, so the
/// words carry no quotes of their own and none holds a blank or a glob character (host,
/// rack, type and resource names are already limited to letters, digits, `.`, `_`, `-`).
pub fn render(d: &NodeDescription) -> Result<String, String> {
    let words = ray_start_args(d)?;
    if let Some(bad) = words.iter().find(|w| !substitution_safe(w)) {
        return Err(format!(
            "`{bad}` would not survive $(...) as one word; use names of letters, digits, `.`, `_`, `-`"
        ));
    }
    Ok(words.join(" "))
}

/// True when `$(...)` in a POSIX shell yields `word` as itself: not empty, no blank (field
/// splitting with the default IFS) and no `*`, `?`, `[` (pathname expansion).
fn substitution_safe(word: &str) -> bool {
    !word.is_empty()
        && !word
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || "*?[".contains(c))
}

/// `gpuam ray-node-args`: the line to print, or the reason the request is bad (the CLI
/// exits 64 with it).
pub fn line(req: &NodeArgsRequest) -> Result<String, String> {
    let needs_discovery = req.gpus.trim() == "auto" || req.topology.trim() == "auto";
    let found = if needs_discovery {
        crate::node::gpu_discovery::discover()
    } else {
        None
    };
    describe(req, found.as_ref()).and_then(|d| render(&d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(gpus: &str, topology: &str) -> NodeArgsRequest {
        NodeArgsRequest {
            host: "n1".into(),
            gpus: gpus.into(),
            topology: topology.into(),
            rack: Some("/r1".into()),
            gpu_type: None,
            ports: "20000-29999".into(),
            resources: Vec::new(),
        }
    }

    #[test]
    fn auto_takes_the_discovered_gpus_and_topology() {
        let g = LocalGpus {
            count: 4,
            gpu_type: "H100".into(),
            names: vec!["NVIDIA H100 80GB HBM3".into(); 4],
            topo_text: Topology::preset("pcie4").map(|t| t.to_topo_text()),
        };
        let d = describe(&req("auto", "auto"), Some(&g)).unwrap();
        assert_eq!(d.gpus, 4);
        assert_eq!(d.gpu_type.as_deref(), Some("H100"));
        assert_eq!(d.topology.as_ref().map(|t| t.gpu_count()), Some(4));
        let line = render(&d).unwrap();
        assert!(line.contains("gpuam.io/topology=matrix"), "{line}");
        assert!(
            line.starts_with("--num-gpus=0 --resources={\"gpuam-gpu-0\":1,"),
            "{line}"
        );
        assert!(!line.contains('\''), "no literal quotes: {line}");
    }

    #[test]
    fn without_nvidia_smi_a_preset_gives_the_count_and_auto_gives_none() {
        let d = describe(&req("auto", "dgx1v"), None).unwrap();
        assert_eq!(d.gpus, 8);
        let line = render(&d).unwrap();
        assert!(line.contains("gpuam.io/topology=dgx1v"), "{line}");
        let d = describe(&req("auto", "auto"), None).unwrap();
        assert_eq!((d.gpus, d.topology.is_none()), (0, true));
        let e = describe(&req("many", "none"), None).unwrap_err();
        assert!(e.contains("--gpus `many`"), "{e}");
        let e = describe(&req("2", "warp"), None).unwrap_err();
        assert!(e.contains("--topology `warp`"), "{e}");
    }

    #[test]
    fn words_that_a_command_substitution_would_change_are_refused() {
        for ok in [
            "--num-gpus=0",
            "--resources={\"gpuam-gpu-0\":1}",
            "--labels=gpuam.io/rack=dc1.r7",
        ] {
            assert!(substitution_safe(ok), "{ok}");
        }
        for bad in ["", "a b", "a\tb", "gpu*", "x?", "[a]", "a\nb"] {
            assert!(!substitution_safe(bad), "{bad:?}");
        }
    }

    /// The line goes through a real shell's `$(...)` into the same words `ray start` gets
    /// (README's and docs/RAY.md's form), quotes in the JSON kept, none added.
    #[test]
    fn a_shell_command_substitution_passes_every_word_as_it_is() {
        let mut r = req("4", "dgx1v");
        r.gpus = "8".into();
        r.gpu_type = Some("V100".into());
        r.resources = vec!["nvme=2".into()];
        let d = describe(&r, None).unwrap();
        let words = ray_start_args(&d).unwrap();
        let line = render(&d).unwrap();
        let dir = tempfile::tempdir().unwrap();
        // Globbing is live: a file named like a word's pieces must not change anything.
        std::fs::write(dir.path().join("--num-gpus=0"), "").unwrap();
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg("set -- $(printf '%s\n' \"$LINE\"); printf '%s\n' \"$@\"")
            .env("LINE", &line)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        assert_eq!(got, words, "the line: {line}");
    }
}
