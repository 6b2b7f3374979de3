//! Headless Chromium through chromedriver, spoken with the W3C WebDriver HTTP protocol
//! (reqwest; no extra crates): the browser tests of the job dashboard
//! (`dashboard_browser.rs`) and of the RM's cluster page (`cluster_dashboard.rs`) share it.
//! Chromium and chromedriver must be installed (`apt-get install chromium
//! chromium-driver`); without them the tests fail rather than skip.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

pub fn chromedriver_path() -> PathBuf {
    for p in ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    panic!(
        "chromedriver not found (looked in /usr/bin and /usr/lib/chromium): install it with \
         `apt-get update && apt-get install -y chromium chromium-driver`"
    );
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A chromedriver process plus one browser session; both end on drop.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub async fn start() -> Browser {
        assert!(
            Path::new(CHROMIUM).exists(),
            "{CHROMIUM} not found: install it with `apt-get update && apt-get install -y chromium chromium-driver`"
        );
        let port = free_port();
        let driver = Command::new(chromedriver_path())
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = gpuam::tls::http_client();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not come up on port {port}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-quic",
            "--disable-dev-shm-usage",
            "--window-size=1366,768",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--user-data-dir={}", profile.path().display())])
        .collect::<Vec<_>>();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args}
        }}});
        let r: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("chromedriver could not start chromium: {r}"))
            .to_string();
        let b = Browser {
            driver,
            base,
            session,
            http,
            _profile: profile,
        };
        // Make the viewport (not the window) 1366×768, a common laptop screen.
        let inner = b
            .js("return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight];")
            .await;
        let (dw, dh) = (inner[0].as_i64().unwrap_or(0), inner[1].as_i64().unwrap_or(0));
        b.cmd(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": 1366 + dw, "height": 768 + dh})),
        )
        .await;
        b
    }

    /// A webdriver command of this session: its whole answer, errors included.
    async fn answer(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{}", self.base, self.session, path);
        let mut req = self.http.request(method, url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        req.send().await.unwrap().json().await.unwrap()
    }

    pub async fn cmd(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let r = self.answer(method, path, body).await;
        if r["value"].get("error").is_some() {
            panic!("webdriver {path}: {}", r["value"]);
        }
        r["value"].clone()
    }

    pub async fn goto(&self, url: &str) {
        self.cmd(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// Runs `body` as a function body in the page and returns its value.
    pub async fn js(&self, body: &str) -> Value {
        self.cmd(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": body, "args": []})),
        )
        .await
    }

    /// Polls `body` until it returns a truthy value.
    pub async fn wait_for(&self, what: &str, body: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.js(body).await;
            let truthy = !(v.is_null() || v == json!(false) || v == json!(0) || v == json!(""));
            if truthy {
                return v;
            }
            if Instant::now() > deadline {
                let _ = self.screenshot("target/dashboard-failure.png").await;
                panic!("timed out waiting for {what} (screenshot: target/dashboard-failure.png)");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the element `css` finds. A live page may re-render it between the finding
    /// and the click (webdriver's "stale element reference"): then it is found again and
    /// clicked, for at most 10 s; any other error fails the test.
    pub async fn click(&self, css: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let find = json!({"using": "css selector", "value": css});
            let r = self.answer(reqwest::Method::POST, "/element", Some(find)).await;
            let Some(id) = r["value"][ELEMENT_KEY].as_str().map(str::to_string) else {
                let _ = self.screenshot("target/dashboard-failure.png").await;
                panic!("no element {css} to click: {r} (screenshot: target/dashboard-failure.png)");
            };
            let path = format!("/element/{id}/click");
            let r = self.answer(reqwest::Method::POST, &path, Some(json!({}))).await;
            match r["value"].get("error").and_then(Value::as_str) {
                None => return,
                Some("stale element reference") if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Some(_) => panic!("webdriver click on {css}: {}", r["value"]),
            }
        }
    }

    pub async fn screenshot(&self, path: &str) -> PathBuf {
        let v = self.cmd(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(v.as_str().unwrap());
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, png).unwrap();
        p
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ends chromium too: chromedriver owns it. Best effort on the way out.
        let _ = std::process::Command::new("curl")
            .args(["-s", "-X", "DELETE", &format!("{}/session/{}", self.base, self.session)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

pub fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("bad base64 byte {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().filter(|&&b| b == b'=').count();
        let mut n = 0u32;
        for (i, &b) in chunk.iter().enumerate() {
            n |= if b == b'=' { 0 } else { val(b) } << (18 - 6 * i);
        }
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
    }
    out
}
