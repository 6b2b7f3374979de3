//! Reading an HTTP answer from the other side of the RM–agent wire within a bound.
//!
//! Owns the limits on what one side reads of the other's answer: an agent (one host's
//! token is enough to run one) that answered a start with 1.5 GB took the RM to 9 GB of
//! memory and wedged its state store; an RM reached over plain HTTP could do the same to
//! an agent. Error texts are read up to [`ERROR_TEXT_MAX`] (the rest is said, not read);
//! JSON answers up to a size their callers name, beyond which they are refused unread.

use serde::de::DeserializeOwned;

/// Most bytes of an error answer's text read and kept.
pub const ERROR_TEXT_MAX: usize = 4096;

/// Most bytes of a `ContainerStatus` answer (its diagnostics are a few KiB at most).
pub const STATUS_MAX: usize = 256 << 10;

/// Reads at most `max` bytes of `resp`'s body; `Err` (what was read is dropped) when it
/// holds more, or does not arrive whole.
pub async fn body_within(mut resp: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Err(format!(
            "an answer of {} bytes, over the {max} bytes read of one",
            resp.content_length().unwrap_or_default()
        ));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > max {
            return Err(format!("an answer over the {max} bytes read of one"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The answer as `T`, read within `max` bytes.
pub async fn json_within<T: DeserializeOwned>(resp: reqwest::Response, max: usize) -> Result<T, String> {
    let body = body_within(resp, max).await?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

/// The first [`ERROR_TEXT_MAX`] bytes of an error answer's text, saying when there was more.
pub async fn error_text(mut resp: reqwest::Response) -> String {
    let mut body: Vec<u8> = Vec::new();
    let mut cut = false;
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = ERROR_TEXT_MAX - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if chunk.len() > room {
            cut = true;
            break;
        }
    }
    let mut text = String::from_utf8_lossy(&body).into_owned();
    if cut {
        text.push_str(&format!(" … (cut: only the first {ERROR_TEXT_MAX} bytes are read)"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A server that answers one request with `status` and `len` bytes of `x`, chunked
    /// (no length said), for as long as the client reads.
    async fn answering(status: u16, len: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req).await;
            let head = format!("HTTP/1.1 {status} X\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let chunk = vec![b'x'; 64 << 10];
            let mut left = len;
            while left > 0 {
                let n = left.min(chunk.len());
                let frame = [format!("{n:x}\r\n").as_bytes(), &chunk[..n], b"\r\n"].concat();
                if s.write_all(&frame).await.is_err() {
                    return;
                }
                left -= n;
            }
            let _ = s.write_all(b"0\r\n\r\n").await;
        });
        format!("http://{addr}/")
    }

    async fn get(url: &str) -> reqwest::Response {
        crate::tls::http_client().get(url).send().await.unwrap()
    }

    #[tokio::test]
    async fn an_answer_over_the_bound_is_refused_without_reading_it_all() {
        // 1 GiB offered: refused after the bound, in far less memory and time than reading it.
        let url = answering(200, 1 << 30).await;
        let resp = get(&url).await;
        let err = body_within(resp, STATUS_MAX).await.unwrap_err();
        assert!(err.contains("over the"), "{err}");
        let url = answering(200, 100).await;
        let body = body_within(get(&url).await, STATUS_MAX).await.unwrap();
        assert_eq!(body.len(), 100);
    }

    #[tokio::test]
    async fn an_error_text_is_cut_and_says_so() {
        let url = answering(404, 1 << 30).await;
        let text = error_text(get(&url).await).await;
        assert!(text.len() < ERROR_TEXT_MAX + 100, "{}", text.len());
        assert!(text.ends_with("bytes are read)"), "{}", &text[text.len() - 80..]);
        let url = answering(500, 10).await;
        assert_eq!(error_text(get(&url).await).await, "xxxxxxxxxx");
    }
}
