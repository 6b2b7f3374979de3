//! The RM's cluster page (`/cluster`) in headless Chromium, over a real `gpuam rm` running
//! several jobs in two queues: the queues with their deserved share and use, the jobs with
//! their user, queue, state, GPUs, a link to each job's dashboard and why a waiting one
//! waits, and the node grid with each GPU's box coloured by its job and queue. Saves
//! `target/cluster-dashboard.png`.
//!
//! Chromium and chromedriver must be installed (`apt-get install chromium
//! chromium-driver`); without them this test fails rather than skips.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::browser::Browser;
use common::*;
use serde_json::{json, Value};

/// Two nodes of 4 GPUs.
const CLUSTER: &str = "nodes:\n  - host: n1\n    rack: /r1\n    gpuType: A100\n    cpu: 16\n    memoryMB: 32000\n    gpus: 4\n  - host: n2\n    rack: /r1\n    gpuType: A100\n    cpu: 16\n    memoryMB: 32000\n    gpus: 4\n";

fn job(rm: &Rm, name: &str, queue: &str, tasks: u32, gpus: u32) -> std::path::PathBuf {
    let release = rm.path("release").display().to_string();
    let script = format!("while [ ! -e {release} ]; do sleep 0.2; done");
    rm.write_job(
        name,
        &format!(
            "name: {name}\nqueue: {queue}\ntaskRoles:\n  worker:\n    instances: {tasks}\n    \
             resourcePerInstance: {{cpu: 1, memoryMB: 512, gpu: {gpus}}}\n    commands:\n      - {}\n",
            sq(&script)
        ),
    )
}

fn overview(rm: &Rm) -> Value {
    rm.get_json("/ws/v1/cluster/overview").expect("overview")
}

#[test]
fn the_cluster_page_shows_queues_jobs_and_the_node_grid() {
    let settings = "  preemption_grace_sec: 2\n  queues:\n    research: {weight: 3}\n    prod: {weight: 1, maxGpus: 2, users: [carol, itest]}\n";
    let rm = Rm::start_with_settings(
        CLUSTER,
        settings,
        &[
            ("GPUAM__AM__NOT_AVAILABLE_RETRY_MAX_MS", "800"),
            ("GPUAM_DASHBOARD_LINGER_SEC", "0"),
        ],
    );
    // prod: two GPUs (its cap) and a job waiting at the cap; research: four GPUs and a job
    // of one 4-GPU task that fits no node (two free GPUs, on different... on one node, but
    // research is owed only 2 and the task needs 4).
    let mut subs = vec![rm.submit(&job(&rm, "serve", "prod", 2, 1))];
    subs.push(rm.submit(&job(&rm, "train", "research", 4, 1)));
    wait_for(Duration::from_secs(60), "six GPUs in use", || {
        let v = overview(&rm);
        let used: u64 = v["queues"]
            .as_array()?
            .iter()
            .map(|q| q["usedGpus"].as_u64().unwrap_or(0))
            .sum();
        (used == 6).then_some(())
    });
    subs.push(rm.submit(&job(&rm, "serve2", "prod", 1, 1)));
    subs.push(rm.submit(&job(&rm, "big", "research", 1, 4)));
    let v = wait_for(
        Duration::from_secs(60),
        "both waiting jobs to say why they wait",
        || {
            let v = overview(&rm);
            let codes: BTreeSet<String> = v["apps"]
                .as_array()?
                .iter()
                .filter_map(|a| a["whyCode"].as_str().map(str::to_string))
                .collect();
            (codes.contains("atCap") && codes.contains("nothingFits")).then_some(v)
        },
    );
    let apps: BTreeMap<String, Value> = v["apps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["name"].as_str().unwrap().to_string(), a.clone()))
        .collect();

    // Like the application listing, the overview needs a credential, and another user sees
    // the queues and whose queue holds each GPU, not the jobs.
    let (code, _) = rm.request("GET", "/ws/v1/cluster/overview", None, None);
    assert_eq!(code, 401, "no token, no overview");
    let (code, other) = rm.request("GET", "/ws/v1/cluster/overview", Some(&rm.other_token), None);
    assert_eq!(code, 200, "{other}");
    assert_eq!(other["apps"].as_array().map(Vec::len), Some(0), "{other}");
    let boxes: Vec<&Value> = other["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["gpus"].as_array().unwrap())
        .filter(|g| g["used"] == true)
        .collect();
    assert_eq!(boxes.len(), 6, "{other}");
    assert!(
        boxes.iter().all(|g| g["app"].is_null() && g["queue"].is_string()),
        "{other}"
    );
    // The browser runs on its own runtime (the RM helper blocks on its own).
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(check_page(&rm, &apps));
    std::fs::write(rm.path("release"), "").unwrap();
    for s in subs {
        let out = s.wait(Duration::from_secs(60));
        assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    }
}

async fn check_page(rm: &Rm, apps: &BTreeMap<String, Value>) {
    let b = Browser::start().await;
    b.goto(&format!("{}/cluster#token={}", rm.url, rm.user_token)).await;
    b.wait_for(
        "the page to load",
        "return document.body.dataset.ready === 'true';",
        Duration::from_secs(15),
    )
    .await;
    // Queues: deserved share and use.
    let queues = b
        .js("return [...document.querySelectorAll('tr[data-queue]')].map(r => [r.dataset.queue, r.querySelector('[data-deserved]').dataset.deserved, Number(r.querySelector('[data-used]').dataset.used)]);")
        .await;
    assert_eq!(
        queues,
        json!([["prod", "2.00", 2], ["research", "6.00", 4]]),
        "{queues}"
    );
    // Jobs: four, each with its queue, state and link to its own dashboard.
    let rows = b
        .js("return [...document.querySelectorAll('tr[data-app]')].map(r => ({id: r.dataset.app, state: r.dataset.state, why: r.dataset.whyCode, link: (r.querySelector('a') || {}).href || null, queue: r.children[2].textContent, gpus: Number(r.querySelector('[data-gpus]').dataset.gpus), user: r.children[1].textContent}));")
        .await;
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (name, queue, gpus, why) in [
        ("serve", "prod", 2, ""),
        ("train", "research", 4, ""),
        ("serve2", "prod", 0, "atCap"),
        ("big", "research", 0, "nothingFits"),
    ] {
        let app = &apps[name];
        let row = rows
            .iter()
            .find(|r| r["id"] == app["id"])
            .unwrap_or_else(|| panic!("no row for {name}: {rows:?}"));
        assert_eq!(row["queue"], queue, "{row}");
        assert_eq!(row["gpus"], gpus, "{row}");
        assert_eq!(row["why"], why, "{row}");
        assert_eq!(row["user"], "itest", "{row}");
        let url = app["trackingUrl"].as_str().unwrap();
        assert!(url.starts_with("http://127.0.0.1:"), "{app}");
        // The row links to the job's dashboard with a page ticket of that job, never with
        // the page's own token (the job's port may be another process's once its AM has
        // gone); the ticket opens that job's dashboard API.
        let link = row["link"].as_str().unwrap_or("");
        assert!(!link.contains(&rm.user_token), "{link}");
        let ticket = link
            .strip_prefix(&format!("{url}#token="))
            .unwrap_or_else(|| panic!("{link} is not {url}#token=…"));
        assert!(ticket.starts_with("p."), "{ticket}");
        let client = reqwest::Client::new();
        let job = client
            .get(format!("{url}api/v1/job"))
            .bearer_auth(ticket)
            .send()
            .await
            .unwrap();
        assert_eq!(job.status(), 200, "{name}: the ticket opens its job's dashboard");
        let other = &apps[if name == "serve" { "train" } else { "serve" }];
        let elsewhere = client
            .get(format!("{}api/v1/job", other["trackingUrl"].as_str().unwrap()))
            .bearer_auth(ticket)
            .send()
            .await
            .unwrap();
        assert_eq!(elsewhere.status(), 401, "{name}: and no other job's");
    }
    // The capped job waits for its queue: the one reason's kind and words.
    let why = b
        .js("const c = document.querySelector('tr[data-why-code=\"atCap\"] td.why'); return [c.dataset.kind, c.textContent];")
        .await;
    assert_eq!(why[0], "QueueShare", "{why}");
    assert!(
        why[1]
            .as_str()
            .unwrap()
            .starts_with("Queue share: queue `prod` is at its cap (maxGpus 2)"),
        "{why}"
    );
    // The node grid: every GPU a box; the six in use carry their job and queue, boxes of
    // one job share a colour, the two queues differ.
    let boxes = b
        .js("return [...document.querySelectorAll('[data-gpu-box]')].map(x => [x.dataset.host, Number(x.dataset.gpu), x.dataset.app || null, x.dataset.queue || null, getComputedStyle(x).backgroundColor]);")
        .await;
    let boxes = boxes.as_array().unwrap();
    assert_eq!(boxes.len(), 8, "{boxes:?}");
    let owned: Vec<&Value> = boxes.iter().filter(|x| !x[2].is_null()).collect();
    assert_eq!(owned.len(), 6, "{boxes:?}");
    let mut colour_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for x in &owned {
        let app = x[2].as_str().unwrap().to_string();
        let expected_queue = if app == apps["serve"]["id"] { "prod" } else { "research" };
        assert_eq!(x[3], expected_queue, "{x}");
        colour_of
            .entry(app)
            .or_default()
            .insert(x[4].as_str().unwrap().to_string());
    }
    assert!(
        colour_of.values().all(|c| c.len() == 1),
        "one colour per job: {colour_of:?}"
    );
    let colours: BTreeSet<&String> = colour_of.values().flatten().collect();
    assert_eq!(colours.len(), 2, "two jobs, two colours: {colour_of:?}");
    b.js("window.scrollTo(0, 0);").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shot = b.screenshot("target/cluster-dashboard.png").await;
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000, "a real screenshot");
}
