//! Which local user a loopback TCP connection comes from: the uid that owns the peer's
//! socket, asked of the kernel by its four addresses (`sock_diag`'s exact lookup, one
//! netlink round trip; what `ss -e` shows). A listener counts loopback connections per
//! local user with it ([`crate::tls::decide`]), so one user's processes on a host (a
//! tenant's task on an agent beside the RM) cannot hold the places of the host's other
//! users, its agents and its AMs (twelfth pass).

use std::net::{IpAddr, SocketAddr};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
/// `INET_DIAG_NOCOOKIE`: look the socket up by its addresses alone.
const NO_COOKIE: u32 = u32::MAX;
/// Header (16) + `inet_diag_req_v2` (56).
const REQUEST_LEN: usize = 16 + 56;
/// Where `idiag_uid` lies in an answer: header (16) + family, state, timer, retrans (4) +
/// `inet_diag_sockid` (48) + expires, rqueue, wqueue (12).
const UID_AT: usize = 16 + 4 + 48 + 12;

/// The uid owning the local TCP socket whose own address is `from` and whose peer is
/// `to` (both on this host: a connection accepted from `from` at `to`); `None` where the
/// kernel does not say (not a local socket, gone already, no `sock_diag`).
pub fn uid_of(from: SocketAddr, to: SocketAddr) -> Option<u32> {
    let (from, to) = (canon(from), canon(to));
    let family = match (from.ip(), to.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let req = request(family, from, to);
    // SAFETY: plain socket calls on a descriptor this function owns and closes; the
    // buffers are local and their lengths are passed.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        );
        if fd < 0 {
            return None;
        }
        let fd: std::os::fd::OwnedFd = std::os::fd::FromRawFd::from_raw_fd(fd);
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
        kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        let sent = libc::sendto(
            raw,
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        );
        if sent != req.len() as isize {
            return None;
        }
        // The answer comes at once (the kernel answers before `sendto` returns); a
        // timeout guards against a kernel that never does.
        let tv = libc::timeval { tv_sec: 1, tv_usec: 0 };
        libc::setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
        let mut buf = [0u8; 512];
        let got = libc::recv(raw, buf.as_mut_ptr().cast(), buf.len(), 0);
        if got < 0 {
            return None;
        }
        parse_uid(&buf[..got as usize])
    }
}

fn canon(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(crate::tls::canonical(a.ip()), a.port())
}

/// The `SOCK_DIAG_BY_FAMILY` request for the TCP socket `src` → `dst`.
fn request(family: i32, src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut m = Vec::with_capacity(REQUEST_LEN);
    // nlmsghdr: length, type, flags, sequence, port id (host order).
    m.extend_from_slice(&(REQUEST_LEN as u32).to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    // inet_diag_req_v2: family, protocol, extensions, pad, states (any).
    m.extend_from_slice(&[family as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    m.extend_from_slice(&u32::MAX.to_ne_bytes());
    // inet_diag_sockid: ports (network order), addresses (16 bytes each), interface,
    // cookie.
    m.extend_from_slice(&src.port().to_be_bytes());
    m.extend_from_slice(&dst.port().to_be_bytes());
    for a in [src.ip(), dst.ip()] {
        let mut bytes = [0u8; 16];
        match a {
            IpAddr::V4(v4) => bytes[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => bytes.copy_from_slice(&v6.octets()),
        }
        m.extend_from_slice(&bytes);
    }
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    m.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    m
}

/// The uid in a `SOCK_DIAG_BY_FAMILY` answer; `None` for anything else (an `NLMSG_ERROR`:
/// no such socket) or a short one.
fn parse_uid(answer: &[u8]) -> Option<u32> {
    let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
    if kind != SOCK_DIAG_BY_FAMILY {
        return None;
    }
    Some(u32::from_ne_bytes(answer.get(UID_AT..UID_AT + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::os::unix::process::CommandExt as _;

    /// A connection this process opened on loopback is found as this process's user's;
    /// one that no longer exists, and a made-up one, are nobody's.
    #[test]
    fn a_loopback_connection_is_found_as_its_users() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(at).unwrap();
        let (_server, from) = listener.accept().unwrap();
        assert_eq!(from, client.local_addr().unwrap());
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(uid_of(from, at), Some(me));
        // The server's own end is found too (its addresses the other way round).
        assert_eq!(uid_of(at, from), Some(me));
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(uid_of(nobody, at), None);
        drop(client);
    }

    /// IPv6 loopback, where this machine has it.
    #[test]
    fn an_ipv6_loopback_connection_is_found_too() {
        let Ok(listener) = std::net::TcpListener::bind("[::1]:0") else {
            eprintln!("no IPv6 loopback here: nothing to check");
            return;
        };
        let at = listener.local_addr().unwrap();
        let _client = std::net::TcpStream::connect(at).unwrap();
        let (_server, from) = listener.accept().unwrap();
        assert_eq!(uid_of(from, at), Some(nix::unistd::geteuid().as_raw()));
    }

    /// A connection opened by another user (root's test runs a child as `nobody`) is that
    /// user's, not the listener's.
    #[test]
    fn another_users_connection_is_theirs() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("not root: cannot run a process as another user here");
            return;
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let mut child = std::process::Command::new("bash")
            .args(["-c", &format!("exec 3<>/dev/tcp/127.0.0.1/{}; read -u 3 x", at.port())])
            .stdout(std::process::Stdio::null())
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        let (mut server, from) = listener.accept().unwrap();
        let uid = uid_of(from, at);
        let _ = std::io::Write::write_all(&mut server, b"done\n");
        let _ = server.read(&mut [0u8; 1]);
        let _ = child.wait();
        assert_eq!(uid, Some(65534));
    }
}
