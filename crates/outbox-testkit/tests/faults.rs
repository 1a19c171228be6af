//! The fault guards target a server by its port: with another `nats-server` running
//! (a node of our own, as a cluster's nodes run beside the shared server), stopping or
//! freezing it touches that process only, and the guard brings it back with the same
//! command line. Runs a NATS server of its own on a free port; the shared server is
//! only watched, never touched, so no fault lock is needed.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboxkit_testkit::faults::{
    NATS_PORT, NatsFrozen, NatsStopped, pid_listening_on, process_state,
};

/// A `nats-server` of this test's own; killed on drop, also when the test panics.
struct OwnServer {
    port: u16,
    dir: PathBuf,
}

impl OwnServer {
    fn start() -> Option<Self> {
        let server = [
            "/usr/sbin/nats-server",
            "/usr/bin/nats-server",
            "/usr/local/bin/nats-server",
        ]
        .into_iter()
        .find(|path| std::path::Path::new(path).exists())?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("nats-{port}"));
        std::fs::create_dir_all(&dir).expect("store directory");
        let port_text = port.to_string();
        let store = dir.to_string_lossy().into_owned();
        let status = Command::new("setsid")
            .args([
                "-f",
                server,
                "-a",
                "127.0.0.1",
                "-p",
                &port_text,
                "-js",
                "-sd",
                &store,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run setsid");
        assert!(status.success(), "start {server}");
        let own = Self { port, dir };
        wait_until("our server answers", || answers(port));
        Some(own)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        if let Some(pid) = pid_listening_on(self.port) {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn answers(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cmdline(pid: u32) -> Vec<u8> {
    std::fs::read(format!("/proc/{pid}/cmdline")).expect("command line")
}

/// The state letter of `/proc/PID/stat` (`T`: stopped by a signal).
fn state(pid: u32) -> char {
    process_state(pid).expect("the process exists")
}

#[test]
fn stopping_and_freezing_by_port_touch_only_that_server() {
    let Some(own) = OwnServer::start() else {
        eprintln!("SKIPPED: no nats-server executable installed");
        return;
    };
    let shared = pid_listening_on(NATS_PORT);
    let pid = pid_listening_on(own.port).expect("our server's pid");
    let before = cmdline(pid);

    let stopped = NatsStopped::try_stop_port(own.port).expect("stop our server");
    assert!(!answers(own.port), "our server is down");
    assert_eq!(
        pid_listening_on(NATS_PORT),
        shared,
        "the shared server is untouched"
    );
    drop(stopped); // starts it again and waits until it answers
    let restarted = pid_listening_on(own.port).expect("restarted");
    assert_ne!(restarted, pid, "a new process");
    assert_eq!(cmdline(restarted), before, "with the same command line");

    let frozen = NatsFrozen::try_freeze_port(own.port).expect("freeze our server");
    assert_eq!(state(restarted), 'T', "our server is stopped by SIGSTOP");
    if let Some(shared) = shared {
        assert_ne!(state(shared), 'T', "the shared server is not frozen");
    }
    drop(frozen);
    assert_ne!(state(restarted), 'T', "continued");
}
