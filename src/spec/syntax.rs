//! Explains a YAML syntax error: the parser reports where it noticed the problem, which is
//! often the line after the one that is wrong (an unclosed `[`, a key without `:`, an
//! unclosed quote). This looks back from that position for the usual causes and returns
//! the line to blame, a message and a fix that fits the cause. Pure text analysis.

use super::yaml::Pos;

/// A syntax error, explained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explained {
    pub pos: Pos,
    pub message: String,
    pub fix: String,
}

/// Scans `text` up to `until` (1-based line, inclusive up to column `col`) for flow
/// brackets and quotes left open; returns the innermost unclosed one as (char, pos).
fn unclosed(text: &str, until: Pos) -> Option<(char, Pos)> {
    let mut open: Vec<(char, Pos)> = Vec::new();
    for (li, line) in text.lines().enumerate() {
        let ln = li + 1;
        if ln > until.line {
            break;
        }
        let mut quote: Option<(char, Pos)> = open.last().filter(|(c, _)| *c == '"' || *c == '\'').copied();
        if quote.is_some() {
            open.pop();
        }
        let mut prev = ' ';
        let mut chars = line.char_indices().peekable();
        while let Some((ci, c)) = chars.next() {
            let col = line[..ci].chars().count() + 1;
            if ln == until.line && col >= until.col {
                break;
            }
            match quote {
                Some(('"', _)) if c == '\\' => {
                    chars.next();
                }
                Some((q, _)) if c == q => {
                    if q == '\'' && chars.peek().is_some_and(|(_, n)| *n == '\'') {
                        chars.next();
                    } else {
                        quote = None;
                    }
                }
                Some(_) => {}
                None => match c {
                    '#' if prev == ' ' || prev == '\t' => break,
                    '"' | '\'' if prev == ' ' || prev == '[' || prev == '{' || prev == ',' || ci == 0 => {
                        quote = Some((c, Pos { line: ln, col }));
                    }
                    '[' | '{' => open.push((c, Pos { line: ln, col })),
                    ']' | '}' => {
                        open.pop();
                    }
                    _ => {}
                },
            }
            prev = c;
        }
        if let Some(q) = quote {
            open.push(q);
        }
    }
    open.last().copied()
}

/// The last line before `line` that holds something other than blanks and a comment.
fn previous_content_line(text: &str, line: usize) -> Option<(usize, &str)> {
    text.lines()
        .enumerate()
        .take(line.saturating_sub(1))
        .filter(|(_, l)| {
            let t = l.trim();
            !t.is_empty() && !t.starts_with('#')
        })
        .last()
        .map(|(i, l)| (i + 1, l))
}

/// Explains the parser's `info` at `at` (1-based line and column).
pub fn explain(text: &str, at: Pos, info: &str) -> Explained {
    let msg = |m: String| format!("YAML syntax error: {m}");
    // An unclosed `[`, `{` or quote on an earlier line: blame the line that opened it.
    if let Some((c, pos)) = unclosed(text, at) {
        if pos.line < at.line || info.contains("end of stream") {
            let (what, fix) = match c {
                '[' => (
                    "`[` is not closed",
                    "close the list with `]` on the same line (`commands: [a, b]`), or write one `- item` per line",
                ),
                '{' => (
                    "`{` is not closed",
                    "close the mapping with `}` on the same line (`{cpu: 1, memoryMB: 1024}`), or write one `key: value` per line",
                ),
                '"' => ("the double quote is not closed", "close the quoted value with `\"` on the same line"),
                _ => (
                    "the single quote is not closed",
                    "close the quoted value with `'`; inside single quotes write a quote as `''`",
                ),
            };
            return Explained {
                pos,
                message: msg(format!("{what} ({info})")),
                fix: fix.into(),
            };
        }
    }
    let line_text = text.lines().nth(at.line.saturating_sub(1)).unwrap_or("");
    if info.contains("mapping values are not allowed") {
        // `instances 2` followed by `commands: ...`: the key without `:` is the line before.
        let here_indent = line_text.len() - line_text.trim_start().len();
        if let Some((pl, prev)) = previous_content_line(text, at.line) {
            let indent = prev.len() - prev.trim_start().len();
            let t = prev.trim();
            if indent == here_indent && !t.contains(':') && !t.starts_with('-') {
                let key = t.split_whitespace().next().unwrap_or(t);
                return Explained {
                    pos: Pos {
                        line: pl,
                        col: indent + 1,
                    },
                    message: msg(format!("`{t}` has no `:` after its key")),
                    fix: format!("write `{key}: {}`", t[key.len()..].trim()),
                };
            }
        }
        return Explained {
            pos: at,
            message: msg(format!("{info}: a plain value cannot contain `: `")),
            fix: "quote the value, e.g. `- \"echo a: b\"`, or use a block scalar (`|`)".into(),
        };
    }
    if info.contains("tab") {
        return Explained {
            pos: at,
            message: msg(info.to_string()),
            fix: "indent with spaces, not tabs".into(),
        };
    }
    let char_at = line_text.chars().nth(at.col.saturating_sub(1));
    if info.contains("quoted scalar") && matches!(char_at, Some('"' | '\'')) && !info.contains("trailing") {
        return Explained {
            pos: at,
            message: msg(format!("the quote opened here is not closed on its line ({info})")),
            fix: "close the quoted value on the same line, e.g. `[\"echo hi\"]`".into(),
        };
    }
    if info.contains("trailing content after") || info.contains("quoted scalar") {
        return Explained {
            pos: at,
            message: msg(info.replace("double-quoted", "quoted")),
            fix: "a quoted value ends at its closing quote: inside single quotes write a quote as `''`, inside double quotes as `\\\"`, or quote the whole value".into(),
        };
    }
    if info.contains("did not find expected key") || info.contains("did not find expected '-'") {
        let indent = line_text.len() - line_text.trim_start().len();
        let sibling = previous_content_line(text, at.line).map(|(_, l)| l.len() - l.trim_start().len());
        let fix = match sibling {
            Some(s) if s != indent => format!(
                "this line starts at column {}; line it up with the entries of its mapping or list (the line above starts at column {}), or nest it deeper under a key",
                indent + 1,
                s + 1
            ),
            _ => "check this line's indentation: it must line up with its siblings or be nested under a key".into(),
        };
        return Explained {
            pos: at,
            message: msg(format!("{info} (wrong indentation)")),
            fix,
        };
    }
    // `[echo a[0] b]`: the item's own `]` ended the flow list early.
    let before: String = line_text.chars().take(at.col.saturating_sub(1)).collect();
    if before.contains('[') || before.contains('{') {
        return Explained {
            pos: at,
            message: msg(format!("{info} (a `[...]` or `{{...}}` on this line ended early)")),
            fix: "quote items that contain `[`, `]`, `{`, `}`, `,` or `#`, e.g. `commands: [\"echo <% $data.uri[0] %>\"]`, or write one `- item` per line".into(),
        };
    }
    Explained {
        pos: at,
        message: msg(info.to_string()),
        fix: "check the indentation, the `:` after each key and the quotes on this line".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(line: usize, col: usize) -> Pos {
        Pos { line, col }
    }

    #[test]
    fn unclosed_flow_list_blames_its_line() {
        let t = "name: j\ntaskRoles:\n  w:\n    commands: [echo hi\n    cpu: 1\n";
        let e = explain(t, at(5, 24), "illegal placement of ':' indicator");
        assert_eq!(e.pos, at(4, 15));
        assert!(e.message.contains("`[` is not closed") && e.fix.contains("]"), "{e:?}");
    }

    #[test]
    fn key_without_colon_blames_its_line() {
        let t = "name: j\ntaskRoles:\n  w:\n    instances 2\n    commands: [x]\n";
        let e = explain(t, at(5, 13), "mapping values are not allowed in this context");
        assert_eq!(e.pos, at(4, 5));
        assert_eq!(e.fix, "write `instances: 2`");
    }

    #[test]
    fn colon_inside_a_plain_value_is_blamed_where_it_is() {
        let t = "a:\n  - echo: hi: there\n";
        let e = explain(t, at(2, 13), "mapping values are not allowed in this context");
        assert_eq!(e.pos, at(2, 13));
        assert!(e.fix.contains("quote"), "{e:?}");
    }

    #[test]
    fn unclosed_quote_at_the_end_blames_the_quote() {
        let t = "a: x\nb: \"open\nc: 1\n";
        let e = explain(
            t,
            at(4, 1),
            "found unexpected end of stream while scanning a quoted scalar",
        );
        assert_eq!(e.pos, at(2, 4));
        assert!(e.message.contains("double quote"), "{e:?}");
    }

    #[test]
    fn quotes_and_comments_do_not_open_brackets() {
        let t = "a: '[x' # [\nb: \"{\"\nc: 'it''s'\nd: e: f\n";
        let e = explain(t, at(4, 5), "mapping values are not allowed in this context");
        assert_eq!(e.pos, at(4, 5));
    }

    #[test]
    fn a_quote_left_open_inside_a_list() {
        let t = "a:\n  c: [\"echo hi]\n  d: 1\n";
        let e = explain(t, at(2, 7), "invalid indentation in quoted scalar");
        assert_eq!(e.pos, at(2, 7));
        assert!(e.message.contains("not closed"), "{e:?}");
    }

    #[test]
    fn a_bracket_inside_an_unquoted_flow_item() {
        let t = "a:\n  c: [echo <% $x[0] %>]\n";
        let e = explain(t, at(2, 22), "unexpected character: `%'");
        assert_eq!(e.pos, at(2, 22));
        assert!(e.fix.contains("quote items"), "{e:?}");
    }

    #[test]
    fn bad_indentation_names_the_columns() {
        let t = "a:\n  b: 1\n c: 2\n";
        let e = explain(t, at(3, 2), "while parsing a block mapping, did not find expected key");
        assert_eq!(e.pos, at(3, 2));
        assert!(e.fix.contains("column 2") && e.fix.contains("column 3"), "{e:?}");
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_never_blames_a_later_line(text in "[ -~\n]{0,200}", line in 1usize..12, col in 1usize..40) {
            let e = explain(&text, at(line, col), "while parsing a flow sequence, did not find expected ',' or ']'");
            proptest::prop_assert!(e.pos.line <= line && e.pos.line >= 1);
            proptest::prop_assert!(!e.fix.is_empty() && !e.message.is_empty());
        }
    }
}
