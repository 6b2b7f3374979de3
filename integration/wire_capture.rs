//! What crosses the network between machines: a capture of every frame on the RM's port
//! of the namespaces' bridge (an `AF_PACKET` socket in the bridge's namespace, bound to
//! the RM's veth: everything to and from the RM, both ways) while two node agents
//! register and heartbeat, a user submits an OpenPAI job with a secret from another
//! machine (`gpuam submit` in h1's namespace, the user's token), the admin makes a call
//! from there too, and the RM starts the job's container on an agent (the launch script
//! with the rendered secret). The TCP streams are put back together (by sequence number)
//! and searched, with the raw frames, for the agent tokens, the host keys the RM hands the
//! agents, the admin and user tokens and the secret:
//!
//! - with TLS configured (README's multi-machine form: `tls.*` on the RM and the agents,
//!   `https://` URLs) none of them appears;
//! - without TLS the same capture finds them (the control: the search can find what it
//!   looks for, so the first test can fail).
//!
//! The capture must have dropped no frame (`PACKET_STATISTICS`). Needs root, `ip`,
//! `nsenter` and `curl`.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::hosts::Hosts;
use common::{bin, sq, wait_for};

/// `struct tpacket_stats` (linux/if_packet.h).
#[repr(C)]
#[derive(Default)]
struct TpacketStats {
    packets: u32,
    drops: u32,
}
const SOL_PACKET: libc::c_int = 263;
const PACKET_STATISTICS: libc::c_int = 6;

/// Every frame seen on interface `dev` of network namespace `ns` until `stop` is set, and
/// the number the kernel dropped for want of room.
fn capture(ns: String, dev: &'static str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(Vec<Vec<u8>>, u32)> {
    let ready = Arc::new(AtomicBool::new(false));
    let up = ready.clone();
    let t = std::thread::spawn(move || {
        // Only this thread enters the namespace.
        let f = fs::File::open(format!("/run/netns/{ns}")).unwrap();
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
        let proto = (libc::ETH_P_ALL as u16).to_be();
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(fd >= 0, "packet socket: {}", std::io::Error::last_os_error());
        let name = std::ffi::CString::new(dev).unwrap();
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(index > 0, "no interface {dev} in {ns}");
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = index as i32;
        let bound = unsafe {
            libc::bind(
                fd,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
        let rcvbuf: libc::c_int = 32 << 20;
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &rcvbuf as *const _ as *const libc::c_void,
                std::mem::size_of_val(&rcvbuf) as u32,
            );
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &timeout as *const _ as *const libc::c_void,
                std::mem::size_of_val(&timeout) as u32,
            );
        }
        up.store(true, Ordering::SeqCst);
        let mut frames = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while !stop.load(Ordering::SeqCst) {
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n > 0 {
                frames.push(buf[..n as usize].to_vec());
            }
        }
        let mut stats = TpacketStats::default();
        let mut len = std::mem::size_of::<TpacketStats>() as libc::socklen_t;
        let got = unsafe {
            libc::getsockopt(
                fd,
                SOL_PACKET,
                PACKET_STATISTICS,
                &mut stats as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        assert_eq!(got, 0, "PACKET_STATISTICS");
        unsafe { libc::close(fd) };
        (frames, stats.drops)
    });
    wait_for(Duration::from_secs(10), "the capture to start", || {
        ready.load(Ordering::SeqCst).then_some(())
    });
    t
}

/// Each TCP direction's payload bytes in sequence order (IPv4 over Ethernet), keyed by
/// "src:port>dst:port". Retransmitted segments land on the same sequence number.
fn tcp_streams(frames: &[Vec<u8>]) -> HashMap<String, Vec<u8>> {
    let mut flows: HashMap<String, BTreeMap<u32, Vec<u8>>> = HashMap::new();
    for f in frames {
        if f.len() < 14 + 20 || f[12..14] != [0x08, 0x00] {
            continue;
        }
        let ip = &f[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ip[9] != 6 || ip.len() < total || total < ihl + 20 {
            continue;
        }
        let tcp = &ip[ihl..total];
        let off = usize::from(tcp[12] >> 4) * 4;
        if tcp.len() <= off {
            continue;
        }
        let key = format!(
            "{}.{}.{}.{}:{}>{}.{}.{}.{}:{}",
            ip[12],
            ip[13],
            ip[14],
            ip[15],
            u16::from_be_bytes([tcp[0], tcp[1]]),
            ip[16],
            ip[17],
            ip[18],
            ip[19],
            u16::from_be_bytes([tcp[2], tcp[3]])
        );
        let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
        flows.entry(key).or_default().insert(seq, tcp[off..].to_vec());
    }
    flows
        .into_iter()
        .map(|(k, segs)| {
            let mut out = Vec::new();
            let mut next: Option<u32> = None;
            for (seq, data) in segs {
                // Skip what an overlapping retransmission repeats.
                let skip = next.map_or(0, |n| n.saturating_sub(seq) as usize).min(data.len());
                out.extend_from_slice(&data[skip..]);
                next = Some(seq.wrapping_add(data.len() as u32).max(next.unwrap_or(0)));
            }
            (k, out)
        })
        .collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Runs the scenario of the module doc and returns, for each secret (named), whether the
/// capture holds it, with the capture's size.
fn scenario(tls: bool) -> (Vec<(String, bool)>, usize, usize) {
    let tag = if tls { "24c-cap-tls" } else { "24c-cap-plain" };
    let mut h = Hosts::build(tag);
    let users = h.path("users.yaml");
    let out = Command::new(bin())
        .args(["token", "new", "--user", "alice", "--users-file"])
        .arg(&users)
        .arg("--out")
        .arg(h.path("alice.token"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    if tls {
        h.use_tls();
    }
    // The users file for the RM (beside what `use_tls` wrote).
    let conf = fs::read_to_string(h.path("conf.yaml")).unwrap();
    fs::write(
        h.path("conf.yaml"),
        conf.replacen("rm:\n", &format!("rm:\n  users_file: {}\n", users.display()), 1),
    )
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let cap = capture(h.ns("br"), "vrmb", stop.clone());
    h.start_rm();
    h.start_agent("h1");
    h.start_agent("h2");
    h.wait_agents_running();
    // A few heartbeats.
    std::thread::sleep(Duration::from_secs(3));
    let admin = fs::read_to_string(h.path("rm/admin.token")).unwrap().trim().to_string();
    let alice = fs::read_to_string(h.path("alice.token")).unwrap().trim().to_string();
    // The admin calls from another machine.
    let (code, body) = h.post_as(
        "h1",
        &admin,
        "/ws/v1/cluster/apps/new-application",
        &serde_json::json!({}),
    );
    assert_eq!(code, 200, "{body}");
    // Alice submits, from h1, an OpenPAI job whose command carries a secret.
    let secret = format!("s3cr3t-{}", gpuam::auth::new_token());
    let done = h.path("out/secret.sha");
    let job = format!(
        "protocolVersion: 2\nname: capture\ntype: job\nprerequisites:\n  - {{name: img, type: dockerimage, uri: localhost/not-here:1}}\n\
         secrets:\n  pw: {secret}\ntaskRoles:\n  a:\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 256, gpu: 1}}\n    \
         commands:\n      - {}\n",
        sq(&format!("echo <% $secrets.pw %> | sha256sum > {}", done.display()))
    );
    let job_file = h.path("capture.yaml");
    fs::write(&job_file, job).unwrap();
    let mut submit = Command::new("ip");
    submit
        .args(["netns", "exec", &h.ns("h1"), bin(), "submit"])
        .arg(&job_file)
        .args(["--rm", &h.rm_url(), "--wait", "--token-file"])
        .arg(h.path("alice.token"));
    if tls {
        submit.env("GPUAM__TLS__CA_FILE", h.path("ca.pem"));
    }
    let out = submit.output().unwrap();
    assert!(
        out.status.success(),
        "the job succeeds: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The task ran with the secret.
    let sha = fs::read_to_string(&done).unwrap();
    let want = Command::new("sh")
        .arg("-c")
        .arg(format!("echo {secret} | sha256sum"))
        .output()
        .unwrap();
    assert_eq!(sha, String::from_utf8_lossy(&want.stdout), "the task saw the secret");
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let (frames, drops) = cap.join().unwrap();
    assert_eq!(drops, 0, "the capture dropped frames");
    let streams = tcp_streams(&frames);
    let bytes: usize = frames.iter().map(Vec::len).sum();
    println!(
        "{}: captured {} frames ({bytes} bytes), {} TCP streams",
        if tls { "TLS" } else { "plain HTTP" },
        frames.len(),
        streams.len()
    );
    let token = |host: &str| {
        fs::read_to_string(h.path(&format!("{host}.token")))
            .unwrap()
            .trim()
            .to_string()
    };
    // Each host's key, as the RM hands it to the agent in the answer to its registration.
    let secret_text = fs::read_to_string(h.path("rm").join(gpuam::node::remote::HOST_KEYS_SECRET_FILE)).unwrap();
    let key = |host: &str| {
        let digest = gpuam::node::token::token_digest(&token(host));
        gpuam::auth::hex(&gpuam::node::token::host_key(
            secret_text.trim().as_bytes(),
            &h.host_name(host),
            &digest,
        ))
    };
    let needles = [
        ("agent token h1", token("h1")),
        ("agent token h2", token("h2")),
        ("host key h1", key("h1")),
        ("host key h2", key("h2")),
        ("admin token", admin),
        ("user token", alice),
        ("OpenPAI secret", secret),
    ];
    let found = needles
        .iter()
        .map(|(name, n)| {
            let n = n.as_bytes();
            let hit = streams.values().any(|s| contains(s, n)) || frames.iter().any(|f| contains(f, n));
            (name.to_string(), hit)
        })
        .collect();
    (found, frames.len(), streams.len())
}

#[test]
fn with_tls_no_token_or_secret_crosses_the_bridge_in_clear() {
    let (found, frames, streams) = scenario(true);
    assert!(
        frames > 50 && streams > 4,
        "the capture saw the traffic: {frames} frames, {streams} streams"
    );
    let seen: Vec<&String> = found.iter().filter(|(_, hit)| *hit).map(|(n, _)| n).collect();
    assert!(seen.is_empty(), "found in the capture under TLS: {seen:?}");
}

/// The control: without TLS the same capture finds the credentials and the secret.
#[test]
fn without_tls_the_same_capture_finds_them() {
    let (found, _, _) = scenario(false);
    println!("{found:?}");
    let missed: Vec<&String> = found.iter().filter(|(_, hit)| !*hit).map(|(n, _)| n).collect();
    assert!(missed.is_empty(), "not found in the plain capture: {missed:?}");
}
