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

/// `s` as a terminal may show it: every character [`is_unsafe`] (and every bidirectional
/// override, [`is_bidi_control`]) written as its escape (`\u{1b}`), the rest as it is. The
/// CLI's last line against text from the RM or from other users (node racks and labels,
/// job names, reasons) that reached it unchecked (`cli::emit`).
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| is_unsafe(c) || is_bidi_control(c)) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if is_unsafe(c) || is_bidi_control(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A bidirectional embedding, override or isolate (U+202A–U+202E, U+2066–U+2069): it
/// reorders what a terminal shows after it (a "Trojan Source" spoof).
pub fn is_bidi_control(c: char) -> bool {
    ('\u{202a}'..='\u{202e}').contains(&c) || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// A control character that text shown to people must not carry (C0 but `\n` and `\t`,
/// DEL, C1).
pub fn is_unsafe(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
