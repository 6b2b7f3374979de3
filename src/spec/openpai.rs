//! OpenPAI job protocol v2 specifics that `parse.rs` calls for `protocolVersion: 2` files:
//! the prerequisites table and its references (`dockerImage`, `data`, `script`, `output`),
//! placeholder rendering (`<% $parameters.x %>`, `$secrets`, `$data`, `$script`, `$output`)
//! within one byte budget per job spec ([`MAX_RENDERED_BYTES`], [`RenderBudget`]),
//! the one-script command semantics, OpenPAI's name rules, and the list of fields gpuam
//! accepts but does not honour (each becomes a located [`SpecWarning`]).
//!
//! The rules follow OpenPAI's rest-server (protocol schema, submit middleware, k8s job
//! model); docs/OPENPAI.md lists them with their sources. Nothing here does I/O.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use super::yaml::{clip, join, Diags, Node, Pos, Value};
use super::SpecWarning;

/// The prerequisite types of protocol v2 and the role field that names each.
pub const PREREQ_TYPES: &[(&str, &str)] = &[
    ("dockerimage", "dockerImage"),
    ("data", "data"),
    ("script", "script"),
    ("output", "output"),
];

/// Fields every prerequisite may have (OpenPAI's `base.json`) besides `type`.
const PREREQ_BASE: &[&str] = &[
    "protocolVersion",
    "name",
    "type",
    "version",
    "contributor",
    "description",
];
/// A `dockerimage` prerequisite's own fields: nothing else is allowed (OpenPAI's schema
/// sets `additionalProperties: false` there).
const IMAGE_FIELDS: &[&str] = &["uri", "auth"];
/// The fields OpenPAI's schema names for `script`, `data` and `output` prerequisites: `uri`
/// optional (text; a list for `data`), `plugin` (text), `require` (list of names); the
/// runtime plugin's own (`callbacks`, `failurePolicy`) and any other field are allowed
/// (`additionalProperties: true`).
const PLUGIN_FIELDS: &[&str] = &["uri", "plugin", "require", "callbacks", "failurePolicy"];
/// openpai-runtime's prerequisite callbacks: accepted, warned about (gpuam runs none).
const PREREQ_NOT_HONOURED: &[&str] = &["callbacks", "plugin", "require", "failurePolicy"];

/// `extras` keys gpuam honours; every other key is warned about.
const EXTRAS_HONOURED: &[&str] = &["gangAllocation", "gangTimeoutSec", "maxRunSec"];

/// Collected warnings (shared by the readers through `&V2`).
#[derive(Debug, Default)]
pub struct Warnings(RefCell<Vec<SpecWarning>>);

impl Warnings {
    pub fn add(&self, pos: Pos, field: &str, message: impl Into<String>) {
        let mut w = self.0.borrow_mut();
        // Past the bound, not stored ([`crate::spec::yaml::MAX_KEPT`]): warnings refuse
        // nothing, and a hostile spec can make them many and long.
        if w.len() >= crate::spec::yaml::MAX_KEPT {
            return;
        }
        w.push(SpecWarning {
            line: pos.line,
            col: pos.col,
            field: crate::spec::yaml::clipped(field),
            message: crate::spec::yaml::clipped_message(&message.into()),
        });
    }

    pub fn into_sorted(self) -> Vec<SpecWarning> {
        let mut w = self.0.into_inner();
        w.sort_by_key(|w| (w.line, w.col));
        w
    }
}

/// Prerequisites by (type, name).
#[derive(Debug, Default)]
pub struct Prereqs<'a> {
    items: HashMap<(String, String), &'a Node>,
}

impl<'a> Prereqs<'a> {
    pub fn get(&self, kind: &str, name: &str) -> Option<&'a Node> {
        self.items.get(&(kind.to_string(), name.to_string())).copied()
    }

    /// True when a prerequisite of any type has this name (a role's `prerequisites` list).
    pub fn has_name(&self, name: &str) -> bool {
        self.items.keys().any(|(_, n)| n == name)
    }
}

/// Reads `prerequisites` (a list of `{name, type, ...}`) as OpenPAI's rest-server schema
/// has them: a `dockerimage` needs `uri` and takes nothing but `auth` besides; `script`,
/// `data` and `output` need only `name` and `type`. Duplicates of a type and name are
/// refused as OpenPAI's server does.
pub fn read_prerequisites<'a>(d: &mut Diags, n: &'a Node, w: &Warnings) -> Prereqs<'a> {
    let mut out = Prereqs::default();
    if n.is_null() {
        return out;
    }
    let Some(items) = d.seq(n, "prerequisites", "write a list of `{name, type}` entries") else {
        return out;
    };
    for (i, item) in items.iter().enumerate() {
        let p = format!("prerequisites[{i}]");
        if d.map(item, &p, "write `{name: NAME, type: dockerimage, uri: IMAGE}`")
            .is_none()
        {
            continue;
        }
        let name = match item.get("name") {
            None => {
                d.missing(item, &p, "name", "give the prerequisite a `name`");
                None
            }
            Some(v) => d.text(v, &join(&p, "name")),
        };
        let kind = match item.get("type") {
            None => {
                d.missing(item, &p, "type", "add `type:` (script, output, data or dockerimage)");
                None
            }
            Some(v) => d.text(v, &join(&p, "type")).and_then(|t| {
                if PREREQ_TYPES.iter().any(|(k, _)| *k == t) {
                    Some((t, v.pos))
                } else {
                    d.at(
                        v.pos,
                        &join(&p, "type"),
                        format!("unknown prerequisite type \"{}\"", clip(&t)),
                        "use one of: script, output, data, dockerimage",
                    );
                    None
                }
            }),
        };
        match kind.as_ref().map(|(k, _)| k.as_str()) {
            Some("dockerimage") => read_image_fields(d, item, &p, w),
            Some(k) => read_plugin_fields(d, item, &p, k == "data", w),
            None => {}
        }
        if let (Some(name), Some((kind, pos))) = (name, kind) {
            if out.items.insert((kind.clone(), name.clone()), item).is_some() {
                d.at(
                    pos,
                    &p,
                    format!("duplicate {kind} prerequisite \"{}\"", clip(&name)),
                    "give each prerequisite of a type its own `name`",
                );
            }
        }
    }
    out
}

/// A `dockerimage` prerequisite: `uri` (one text) required, `auth` allowed (not used).
fn read_image_fields(d: &mut Diags, item: &Node, p: &str, w: &Warnings) {
    let allowed: Vec<&str> = PREREQ_BASE.iter().chain(IMAGE_FIELDS).copied().collect();
    d.unknown_fields(item, p, &allowed, &[("image", "uri"), ("url", "uri")]);
    if let Some((k, _)) = item.entry("auth") {
        w.add(
            k.pos,
            &join(p, "auth"),
            "registry `auth` is not used: gpuam runs images from the node's local store (pulling is podman's business)",
        );
    }
    match item.get("uri") {
        None => d.missing(
            item,
            p,
            "uri",
            "add `uri:` naming the image, e.g. `uri: example/pytorch:latest`",
        ),
        Some(u) if matches!(u.value, Value::Seq(_)) => d.at(
            u.pos,
            &join(p, "uri"),
            "`uri` must be one text here (only `data` prerequisites take a list)",
            "write `uri: IMAGE`",
        ),
        Some(u) => {
            let up = join(p, "uri");
            if let Some(uri) = d.text(u, &up) {
                if let Err((what, fix)) = check_image_uri(&uri) {
                    d.at(u.pos, &up, what, fix);
                }
            }
        }
    }
}

/// An image reference as the node will pass it to podman: not empty, no leading `-`
/// (podman would read it as an option) and no whitespace or control character (the node
/// refuses such a name too; refusing it here tells the user at submit, with its line).
pub fn check_image_uri(uri: &str) -> Result<(), (String, String)> {
    if uri.is_empty() {
        return Err((
            "the image `uri` is empty".into(),
            "name the image, e.g. `uri: example/pytorch:latest`".into(),
        ));
    }
    if uri.starts_with('-') {
        return Err((
            format!("the image `uri` \"{}\" starts with `-`", clip(uri)),
            "write an image reference such as `example/pytorch:latest` (a leading `-` would be read as an option)"
                .into(),
        ));
    }
    if let Some(c) = uri.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err((
            format!("the image `uri` \"{}\" contains {:?}", clip(uri), c),
            "write the image reference without spaces, tabs, newlines or control characters, e.g. \
             `uri: example/pytorch:latest`"
                .into(),
        ));
    }
    Ok(())
}

/// A `script`, `data` or `output` prerequisite: `uri` optional (a list for `data`, else
/// one text), `plugin` one text, `require` a list of names; the runtime plugin's fields
/// and any other field are accepted (OpenPAI passes them to the plugin), with a warning.
fn read_plugin_fields(d: &mut Diags, item: &Node, p: &str, data: bool, w: &Warnings) {
    for (k, _) in item.as_map().unwrap_or(&[]) {
        let f = k.text.as_str();
        if PREREQ_NOT_HONOURED.contains(&f) {
            w.add(
                k.pos,
                &join(p, f),
                format!("prerequisite `{f}` (an openpai-runtime callback) is accepted but not run by gpuam"),
            );
        } else if !PREREQ_BASE.contains(&f) && !PLUGIN_FIELDS.contains(&f) {
            w.add(
                k.pos,
                &join(p, f),
                format!(
                    "`{}` (a runtime plugin's parameter) is accepted but not used by gpuam",
                    clip(f)
                ),
            );
        }
    }
    if let Some(u) = item.get("uri") {
        match (&u.value, data) {
            (Value::Seq(items), true) => {
                for (i, v) in items.iter().enumerate() {
                    d.text(v, &format!("{}[{i}]", join(p, "uri")));
                }
            }
            // OpenPAI's schema wants a list for data; one text is the common mistake.
            (_, true) => d.at(
                u.pos,
                &join(p, "uri"),
                "the `uri` of a `data` prerequisite must be a list",
                "write `uri: [VALUE]`",
            ),
            (Value::Seq(_), false) => d.at(
                u.pos,
                &join(p, "uri"),
                "`uri` must be one text here (only `data` prerequisites take a list)",
                "write `uri: VALUE`",
            ),
            (_, false) => {
                d.text(u, &join(p, "uri"));
            }
        }
    }
    if let Some(v) = item.get("plugin") {
        d.text(v, &join(p, "plugin"));
    }
    if let Some(v) = item.get("require") {
        if let Some(names) = d.seq(v, &join(p, "require"), "write `require: [NAME, ...]`") {
            for (i, n) in names.iter().enumerate() {
                d.text(n, &format!("{}[{i}]", join(p, "require")));
            }
        }
    }
}

/// Checks a role's `dockerImage`, `data`, `script` and `output` name prerequisites of
/// their type ("Prerequisite X does not exist" on OpenPAI); returns the image's uri.
pub fn check_references<'a>(
    d: &mut Diags,
    role: &'a Node,
    path: &str,
    prereqs: &Prereqs<'a>,
) -> (bool, Option<String>) {
    let mut ok = true;
    let mut image = None;
    // `prerequisites: [NAME, ...]`: names of prerequisites of any type, run in order.
    if let Some(v) = role.get("prerequisites") {
        let fp = join(path, "prerequisites");
        match d.seq(
            v,
            &fp,
            "write `prerequisites: [NAME, ...]` naming entries of the top-level `prerequisites`",
        ) {
            None => ok = false,
            Some(names) => {
                for (i, n) in names.iter().enumerate() {
                    let at = format!("{fp}[{i}]");
                    let Some(name) = d.text(n, &at) else {
                        ok = false;
                        continue;
                    };
                    if !prereqs.has_name(&name) {
                        d.at(
                            n.pos,
                            &at,
                            format!("prerequisite \"{}\" does not exist", clip(&name)),
                            "name an entry of the top-level `prerequisites`, or add one with this `name`",
                        );
                        ok = false;
                    }
                }
            }
        }
    }
    for (kind, field) in PREREQ_TYPES {
        let Some(v) = role.get(field) else { continue };
        let fp = join(path, field);
        let Some(name) = d.text(v, &fp) else {
            ok = false;
            continue;
        };
        match prereqs.get(kind, &name) {
            Some(item) => {
                if *kind == "dockerimage" {
                    image = item.get("uri").and_then(|u| match &u.value {
                        Value::Str(s) => Some(s.clone()),
                        _ => None,
                    });
                }
            }
            None => {
                d.at(
                    v.pos,
                    &fp,
                    format!("prerequisite \"{}\" does not exist", clip(&name)),
                    format!(
                        "add `{{name: {}, type: {kind}{}}}` under `prerequisites`, or name one that is listed there",
                        clip(&name),
                        if *kind == "dockerimage" { ", uri: IMAGE" } else { "" }
                    ),
                );
                ok = false;
            }
        }
    }
    if role.get("dockerImage").is_none() {
        d.missing(
            role,
            path,
            "dockerImage",
            "add `dockerImage: NAME` naming a `type: dockerimage` prerequisite (protocol v2 requires it)",
        );
        ok = false;
    }
    (ok, image)
}

/// OpenPAI's name rule for roles and port labels: `^[a-zA-Z_][a-zA-Z0-9_]*$`.
pub fn check_pai_name(d: &mut Diags, pos: Pos, path: &str, name: &str, what: &str) -> bool {
    let first = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return true;
    }
    d.at(
        pos,
        path,
        format!("invalid {what} \"{}\" for protocol v2", clip(name)),
        format!(
            "use letters, digits and `_`, not starting with a digit (OpenPAI's pattern ^[a-zA-Z_][a-zA-Z0-9_]*$), e.g. `{}`",
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        ),
    );
    false
}

/// The most bytes that the rendered commands of ONE job spec may take, all roles' `commands`
/// and deployments' `preCommands`/`postCommands` together, literal text and placeholder
/// values alike. A spec is at most 1 MiB ([`super::limits::MAX_SPEC_BYTES`]), so its own
/// command text fits several times over; what this stops is a long parameter referenced
/// thousands of times (a 332 KB spec expanded to gigabytes on the RM, security finding of
/// the placeholder audit). Checked before every append, so the budget is never allocated
/// past: an over-budget spec is refused with one diagnostic, not expanded.
pub const MAX_RENDERED_BYTES: usize = 4 * 1024 * 1024;

/// The most placeholder errors (unsupported or non-scalar placeholders), and apart from
/// them the most placeholder warnings (undefined ones), that one job spec's renders
/// report; the rest are summed up in one warning. Without it, a spec of nothing but tiny placeholders would make a diagnostic of
/// a few hundred bytes out of every few bytes of text.
pub const MAX_RENDER_NOTES: usize = 100;

/// What is left of [`MAX_RENDERED_BYTES`] for one job spec: shared by every [`render`]
/// call of the spec (each role's [`RenderCtx`] borrows the same one). Once spent, the
/// first overflow is reported and every later render returns `None` without a word.
#[derive(Debug)]
pub struct RenderBudget {
    max: usize,
    used: Cell<usize>,
    spent: Cell<bool>,
    /// Placeholder errors and warnings so far (see [`MAX_RENDER_NOTES`]).
    errors: Cell<usize>,
    warnings: Cell<usize>,
}

impl Default for RenderBudget {
    fn default() -> Self {
        Self::new(MAX_RENDERED_BYTES)
    }
}

impl RenderBudget {
    pub fn new(max: usize) -> Self {
        RenderBudget {
            max,
            used: Cell::new(0),
            spent: Cell::new(false),
            errors: Cell::new(0),
            warnings: Cell::new(0),
        }
    }

    /// Bytes rendered so far.
    pub fn used(&self) -> usize {
        self.used.get()
    }

    /// True once a render went over the budget (the spec is refused).
    pub fn is_spent(&self) -> bool {
        self.spent.get()
    }

    /// Counts one placeholder error (`error`) or warning: true while it is to be reported
    /// (an error past the cap still refuses the spec, by the errors listed before it). The
    /// first one of a kind over [`MAX_RENDER_NOTES`] adds a warning that says so.
    fn note(&self, w: &Warnings, node: &Node, path: &str, error: bool) -> bool {
        let (count, what) = if error {
            (&self.errors, "errors")
        } else {
            (&self.warnings, "warnings")
        };
        let n = count.get().saturating_add(1);
        count.set(n);
        if n == MAX_RENDER_NOTES + 1 {
            w.add(
                node.pos,
                path,
                format!("more than {MAX_RENDER_NOTES} placeholder {what}; the rest are not listed"),
            );
        }
        n <= MAX_RENDER_NOTES
    }

    /// A placeholder error at `node` under `path`, listed while within [`Self::note`]'s cap.
    fn error(&self, d: &mut Diags, w: &Warnings, node: &Node, path: &str, message: String, fix: &str) {
        if self.note(w, node, path, true) {
            d.at(node.pos, path, message, fix);
        }
    }

    /// Takes `n` more bytes; over the budget reports the overflow once, at `node`'s line
    /// under `path`, and returns false.
    fn take(&self, d: &mut Diags, node: &Node, path: &str, n: usize) -> bool {
        if self.spent.get() {
            return false;
        }
        match self.used.get().checked_add(n) {
            Some(total) if total <= self.max => {
                self.used.set(total);
                true
            }
            total => {
                self.spent.set(true);
                let total = total.map_or_else(|| "more than that".to_string(), |t| format!("at least {t} bytes"));
                d.at(
                    node.pos,
                    path,
                    format!(
                        "with their placeholders filled in, the job's commands would pass {} bytes (reached here: {total}); \
                         the limit counts every role's commands and deployments' pre/post commands together",
                        self.max
                    ),
                    "reference large values fewer times, or pass them as a file: put the value in a `data`/`script` \
                     prerequisite's `uri` or a file the command reads, not in `parameters`",
                );
                false
            }
        }
    }
}

/// The values a role's placeholders can refer to, and the spec's render budget.
pub struct RenderCtx<'a> {
    pub parameters: Option<&'a Node>,
    pub secrets: Option<&'a Node>,
    pub data: Option<&'a Node>,
    pub script: Option<&'a Node>,
    pub output: Option<&'a Node>,
    /// Shared by every render of the job spec (see [`MAX_RENDERED_BYTES`]).
    pub budget: &'a RenderBudget,
}

/// Renders OpenPAI's `<% ... %>` placeholders in one command. `$parameters`, `$secrets`,
/// `$data`, `$script` and `$output` are looked up with dots (`$data.uri[0]` =
/// `$data.uri.0`); a name that is not defined renders as empty text, as on OpenPAI, with a
/// warning. Mustache comments (`<%! %>`) vanish; other mustache tags are not supported.
///
/// The output (literal text and values) is taken from `ctx.budget` before it is appended;
/// over the budget the command is refused (one diagnostic for the whole spec) and `None`
/// is returned, as it is for every render after that.
pub fn render(d: &mut Diags, w: &Warnings, text: &str, node: &Node, path: &str, ctx: &RenderCtx<'_>) -> Option<String> {
    if ctx.budget.is_spent() {
        return None;
    }
    let budget = ctx.budget;
    let mut out = String::with_capacity(text.len().min(budget.max.saturating_sub(budget.used())));
    let mut rest = text;
    let mut ok = true;
    while let Some(open) = rest.find("<%") {
        if !budget.take(d, node, path, open) {
            return None;
        }
        out.push_str(&rest[..open]);
        let after = &rest[open + 2..];
        let Some(close) = after.find("%>") else {
            d.at(
                node.pos,
                path,
                "unclosed placeholder `<%`",
                "close it with `%>`, e.g. `<% $parameters.epochs %>`",
            );
            return None;
        };
        let raw = after[..close].trim();
        rest = &after[close + 2..];
        if raw.starts_with('!') {
            continue;
        }
        let expr = raw.strip_prefix('&').map(str::trim).unwrap_or(raw);
        let (root, tail) = match expr.find('.') {
            Some(i) => (&expr[..i], &expr[i + 1..]),
            None => (expr, ""),
        };
        let base = match root {
            "$parameters" => ctx.parameters,
            "$secrets" => ctx.secrets,
            "$data" => ctx.data,
            "$script" => ctx.script,
            "$output" => ctx.output,
            _ => {
                // Past the cap the spec is refused all the same (`ok`), by the errors shown.
                budget.error(
                    d,
                    w,
                    node,
                    path,
                    format!("unsupported placeholder `<% {} %>`", clip(raw)),
                    "use `<% $parameters.NAME %>`, `$secrets.NAME`, `$data.uri[0]`, `$script.uri` or `$output.uri`",
                );
                ok = false;
                continue;
            }
        };
        let key = tail.replace('[', ".").replace(']', "");
        let mut cur = base;
        for seg in key.split('.').filter(|s| !s.is_empty()) {
            let seg = seg.trim();
            cur = cur.and_then(|c| match &c.value {
                Value::Seq(items) => seg.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => c.get(seg),
            });
        }
        match cur.map(|v| (v, &v.value)) {
            None | Some((_, Value::Null)) => {
                if budget.note(w, node, path, false) {
                    w.add(
                        node.pos,
                        path,
                        format!(
                            "`<% {} %>` is not defined; it renders as empty text, as on OpenPAI",
                            clip(expr)
                        ),
                    );
                }
            }
            Some((_, Value::Seq(items))) if items.iter().all(|i| !matches!(i.value, Value::Map(_) | Value::Seq(_))) => {
                // The list's values joined by commas, measured before it is built.
                let len = items
                    .iter()
                    .map(|i| scalar_str(i).len())
                    .fold(items.len().saturating_sub(1), usize::saturating_add);
                if !budget.take(d, node, path, len) {
                    return None;
                }
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(scalar_str(item));
                }
            }
            Some((_, Value::Map(_) | Value::Seq(_))) => {
                budget.error(
                    d,
                    w,
                    node,
                    path,
                    format!("`{}` is not a single value", clip(expr)),
                    "refer to a field that holds text or a number",
                );
                ok = false;
            }
            Some((v, _)) => {
                let s = scalar_str(v);
                if !budget.take(d, node, path, s.len()) {
                    return None;
                }
                out.push_str(s);
            }
        }
    }
    if !budget.take(d, node, path, rest.len()) {
        return None;
    }
    out.push_str(rest);
    ok.then_some(out)
}

/// A scalar's text as a placeholder renders it: a string's value, nothing for null, else
/// the number or boolean as written.
fn scalar_str(n: &Node) -> &str {
    match &n.value {
        Value::Str(s) => s,
        Value::Null => "",
        _ => &n.raw,
    }
}

fn scalar_text(n: &Node) -> String {
    match &n.value {
        Value::Str(s) => s.clone(),
        Value::Null => String::new(),
        _ => n.raw.clone(),
    }
}

/// OpenPAI's entrypoint: the commands, each trimmed, joined by newlines into ONE bash
/// script that goes on after a failing line and ends with the last line's status.
pub fn join_commands(commands: &[String]) -> String {
    commands
        .iter()
        .map(|c| c.trim())
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_string()
}

/// Warns about `extras` keys gpuam does not honour: runtime plugins (each plugin with its
/// line), `hivedScheduler` fields other than `skuType`/`gpuType`, storages and the rest.
pub fn warn_extras(extras: &Node, w: &Warnings) {
    let Some(entries) = extras.as_map() else { return };
    for (k, v) in entries {
        let p = join("extras", &k.text);
        if EXTRAS_HONOURED.contains(&k.text.as_str()) {
            continue;
        }
        match k.text.as_str() {
            "com.microsoft.pai.runtimeplugin" => {
                let plugins = v.as_seq().unwrap_or_default();
                if plugins.is_empty() {
                    w.add(k.pos, &p, "runtime plugins are accepted but not run by gpuam");
                }
                for (i, item) in plugins.iter().enumerate() {
                    let name = item.get("plugin").map(scalar_text).unwrap_or_else(|| "?".into());
                    let what = match name.as_str() {
                        "ssh" => "no sshd is started and no ssh keys are set up",
                        "tensorboard" => "no TensorBoard is started",
                        "teamwise_storage" => "no storage is mounted",
                        "cmd" => "its callbacks are not run",
                        "git" => "no repository is cloned",
                        _ => "it is not run",
                    };
                    w.add(
                        item.pos,
                        &format!("{p}[{i}]"),
                        format!(
                            "runtime plugin `{}` is accepted but not run by gpuam: {what}",
                            clip(&name)
                        ),
                    );
                }
            }
            "hivedScheduler" => warn_hived(v, &p, w),
            _ => w.add(
                k.pos,
                &p,
                format!("`extras.{}` is accepted but not honoured by gpuam", clip(&k.text)),
            ),
        }
    }
}

fn warn_hived(h: &Node, p: &str, w: &Warnings) {
    let Some(entries) = h.as_map() else { return };
    for (k, v) in entries {
        let kp = join(p, &k.text);
        if k.text == "taskRoles" {
            for (rk, rv) in v.as_map().unwrap_or_default() {
                let rp = join(&kp, &rk.text);
                for (fk, _) in rv.as_map().unwrap_or_default() {
                    match fk.text.as_str() {
                        "skuType" | "gpuType" => {}
                        other => w.add(
                            fk.pos,
                            &join(&rp, other),
                            format!(
                                "hivedScheduler `{}` is accepted but not honoured (gpuam places by its own pipeline)",
                                clip(other)
                            ),
                        ),
                    }
                }
            }
        } else {
            w.add(
                k.pos,
                &kp,
                format!("hivedScheduler `{}` is accepted but not honoured", clip(&k.text)),
            );
        }
    }
}

/// `extras.hivedScheduler.taskRoles.<role>.skuType` (or the older `gpuType`): the GPU
/// type the role asks for.
pub fn hived_gpu_type(extras: Option<&Node>, role: &str) -> Option<String> {
    let r = extras?.get("hivedScheduler")?.get("taskRoles")?.get(role)?;
    let t = r.get("skuType").or_else(|| r.get("gpuType"))?;
    match &t.value {
        Value::Str(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
    }
}

/// Reads `extraContainerOptions`: `shmMB` (honoured in an image), `infiniband` and
/// anything else warned about.
pub fn read_container_options(d: &mut Diags, role: &Node, path: &str, w: &Warnings) -> Option<Option<u32>> {
    let Some(n) = role.get("extraContainerOptions") else {
        return Some(None);
    };
    let p = join(path, "extraContainerOptions");
    if n.is_null() {
        return Some(None);
    }
    d.map(n, &p, "write `extraContainerOptions: {shmMB: 1024}`")?;
    let mut shm = None;
    for (k, v) in n.as_map().unwrap_or_default() {
        let kp = join(&p, &k.text);
        match k.text.as_str() {
            "shmMB" => {
                // Honoured where the task runs in its image (the node sizes /dev/shm).
                shm = Some(d.int(v, &kp, 1, 16 * 1024 * 1024)? as u32);
            }
            "infiniband" => w.add(
                k.pos,
                &kp,
                "`infiniband` is accepted but no InfiniBand device is passed",
            ),
            other => w.add(k.pos, &kp, format!("`{}` is accepted but not honoured", clip(other))),
        }
    }
    Some(shm)
}

#[cfg(test)]
#[path = "openpai_budget_tests.rs"]
mod budget_tests;
