//! A small "located YAML" layer: a YAML tree in which every node and every mapping key
//! knows its 1-based line and column, plus a diagnostics collector and typed getters that
//! report wrong types with the dotted field path, the position and a fix.
//!
//! It is built from saphyr-parser's event stream rather than from saphyr's `MarkedYaml`
//! because gpuam needs what the stock loader does not give: every duplicate key reported
//! (not only the first, and not as a fatal error), a small alias-expansion budget (nodes
//! and bytes of text, counted before anything is copied), a depth
//! limit that keeps recursive code on the result from overflowing the stack, and the raw
//! source text of every scalar (so `name: 2024` or `gpuMask: 0xff` keep their spelling).
//! Events are pulled in a loop; the parser's own recursive `load` is never used, so deeply
//! nested input cannot overflow the stack either.
//!
//! Control characters (NUL, escape, the rest of C0 but tab and newline, DEL, C1) are
//! refused in every scalar, whether written literally or as a `"\0"`-style escape, with the
//! field and the character's own line and column where it is written literally: nothing
//! downstream (a command line, a log, a terminal) can take them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use saphyr::{Scalar, ScalarStyle, Tag};
use saphyr_parser::{Event, Parser, Span};

use super::SpecError;

/// Nesting deeper than this is rejected (job specs need 5 levels, cluster files 4).
pub const MAX_DEPTH: usize = 64;
/// The most nodes that alias expansions (`*name`) may copy in one document.
pub const MAX_ALIAS_NODES: usize = 10_000;
/// The most bytes of text (scalars as written and as read, mapping keys) that alias
/// expansions may copy in one document: without it, 10 000 aliases of one long anchored
/// string in a 1 MiB spec would copy gigabytes (node count alone does not bound it).
pub const MAX_ALIAS_BYTES: usize = 4 * 1024 * 1024;

/// The catch-all message of a parser panic (a bug in the parser): tests assert it never
/// appears.
pub const PARSER_FAILED: &str = "the YAML parser failed on this file";

/// At most this many errors are reported for one file.
pub const MAX_ERRORS: usize = 100;

/// At most this many diagnostics (errors, YAML issues) are stored while a spec is read; the
/// rest are only counted. Each quotes a field path and the source's name, which a hostile
/// spec can make long: unbounded, a flow map of 80,000 duplicate keys under a 500 KB key
/// stored tens of GB (eleventh audit pass, review).
pub const MAX_KEPT: usize = 1_000;

/// A quoted source name or field path segment is cut to this many characters (with `…`), a
/// message to four times as many.
pub const MAX_QUOTED: usize = 256;

/// `text` cut to its first `max` characters, with `…` when cut (the one cutter of
/// [`clip`] and [`clipped`]).
fn cut(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(max) {
        None => std::borrow::Cow::Borrowed(text),
        Some((end, _)) => std::borrow::Cow::Owned(format!("{}…", &text[..end])),
    }
}

/// `text`, cut to [`MAX_QUOTED`] characters (a source name, a field path).
pub fn clipped(text: &str) -> String {
    cut(text, MAX_QUOTED).into_owned()
}

/// A message, cut to 4 × [`MAX_QUOTED`] characters.
pub fn clipped_message(text: &str) -> String {
    cut(text, 4 * MAX_QUOTED).into_owned()
}

/// A 1-based position in the source; `line == 0` means "no position".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pos {
    pub line: usize,
    pub col: usize,
}

impl Pos {
    fn from_span(span: &Span) -> Pos {
        Pos {
            line: span.start.line(),
            col: span.start.col() + 1,
        }
    }
}

/// A mapping key: its text and where it is.
#[derive(Clone, Debug, PartialEq)]
pub struct Key {
    pub text: String,
    pub pos: Pos,
}

/// The value of a node.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    /// Entries in file order; duplicate keys were reported and only the first is kept.
    Map(Vec<(Key, Node)>),
}

/// A located node.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub pos: Pos,
    pub value: Value,
    /// The scalar's text as written (without quotes); empty for collections.
    pub raw: String,
    /// The scalar was quoted (or a block scalar), so YAML made it a string.
    pub quoted: bool,
}

impl Node {
    fn new(pos: Pos, value: Value) -> Node {
        Node {
            pos,
            value,
            raw: String::new(),
            quoted: false,
        }
    }

    /// The entry `key` of a mapping node.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.entry(key).map(|(_, v)| v)
    }

    /// The entry `key` of a mapping node, with its key.
    pub fn entry(&self, key: &str) -> Option<(&Key, &Node)> {
        match &self.value {
            Value::Map(m) => m.iter().find(|(k, _)| k.text == key).map(|(k, v)| (k, v)),
            _ => None,
        }
    }

    pub fn as_map(&self) -> Option<&[(Key, Node)]> {
        match &self.value {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    pub fn as_seq(&self) -> Option<&[Node]> {
        match &self.value {
            Value::Seq(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self.value, Value::Null)
    }

    /// How the value reads in an error message: `"abc"`, `4.5`, `true`, `a list`.
    pub fn describe(&self) -> String {
        match &self.value {
            Value::Null => "an empty value".to_string(),
            Value::Bool(b) => format!("the boolean `{b}`"),
            Value::Int(_) => format!("the number `{}`", clip(&self.raw)),
            Value::Float(_) => format!("the decimal number `{}`", clip(&self.raw)),
            Value::Str(s) => format!("the text \"{}\"", clip(s)),
            Value::Seq(_) => "a list".to_string(),
            Value::Map(_) => "a mapping".to_string(),
        }
    }

    /// Counts the nodes and the bytes of text of this subtree, stopping once either
    /// budget is spent.
    fn count_within(&self, nodes: &mut usize, bytes: &mut usize) -> bool {
        let text = self.raw.len()
            + match &self.value {
                Value::Str(s) => s.len(),
                _ => 0,
            };
        if *nodes == 0 || *bytes < text {
            return false;
        }
        *nodes -= 1;
        *bytes -= text;
        match &self.value {
            Value::Seq(items) => items.iter().all(|n| n.count_within(nodes, bytes)),
            Value::Map(entries) => entries.iter().all(|(k, n)| {
                if *bytes < k.text.len() {
                    return false;
                }
                *bytes -= k.text.len();
                n.count_within(nodes, bytes)
            }),
            _ => true,
        }
    }
}

/// User text quoted in a one-line message (the validator's, the RM's refusals): shortened
/// to 60 characters, and shown as a terminal may show it ([`crate::text::shown_line`]: a
/// spec's ESC, newline or bidi control is written as its escape, `\u{1b}`).
pub fn clip(s: &str) -> String {
    crate::text::shown_line(&cut(s, 60)).into_owned()
}

/// A problem found while reading the YAML itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct YamlIssue {
    pub pos: Pos,
    pub field: String,
    pub message: String,
    pub fix: String,
}

/// The result of reading YAML text: the tree (absent after a syntax error or for an empty
/// document) and every problem found on the way.
#[derive(Debug, Default)]
pub struct Document {
    pub root: Option<Node>,
    pub issues: Vec<YamlIssue>,
    /// A syntax error made the tree unusable.
    pub fatal: bool,
}

enum Frame {
    Seq {
        pos: Pos,
        items: Vec<Node>,
        anchor: usize,
        path: String,
    },
    Map {
        pos: Pos,
        entries: Vec<(Key, Node)>,
        /// Key text → line of its first occurrence, so duplicate checks stay O(1) even
        /// for a hostile mapping with 100 000 keys.
        seen: HashMap<String, usize>,
        pending: Option<Key>,
        anchor: usize,
        path: String,
    },
}

struct Builder {
    /// Control characters written literally in the source: (char index, the character,
    /// its position), in order. The parser reads a copy where each is U+FFFD.
    controls: Vec<(usize, char, Pos)>,
    stack: Vec<Frame>,
    docs: Vec<Node>,
    anchors: Vec<(usize, Node)>,
    alias_budget: usize,
    /// The alias budget was passed (its error given): later aliases are neither looked up
    /// nor copied.
    aliases_spent: bool,
    /// Bytes of text alias expansions may still copy ([`MAX_ALIAS_BYTES`]).
    alias_bytes: usize,
    /// Events nested beyond MAX_DEPTH are skipped; this counts the open skipped collections.
    skipping: usize,
    issues: Vec<YamlIssue>,
    fatal: bool,
}

/// Joins a parent path and a child segment: `a` + `b` = `a.b`, `a` + `[0]` = `a[0]`. A
/// segment longer than [`MAX_QUOTED`] is cut (paths name places for people; a hostile key
/// of 500 KB would otherwise be copied into the path of every node below it).
pub fn join(parent: &str, child: &str) -> String {
    let child = cut(child, MAX_QUOTED);
    if parent.is_empty() {
        child.to_string()
    } else if child.starts_with('[') {
        format!("{parent}{child}")
    } else {
        format!("{parent}.{child}")
    }
}

impl Builder {
    fn issue(&mut self, pos: Pos, field: &str, message: String, fix: &str) {
        // Past the bound only counted: the spec is refused all the same.
        if self.issues.len() >= MAX_KEPT {
            return;
        }
        self.issues.push(YamlIssue {
            pos,
            field: clipped(field),
            message: clipped_message(&message),
            fix: fix.to_string(),
        });
    }

    /// The path of the innermost open collection, `(document)` at the top.
    fn open_collection_path(&self) -> String {
        let path = match self.stack.last() {
            Some(Frame::Seq { path, .. } | Frame::Map { path, .. }) => path.clone(),
            None => String::new(),
        };
        if path.is_empty() {
            "(document)".into()
        } else {
            path
        }
    }

    /// The path of the next child of the innermost open collection.
    fn child_path(&self) -> String {
        match self.stack.last() {
            None => String::new(),
            Some(Frame::Seq { items, path, .. }) => join(path, &format!("[{}]", items.len())),
            Some(Frame::Map { pending, path, .. }) => match pending {
                Some(k) => join(path, &k.text),
                None => path.clone(),
            },
        }
    }

    fn on_event(&mut self, ev: Event<'_>, span: Span) {
        let pos = Pos::from_span(&span);
        if self.skipping > 0 {
            match ev {
                Event::SequenceStart(..) | Event::MappingStart(..) => self.skipping += 1,
                Event::SequenceEnd | Event::MappingEnd => {
                    self.skipping -= 1;
                    if self.skipping == 0 {
                        // The skipped collection stands in as a null so the parent stays whole.
                        self.push_node(Node::new(pos, Value::Null), 0);
                    }
                }
                _ => {}
            }
            return;
        }
        match ev {
            // A document's root node reaches `docs` when it completes (see `push_node`).
            Event::Nothing | Event::StreamStart | Event::StreamEnd | Event::DocumentStart(_) | Event::DocumentEnd => {}
            Event::SequenceStart(..) | Event::MappingStart(..) if self.stack.len() >= MAX_DEPTH => {
                let path = self.child_path();
                self.issue(
                    pos,
                    &path,
                    format!("the YAML is nested more than {MAX_DEPTH} levels deep"),
                    "flatten the document; job specs and cluster files need only a few levels",
                );
                self.skipping = 1;
            }
            Event::SequenceStart(anchor, _) => {
                let path = self.child_path();
                self.stack.push(Frame::Seq {
                    pos,
                    items: Vec::new(),
                    anchor,
                    path,
                });
            }
            Event::MappingStart(anchor, _) => {
                let path = self.child_path();
                self.stack.push(Frame::Map {
                    pos,
                    entries: Vec::new(),
                    seen: HashMap::new(),
                    pending: None,
                    anchor,
                    path,
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(frame) = self.stack.pop() {
                    let anchor = match &frame {
                        Frame::Seq { anchor, .. } | Frame::Map { anchor, .. } => *anchor,
                    };
                    let node = close(frame);
                    self.push_node(node, anchor);
                }
            }
            Event::Scalar(text, style, anchor, tag) => {
                self.check_controls(&text, &span, pos);
                let node = self.scalar(text, style, tag, pos);
                self.push_node(node, anchor);
            }
            Event::Alias(id) => {
                // Once the budget is spent, no alias is looked up or copied again.
                if self.aliases_spent {
                    self.push_node(Node::new(pos, Value::Null), 0);
                    return;
                }
                // Measured before it is copied.
                let target = self.anchors.iter().rev().find(|(a, _)| *a == id).map(|(_, n)| n);
                let node = match target {
                    Some(n) if n.count_within(&mut self.alias_budget, &mut self.alias_bytes) => n.clone(),
                    Some(_) => {
                        let path = self.child_path();
                        self.issue(
                            pos,
                            &path,
                            format!(
                                "aliases (`*name`) expand to more than {MAX_ALIAS_NODES} nodes or {MAX_ALIAS_BYTES} bytes \
                                 of text"
                            ),
                            "write the repeated parts out instead of using anchors and aliases",
                        );
                        self.alias_budget = 0;
                        self.alias_bytes = 0;
                        self.aliases_spent = true;
                        Node::new(pos, Value::Null)
                    }
                    None => Node::new(pos, Value::Null),
                };
                self.push_node(node, 0);
            }
        }
    }

    /// Reports a control character in a scalar's value, at its own position when it is
    /// written literally in the source.
    fn check_controls(&mut self, value: &str, span: &Span, pos: Pos) {
        let (from, to) = (span.start.index(), span.end.index().max(span.start.index() + 1));
        let literal = self.controls.iter().find(|(i, _, _)| (from..to).contains(i));
        let (c, at) = match (literal, value.chars().find(|c| crate::text::is_unsafe(*c))) {
            (Some((_, c, p)), _) => (*c, *p),
            // Written as an escape (`"\0"`, `"\e"`): at the scalar.
            (None, Some(c)) => (c, pos),
            (None, None) => return,
        };
        let path = self.child_path();
        self.issue(
            at,
            if path.is_empty() { "(document)" } else { &path },
            format!("control character U+{:04X} in a value", u32::from(c)),
            "remove it: values may hold printable text, tabs and newlines only",
        );
    }

    fn scalar(&mut self, text: Cow<'_, str>, style: ScalarStyle, tag: Option<Cow<'_, Tag>>, pos: Pos) -> Node {
        let raw = text.to_string();
        let quoted = style != ScalarStyle::Plain;
        let value = match Scalar::parse_from_cow_and_metadata(text, style, tag.as_ref()) {
            Some(Scalar::Null) => Value::Null,
            Some(Scalar::Boolean(b)) => Value::Bool(b),
            Some(Scalar::Integer(i)) => Value::Int(i),
            Some(Scalar::FloatingPoint(f)) => Value::Float(f.into_inner()),
            Some(Scalar::String(s)) => Value::Str(s.into_owned()),
            None => {
                let path = self.child_path();
                let tag = tag.map(|t| t.to_string()).unwrap_or_default();
                self.issue(
                    pos,
                    &path,
                    format!("`{}` does not match its tag `{tag}`", clip(&raw)),
                    "remove the tag or write a value of that type",
                );
                Value::Null
            }
        };
        Node {
            pos,
            value,
            raw,
            quoted,
        }
    }

    fn push_node(&mut self, node: Node, anchor: usize) {
        if anchor > 0 {
            self.anchors.push((anchor, node.clone()));
        }
        let mut issue = None;
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map {
                entries,
                seen,
                pending,
                path,
                ..
            }) => match pending.take() {
                None => {
                    let text = match &node.value {
                        Value::Seq(_) | Value::Map(_) => {
                            issue = Some((
                                node.pos,
                                path.clone(),
                                "a mapping key must be a plain word, not a list or mapping".to_string(),
                                "write the key as text, e.g. `name: value`",
                            ));
                            "?".to_string()
                        }
                        _ => node.raw.clone(),
                    };
                    *pending = Some(Key { text, pos: node.pos });
                }
                Some(key) => {
                    if let Some(first_line) = seen.get(&key.text) {
                        issue = Some((
                            key.pos,
                            join(path, &key.text),
                            format!("duplicate key `{}` (first given on line {first_line})", clip(&key.text),),
                            "keep one of the two entries",
                        ));
                    } else {
                        seen.insert(key.text.clone(), key.pos.line);
                        entries.push((key, node));
                    }
                }
            },
        }
        if let Some((pos, field, message, fix)) = issue {
            self.issue(pos, &field, message, fix);
        }
    }
}

fn close(frame: Frame) -> Node {
    match frame {
        Frame::Seq { pos, items, .. } => Node::new(pos, Value::Seq(items)),
        Frame::Map {
            pos,
            mut entries,
            pending,
            ..
        } => {
            // A key without a value cannot come from the parser; keep it as null.
            if let Some(k) = pending {
                let kp = k.pos;
                entries.push((k, Node::new(kp, Value::Null)));
            }
            Node::new(pos, Value::Map(entries))
        }
    }
}

/// Reads YAML text into a located tree. Never panics; a parser panic (a bug in the
/// parser) is reported as a syntax error at the start of the file.
pub fn parse(text: &str) -> Document {
    let mut controls = Vec::new();
    let (mut line, mut col) = (1, 1);
    for (i, c) in text.chars().enumerate() {
        // CR ends lines in CRLF files: not a value's character.
        if crate::text::is_unsafe(c) && c != '\r' {
            controls.push((i, c, Pos { line, col }));
        }
        if c == '\n' {
            (line, col) = (line + 1, 1);
        } else {
            col += 1;
        }
    }
    // The parser refuses some control characters outright, without saying where they belong:
    // it reads a copy with each replaced (one character for one, so positions stay), and
    // the scalar that holds one is reported with its field (`check_controls`).
    let replaced: String;
    let text = if controls.is_empty() {
        text
    } else {
        replaced = text
            .chars()
            .map(|c| {
                if crate::text::is_unsafe(c) && c != '\r' {
                    '\u{fffd}'
                } else {
                    c
                }
            })
            .collect();
        &replaced
    };
    let mut b = Builder {
        controls,
        stack: Vec::new(),
        docs: Vec::new(),
        anchors: Vec::new(),
        alias_budget: MAX_ALIAS_NODES,
        aliases_spent: false,
        alias_bytes: MAX_ALIAS_BYTES,
        skipping: 0,
        issues: Vec::new(),
        fatal: false,
    };
    let run = catch_unwind(AssertUnwindSafe(|| {
        let mut parser = Parser::new_from_str(text);
        while let Some(ev) = parser.next_event() {
            match ev {
                Ok((ev, span)) => b.on_event(ev, span),
                Err(e) => {
                    let m = e.marker();
                    let at = Pos {
                        line: m.line().max(1),
                        col: m.col() + 1,
                    };
                    b.fatal = true;
                    // The parser notices many mistakes a line late; blame the line at fault.
                    let x = super::syntax::explain(text, at, e.info());
                    let field = b.open_collection_path();
                    b.issue(x.pos, &field, x.message, &x.fix);
                    break;
                }
            }
        }
    }));
    if run.is_err() {
        b.issues.push(YamlIssue {
            pos: Pos { line: 1, col: 1 },
            field: String::new(),
            message: PARSER_FAILED.into(),
            fix: "check the file is valid YAML".into(),
        });
        b.fatal = true;
    }
    let mut doc = Document {
        root: None,
        issues: b.issues,
        fatal: b.fatal,
    };
    if doc.fatal {
        return doc;
    }
    if b.docs.len() > 1 {
        let pos = b.docs.get(1).map(|n| n.pos).unwrap_or_default();
        doc.issues.push(YamlIssue {
            pos,
            field: String::new(),
            message: format!(
                "the file holds {} YAML documents (separated by `---`); expected one",
                b.docs.len()
            ),
            fix: "keep one document per file".into(),
        });
    }
    doc.root = b.docs.into_iter().next();
    doc
}

/// Collects located errors for one source.
#[derive(Debug)]
pub struct Diags {
    pub source: String,
    pub errors: Vec<SpecError>,
    /// Errors past [`MAX_KEPT`], counted and not stored.
    pub dropped: usize,
}

impl Diags {
    pub fn new(source: &str) -> Self {
        Diags {
            source: clipped(source),
            errors: Vec::new(),
            dropped: 0,
        }
    }

    pub fn at(&mut self, pos: Pos, field: &str, message: impl Into<String>, fix: impl Into<String>) {
        if self.errors.len() >= MAX_KEPT {
            self.dropped += 1;
            return;
        }
        self.errors.push(SpecError {
            source: self.source.clone(),
            line: pos.line,
            col: pos.col,
            field: clipped(field),
            message: clipped_message(&message.into()),
            fix: fix.into(),
        });
    }

    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// Adds the YAML layer's issues.
    pub fn extend_yaml(&mut self, issues: &[YamlIssue]) {
        for i in issues {
            self.at(i.pos, &i.field, i.message.clone(), i.fix.clone());
        }
    }

    /// The errors sorted by position (unpositioned first), as the result of a parse. At
    /// most [`MAX_ERRORS`] are kept, followed by one line counting the rest.
    pub fn into_result<T>(mut self, value: Option<T>) -> Result<T, super::SpecErrors> {
        self.errors.sort_by_key(|e| (e.line, e.col));
        if self.errors.len() + self.dropped > MAX_ERRORS {
            let more = self.errors.len() + self.dropped - MAX_ERRORS;
            self.errors.truncate(MAX_ERRORS);
            self.dropped = 0;
            self.at(
                Pos::default(),
                "",
                format!("... and {more} more errors"),
                "fix the errors above and validate again",
            );
        }
        match value {
            Some(v) if self.errors.is_empty() => Ok(v),
            _ => {
                if self.errors.is_empty() {
                    self.at(Pos::default(), "", "the file could not be read", "check the file");
                }
                Err(super::SpecErrors(self.errors))
            }
        }
    }

    /// Reports the keys of `node` (a mapping at `path`) that are not in `allowed`, with a
    /// "did you mean" hint where one is close.
    pub fn unknown_fields(&mut self, node: &Node, path: &str, allowed: &[&str], hints: &[(&str, &str)]) {
        let Some(entries) = node.as_map() else { return };
        for (k, _) in entries {
            if allowed.contains(&k.text.as_str()) {
                continue;
            }
            let field = join(path, &k.text);
            let hinted = hints.iter().find(|(from, _)| *from == k.text).map(|(_, to)| *to);
            let fix = if k.text == "<<" {
                "YAML merge keys (`<<`) are not supported; write the fields out".to_string()
            } else if let Some(s) = hinted.or_else(|| suggest(&k.text, allowed)) {
                format!("did you mean `{s}`?")
            } else {
                format!("remove it; allowed here: {}", allowed.join(", "))
            };
            self.at(k.pos, &field, format!("unknown field `{}`", clip(&k.text)), fix);
        }
    }

    /// Reports a missing required field, located at the parent mapping.
    pub fn missing(&mut self, parent: &Node, path: &str, key: &str, fix: impl Into<String>) {
        self.at(
            parent.pos,
            &join(path, key),
            format!("missing required field `{key}`"),
            fix,
        );
    }

    /// Requires `node` to be a mapping.
    pub fn map<'a>(&mut self, node: &'a Node, path: &str, fix: &str) -> Option<&'a [(Key, Node)]> {
        let m = node.as_map();
        if m.is_none() {
            self.at(
                node.pos,
                path,
                format!("expected a mapping, found {}", node.describe()),
                fix,
            );
        }
        m
    }

    /// Requires `node` to be a list.
    pub fn seq<'a>(&mut self, node: &'a Node, path: &str, fix: &str) -> Option<&'a [Node]> {
        let s = node.as_seq();
        if s.is_none() {
            self.at(
                node.pos,
                path,
                format!("expected a list, found {}", node.describe()),
                fix,
            );
        }
        s
    }

    /// A whole number in `min..=max`. Quoted numbers, decimals, booleans and nulls are
    /// reported as wrong types.
    pub fn int(&mut self, node: &Node, path: &str, min: i64, max: i64) -> Option<i64> {
        let range_fix = format!("write a whole number from {min} to {max}");
        match &node.value {
            Value::Int(i) if (min..=max).contains(i) => Some(*i),
            Value::Int(i) if *i < min && *i < 0 && min >= 0 => {
                self.at(node.pos, path, format!("must not be negative (found {i})"), range_fix);
                None
            }
            Value::Int(i) => {
                let side = if *i < min { "at least" } else { "at most" };
                let bound = if *i < min { min } else { max };
                self.at(node.pos, path, format!("must be {side} {bound} (found {i})"), range_fix);
                None
            }
            Value::Float(f) if is_digits(&node.raw) => {
                let _ = f;
                self.at(
                    node.pos,
                    path,
                    format!("the number `{}` is too large", clip(&node.raw)),
                    range_fix,
                );
                None
            }
            Value::Float(_) => {
                self.at(
                    node.pos,
                    path,
                    format!("must be a whole number, found {}", node.describe()),
                    range_fix,
                );
                None
            }
            Value::Str(s) if s.trim().parse::<i64>().is_ok() => {
                self.at(
                    node.pos,
                    path,
                    format!("must be a number, found the text \"{}\"", clip(s)),
                    format!("remove the quotes: {}", s.trim()),
                );
                None
            }
            _ => {
                self.at(
                    node.pos,
                    path,
                    format!("must be a whole number, found {}", node.describe()),
                    range_fix,
                );
                None
            }
        }
    }

    /// `true` or `false`.
    pub fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        match &node.value {
            Value::Bool(b) => Some(*b),
            _ => {
                self.at(
                    node.pos,
                    path,
                    format!("must be true or false, found {}", node.describe()),
                    "write true or false (without quotes)",
                );
                None
            }
        }
    }

    /// Text: any non-empty scalar, read as written (`name: 2024` is the text "2024").
    pub fn text(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.value {
            Value::Str(s) => Some(s.clone()),
            Value::Int(_) | Value::Float(_) | Value::Bool(_) => Some(node.raw.clone()),
            _ => {
                self.at(
                    node.pos,
                    path,
                    format!("must be text, found {}", node.describe()),
                    "write a value, e.g. `field: some-text`",
                );
                None
            }
        }
    }
}

fn is_digits(s: &str) -> bool {
    let t = s.strip_prefix(['-', '+']).unwrap_or(s);
    !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())
}

/// Edit distance counting a swap of two neighbours as one edit (optimal string
/// alignment), for "did you mean": `nmae` is one edit from `name`.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let w = b.len() + 1;
    let mut t = vec![0usize; (a.len() + 1) * w];
    for i in 0..=a.len() {
        for j in 0..=b.len() {
            t[i * w + j] = if i == 0 {
                j
            } else if j == 0 {
                i
            } else {
                let mut v = (t[(i - 1) * w + j - 1] + usize::from(a[i - 1] != b[j - 1]))
                    .min(t[(i - 1) * w + j] + 1)
                    .min(t[i * w + j - 1] + 1);
                if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                    v = v.min(t[(i - 2) * w + j - 2] + 1);
                }
                v
            };
        }
    }
    t[a.len() * w + b.len()]
}

/// The allowed name closest to `word`, if it is close (same word in another case, or at
/// most 2 edits for longer words, 1 for short ones).
pub fn suggest<'a>(word: &str, allowed: &[&'a str]) -> Option<&'a str> {
    // Bounded work: long words or huge candidate lists get no suggestion.
    if word.chars().count() > 64 || allowed.len() > 256 {
        return None;
    }
    let lower = word.to_ascii_lowercase();
    if let Some(s) = allowed.iter().find(|a| a.to_ascii_lowercase() == lower) {
        return Some(s);
    }
    let limit = if word.chars().count() <= 4 { 1 } else { 2 };
    allowed
        .iter()
        .map(|a| (distance(&lower, &a.to_ascii_lowercase()), *a))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_one_based() {
        let d = parse("a: 1\nb:\n  c: [x, y]\n");
        assert!(d.issues.is_empty(), "{:?}", d.issues);
        let root = d.root.unwrap();
        let (k, v) = root.entry("a").unwrap();
        assert_eq!((k.pos.line, k.pos.col), (1, 1));
        assert_eq!((v.pos.line, v.pos.col, &v.value), (1, 4, &Value::Int(1)));
        let c = root.get("b").unwrap().get("c").unwrap();
        let y = &c.as_seq().unwrap()[1];
        assert_eq!((y.pos.line, y.pos.col), (3, 10));
        assert_eq!(y.value, Value::Str("y".into()));
    }

    #[test]
    fn duplicates_are_all_reported_with_paths() {
        let d = parse("a: 1\nb:\n  c: 1\n  c: 2\na: 3\n");
        let fields: Vec<_> = d.issues.iter().map(|i| (i.field.as_str(), i.pos.line)).collect();
        assert_eq!(fields, vec![("b.c", 4), ("a", 5)]);
        assert!(!d.fatal);
    }

    #[test]
    fn syntax_errors_are_fatal_with_position() {
        let d = parse("a: [1, 2\nb: 3\n");
        assert!(d.fatal);
        assert!(d.issues[0].message.contains("syntax"), "{:?}", d.issues);
        assert!(d.issues[0].pos.line >= 1);
    }

    #[test]
    fn alias_budget_stops_billion_laughs() {
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        let mut prev = 'a';
        for c in ['b', 'c', 'd', 'e', 'f', 'g'] {
            text.push_str(&format!("{c}: &{c} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
            prev = c;
        }
        let d = parse(&text);
        assert!(d.issues.iter().any(|i| i.message.contains("aliases")), "{:?}", d.issues);
    }

    #[test]
    fn small_aliases_work() {
        let d = parse("base: &r {cpu: 1}\nother: *r\n");
        assert!(d.issues.is_empty());
        let root = d.root.unwrap();
        assert_eq!(root.get("other").unwrap().get("cpu").unwrap().value, Value::Int(1));
    }

    #[test]
    fn deep_nesting_is_rejected_without_overflow() {
        let text = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        let d = parse(&text);
        // The scanner stops runaway flow nesting itself; block nesting reaches our limit.
        assert!(
            d.issues.iter().any(|i| i.message.contains("recursion limit")),
            "{:?}",
            d.issues
        );
        let text = format!("{}{}", "[".repeat(100), "]".repeat(100));
        let d = parse(&text);
        assert!(
            d.issues.iter().any(|i| i.message.contains("nested more than")),
            "{:?}",
            d.issues
        );
        let text = "a:\n".to_string() + &"- ".repeat(10_000) + "x\n";
        let d = parse(&text);
        assert!(!d.issues.is_empty());
    }

    #[test]
    fn raw_text_and_quotes_are_kept() {
        let root = parse("a: 0x10\nb: '12'\nc: 1.50\n").root.unwrap();
        let a = root.get("a").unwrap();
        assert_eq!((&a.value, a.raw.as_str()), (&Value::Int(16), "0x10"));
        let b = root.get("b").unwrap();
        assert!(b.quoted);
        assert_eq!(b.value, Value::Str("12".into()));
        assert_eq!(root.get("c").unwrap().raw, "1.50");
    }

    #[test]
    fn multiple_documents_are_reported() {
        let d = parse("a: 1\n---\nb: 2\n");
        assert!(d.issues.iter().any(|i| i.message.contains("2 YAML documents")));
    }

    #[test]
    fn suggestions() {
        let allowed = ["instances", "commands", "memoryMB", "gpu"];
        assert_eq!(suggest("instance", &allowed), Some("instances"));
        assert_eq!(suggest("memoryMb", &allowed), Some("memoryMB"));
        assert_eq!(suggest("gpus", &allowed), Some("gpu"));
        assert_eq!(suggest("zzzzzz", &allowed), None);
        assert_eq!(suggest("nmae", &["name", "gang"]), Some("name"));
    }
}
