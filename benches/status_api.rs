//! Status API latency with 1,000 tasks and 1,000 nodes: criterion over the router
//! (no sockets), then p50/p99 over 2,000 sequential requests per endpoint against a
//! loopback server (what the dashboard and scrapers see). Target: p99 < 10 ms.

use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body};
use axum::http::Request;
use criterion::{criterion_group, criterion_main, Criterion};
use gpuam::web::{
    demo::{demo_hub, DEMO_TOKEN},
    router, serve,
};
use tower::ServiceExt;

const ENDPOINTS: [&str; 5] = [
    "/api/v1/job",
    "/api/v1/tasks?limit=100",
    "/api/v1/nodes?limit=100",
    "/api/v1/snapshot",
    "/metrics",
];

fn bench_router(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let app = router(demo_hub(1000, 1000));
    for ep in ENDPOINTS {
        c.bench_function(&format!("oneshot {ep}"), |b| {
            b.iter(|| {
                rt.block_on(async {
                    let r = app
                        .clone()
                        .oneshot(
                            Request::get(ep)
                                .header("authorization", format!("Bearer {DEMO_TOKEN}"))
                                .body(Body::empty())
                                .unwrap(),
                        )
                        .await
                        .unwrap();
                    assert!(r.status().is_success());
                    to_bytes(r.into_body(), usize::MAX).await.unwrap().len()
                })
            })
        });
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

fn loopback_percentiles(_c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (addr, server) = serve(demo_hub(1000, 1000), "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let client = gpuam::tls::http_client();
        println!("\nloopback latency, 1,000 tasks and 1,000 nodes, 2,000 sequential requests each:");
        for ep in ENDPOINTS {
            let url = format!("http://{addr}{ep}");
            for _ in 0..50 {
                client
                    .get(&url)
                    .bearer_auth(DEMO_TOKEN)
                    .send()
                    .await
                    .unwrap()
                    .bytes()
                    .await
                    .unwrap();
            }
            let mut lat = Vec::with_capacity(2000);
            let mut bytes = 0;
            for _ in 0..2000 {
                let t = Instant::now();
                let r = client.get(&url).bearer_auth(DEMO_TOKEN).send().await.unwrap();
                assert!(r.status().is_success());
                bytes = r.bytes().await.unwrap().len();
                lat.push(t.elapsed());
            }
            lat.sort();
            let p99 = quantile(&lat, 0.99);
            println!(
                "  {ep:<28} {bytes:>8} B  p50 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms  {}",
                quantile(&lat, 0.5).as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3,
                lat[lat.len() - 1].as_secs_f64() * 1e3,
                if p99 < Duration::from_millis(10) {
                    "ok (< 10 ms)"
                } else {
                    "OVER 10 ms"
                }
            );
        }
        server.abort();
    });
}

criterion_group!(benches, bench_router, loopback_percentiles);
criterion_main!(benches);
