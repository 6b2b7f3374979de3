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
}
