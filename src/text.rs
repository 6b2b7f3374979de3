//! Text that came from outside — a process's stderr, an AM's finish request, a node's
//! report — made safe to store and show: terminal escape sequences (ANSI colours, cursor
//! moves, window titles) are removed with `strip-ansi-escapes`, and so is every other
//! control character but newline and tab. Applications' and containers' diagnostics pass
//! through [`clean`] before the RM keeps them.

/// `s` without escape sequences and without control characters other than `\n` and `\t`.
pub fn clean(s: &str) -> String {
    if !s.chars().any(is_unsafe) {
        return s.to_string();
    }
    let stripped = strip_ansi_escapes::strip_str(s);
    stripped.chars().filter(|c| !is_unsafe(*c)).collect()
}

/// The last bytes of a file as text: `buf` read from some offset on (`cut`: not from the
/// file's start), without the continuation bytes of a character the offset cut in half
/// (at most 3), invalid UTF-8 replaced. The node's log tails and the RM's read it so.
pub fn lossy_tail(buf: &[u8], cut: bool) -> String {
    let mut skip = 0;
    if cut {
        while skip < 3 && skip < buf.len() && (buf[skip] & 0xC0) == 0x80 {
            skip += 1;
        }
    }
    String::from_utf8_lossy(&buf[skip..]).into_owned()
}

/// `s` as a terminal may show it: every character [`is_unsafe`] (and every bidirectional
/// override, [`is_bidi_control`]) written as its escape (`\u{1b}`), the rest as it is. The
/// CLI's last line against text from the RM or from other users (node racks and labels,
/// job names, reasons) that reached it unchecked (`cli::emit`).
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    escaped(s, |_, c| is_unsafe(c) || is_bidi_control(c))
}

/// `s` with each character `escape` picks (by its byte index and itself) written as its
/// escape (`\u{1b}`); borrowed when it picks none.
fn escaped(s: &str, escape: impl Fn(usize, char) -> bool) -> std::borrow::Cow<'_, str> {
    if !s.char_indices().any(|(i, c)| escape(i, c)) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for (i, c) in s.char_indices() {
        if escape(i, c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// [`shown`] for a field printed on one line (a reason, a diagnostic, a value quoted in an
/// error message): line breaks (`\n`, `\r`) are escaped too, so the text cannot forge
/// a line of its own below it.
pub fn shown_line(s: &str) -> std::borrow::Cow<'_, str> {
    let shown = shown(s);
    if !shown.contains(['\n', '\r']) {
        return shown;
    }
    std::borrow::Cow::Owned(shown.replace('\n', "\\n").replace('\r', "\\r"))
}

/// A task's output as `gpuam logs` writes it: to a terminal (`is_terminal`), every control
/// character but newline, tab and the `\r` of a `\r\n` escaped as [`shown`] does (`\u{1b}`),
/// and so is every bidirectional control, so that a task does not drive its reader's
/// terminal (window titles, clearing the screen, OSC 52 clipboard writes); to a pipe or a
/// file, the bytes as they are (scripts read them so; `--raw` asks for that on a terminal).
pub fn task_output(s: &str, is_terminal: bool) -> std::borrow::Cow<'_, str> {
    if !is_terminal {
        return std::borrow::Cow::Borrowed(s);
    }
    // `\r` is kept only right before `\n` (a CRLF line end); alone it rewrites the line.
    escaped(s, |i, c| {
        (is_unsafe(c) && !(c == '\r' && s[i + 1..].starts_with('\n'))) || is_bidi_control(c)
    })
}

/// A bidirectional embedding, override or isolate (U+202A–U+202E, U+2066–U+2069), or an
/// implicit mark (U+200E LRM, U+200F RLM, U+061C ALM): it reorders what a terminal shows
/// around it (a "Trojan Source" spoof).
pub fn is_bidi_control(c: char) -> bool {
    ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}')
}

/// A control character that text shown to people must not carry (C0 but `\n` and `\t`,
/// DEL, C1).
pub fn is_unsafe(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tail read from an offset inside a character starts at the next one; from the
    /// file's start nothing is dropped (a stray continuation byte there is replaced).
    #[test]
    fn a_tail_starts_on_a_character() {
        let b = "héllo".as_bytes();
        assert_eq!(lossy_tail(&b[2..], true), "llo");
        assert_eq!(lossy_tail(&b[1..], true), "éllo");
        assert_eq!(lossy_tail(&b[2..], false), "\u{fffd}llo");
        assert_eq!(
            lossy_tail(&[0x80, 0x80, 0x80, 0x80, b'x'], true),
            "\u{fffd}x",
            "at most three"
        );
    }

    #[test]
    fn escapes_and_control_characters_go_text_stays() {
        assert_eq!(clean("plain text\nline 2\tok"), "plain text\nline 2\tok");
        assert_eq!(clean("\u{1b}[1;31merror\u{1b}[0m: boom"), "error: boom");
        assert_eq!(clean("\u{1b}]0;title\u{7}after"), "after");
        assert_eq!(clean("a\u{0}b\rc\u{7f}d\u{9b}e"), "abcde");
        assert_eq!(clean("émoji ✓"), "émoji ✓");
    }

    #[test]
    fn shown_escapes_control_characters_and_keeps_lines() {
        assert!(matches!(shown("plain\tok\n"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(
            shown("/r\u{1b}]0;PWNED\u{7}\u{1b}[2J"),
            "/r\\u{1b}]0;PWNED\\u{7}\\u{1b}[2J"
        );
        assert_eq!(shown("a\u{9b}b\u{202e}c"), "a\\u{9b}b\\u{202e}c");
    }

    #[test]
    fn implicit_bidi_marks_are_bidi_controls() {
        for c in ['\u{200e}', '\u{200f}', '\u{061c}', '\u{202e}', '\u{2066}'] {
            assert!(is_bidi_control(c), "{c:?}");
        }
        assert!(!is_bidi_control('\u{200d}'));
        assert_eq!(shown("a\u{200f}b"), "a\\u{200f}b");
    }

    #[test]
    fn shown_line_escapes_line_breaks_too() {
        assert!(matches!(shown_line("plain\tok"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(
            shown_line("boom\n\nstate SUCCEEDED  exit 0\r\u{1b}[2K"),
            "boom\\n\\nstate SUCCEEDED  exit 0\\r\\u{1b}[2K"
        );
    }

    #[test]
    fn task_output_is_escaped_on_a_terminal_and_raw_elsewhere() {
        let forged = "\u{1b}]0;PWNED\u{7}\u{1b}[2J\u{1b}[Hlogin again\r\n\u{1b}]52;c;ZWNobw==\u{7}\tok\n";
        assert_eq!(task_output(forged, false), forged);
        assert_eq!(
            task_output(forged, true),
            "\\u{1b}]0;PWNED\\u{7}\\u{1b}[2J\\u{1b}[Hlogin again\r\n\\u{1b}]52;c;ZWNobw==\\u{7}\tok\n"
        );
        assert_eq!(
            task_output("50%\r100%\n\u{202e}x\u{200e}", true),
            "50%\\r100%\n\\u{202e}x\\u{200e}"
        );
        assert!(matches!(
            task_output("plain\r\nlines\tok\n", true),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
