//! Faults injected into the shared servers, for the tests and the chaos harness that
//! need them: a RabbitMQ memory alarm, a RabbitMQ `max_message_size` lower than the
//! publisher's, a RabbitMQ queue held at its maximum length with `reject-publish`, a
//! RabbitMQ node stopped or frozen with `SIGSTOP`, a NATS server frozen or stopped,
//! PostgreSQL stopped, and MariaDB stopped; and a process's wall clock skewed
//! ([`skewed_clock_env`], libfaketime), which needs no lock: it is the started
//! process's own.
//!
//! Every guard undoes its fault when dropped, also when the test panics. They must be
//! taken under [`lock`]: one lock for the whole machine (an exclusive `flock` on a file
//! in the temporary directory, which also excludes the other tests of this process and
//! `cargo xtask chaos`), so two faults never overlap and a fault test never disturbs
//! another one.
//!
//! Each guard has a `try_*` constructor that says why the fault cannot be injected on
//! this machine ([`FaultUnavailable`]) instead of panicking, for callers that report
//! such faults and go on (the chaos harness).
//!
//! Where the local servers are not installed but Docker Compose runs them (the
//! project's `compose.yaml`), the same faults go through `docker compose`.

use std::process::Command;
use std::time::{Duration, Instant};

/// Held while a test injects faults into shared servers.
#[derive(Debug)]
pub struct FaultLock {
    _file: std::fs::File,
}

/// The path of the machine-wide fault lock file.
pub fn lock_path() -> std::path::PathBuf {
    std::env::temp_dir().join("outbox-shared-server-faults.lock")
}

/// Takes the machine-wide fault lock, waiting for whoever holds it.
///
/// # Panics
/// When the lock file cannot be opened or locked.
pub async fn lock() -> FaultLock {
    take_lock(false).await
}

/// Takes the machine-wide fault lock shared, waiting while a fault injector holds it:
/// for a test that injects no fault into a shared server (at most into destinations of
/// its own) but measures what would be disturbed by one. Any number of such tests hold
/// it at once; [`lock`] waits until none does.
///
/// # Panics
/// When the lock file cannot be opened or locked.
pub async fn lock_shared() -> FaultLock {
    take_lock(true).await
}

async fn take_lock(shared: bool) -> FaultLock {
    let path = lock_path();
    tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        let locked = if shared {
            file.lock_shared()
        } else {
            file.lock()
        };
        locked.unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
        FaultLock { _file: file }
    })
    .await
    .expect("lock task")
}

/// A fault that cannot be injected on this machine, and why (a tool missing, no
/// permission, a service not under this machine's control).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultUnavailable {
    /// The fault, e.g. `"RabbitMQ memory alarm"`.
    pub fault: &'static str,
    /// Why it cannot be injected.
    pub reason: String,
}

impl FaultUnavailable {
    fn new(fault: &'static str, reason: impl Into<String>) -> Self {
        Self {
            fault,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for FaultUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.fault, self.reason)
    }
}

impl std::error::Error for FaultUnavailable {}

/// libfaketime's preload library (Debian's `faketime`, which `cargo xtask services`
/// installs), if installed.
pub fn libfaketime() -> Option<&'static str> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/lib64/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
}

/// The environment that starts a process with its wall clock `offset` off the
/// machine's (libfaketime's relative offset syntax: `"-1"` one second behind, `"+1.5"`
/// one and a half ahead), its monotonic clock left alone
/// (`FAKETIME_DONT_FAKE_MONOTONIC=1`: timers and timeouts run true). The skew of a
/// relay host against the database host, without a second host.
///
/// # Errors
/// [`FaultUnavailable`] when libfaketime is not installed.
pub fn skewed_clock_env(offset: &str) -> Result<[(&'static str, String); 3], FaultUnavailable> {
    let lib = libfaketime().ok_or_else(|| {
        FaultUnavailable::new(
            "clock skew",
            "libfaketime is not installed (`cargo xtask services`, or apt-get install faketime)",
        )
    })?;
    Ok([
        ("LD_PRELOAD", lib.to_owned()),
        ("FAKETIME", offset.to_owned()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ])
}

fn succeeds(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(cmd).args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Runs `cmd ARGS`; on failure says why (not found, or the exit status and stderr).
fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    match Command::new(cmd).args(args).output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned()),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let err = err.trim();
            let err = err.lines().last().unwrap_or_default();
            Err(format!(
                "`{cmd} {}` failed ({}): {err}",
                args.join(" "),
                o.status
            ))
        }
        Err(e) => Err(format!("cannot run `{cmd}`: {e}")),
    }
}

fn docker_engine() -> bool {
    succeeds("docker", &["info"])
}

fn local_rabbitmqctl() -> bool {
    succeeds("rabbitmqctl", &["-q", "status"])
}

/// Runs `rabbitmqctl ARGS` on the local node, or in the compose service.
fn rabbitmqctl(args: &[&str]) -> Option<String> {
    rabbitmqctl_result(args).ok()
}

fn rabbitmqctl_result(args: &[&str]) -> Result<String, String> {
    if local_rabbitmqctl() {
        run("rabbitmqctl", args)
    } else if docker_engine() {
        let mut all = vec!["compose", "exec", "-T", "rabbitmq", "rabbitmqctl"];
        all.extend_from_slice(args);
        run("docker", &all)
    } else {
        Err("no local `rabbitmqctl` reaches the node and no Docker engine runs".to_owned())
    }
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn port_answers(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

/// The port of the shared NATS server (`nats://127.0.0.1:4222`).
pub const NATS_PORT: u16 = 4222;

/// The AMQP port of the shared RabbitMQ node (`amqp://127.0.0.1:5672`).
pub const AMQP_PORT: u16 = 5672;

/// The PID of the local process listening on TCP `port` (any address, IPv4 or IPv6),
/// read from `/proc/net/tcp`, `/proc/net/tcp6` and the processes' open sockets. Faults
/// target a server by its port, never by its executable's name: with a cluster's nodes
/// running beside the shared server, `pgrep -x nats-server` would find several, and
/// the first one is not necessarily the server meant.
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    // sl local_address rem_address st ... uid timeout inode
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let local_port = fields.get(1)?.rsplit(':').next()?;
                    let listening = fields.get(3)? == &"0A";
                    (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                        .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                        .flatten()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    if inodes.is_empty() {
        return None;
    }
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|target| {
                    inodes
                        .iter()
                        .any(|inode| target.as_os_str() == inode.as_str())
                })
        })
}

/// The command line of process `pid` (executable first) and its working directory.
fn command_line(pid: u32) -> Option<(Vec<String>, std::path::PathBuf)> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|part| !part.is_empty())
        .map(|part| String::from_utf8_lossy(part).into_owned())
        .collect();
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?;
    (!cmdline.is_empty()).then_some((cmdline, cwd))
}

/// The state letter of process `pid` (the field after its name in `/proc/PID/stat`:
/// `R` running, `S` sleeping, `T` stopped by a signal, as a frozen server is, `Z`
/// zombie, ...), `None` when there is no such process.
pub fn process_state(pid: impl std::fmt::Display) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.get(stat.rfind(')')? + 2..)?.chars().next()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists() && process_state(pid) != Some('Z')
}

/// Stops process `pid` with `SIGTERM`, then `SIGKILL` after `grace`, and waits until it
/// is gone.
fn terminate(pid: u32, grace: Duration) -> Result<(), String> {
    let pid_text = pid.to_string();
    run("kill", &["-TERM", &pid_text])?;
    let deadline = Instant::now() + grace;
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if alive(pid) {
        let _ = run("kill", &["-KILL", &pid_text]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    if alive(pid) {
        Err(format!("process {pid} is still running after SIGKILL"))
    } else {
        Ok(())
    }
}

/// A local server stopped by [`stop_listener`]: how to start it again, and where it
/// logs.
#[derive(Debug)]
struct Stopped {
    /// The executable and its arguments (behind a `nice` prefix restoring its nice
    /// value), read from `/proc/PID` before stopping.
    cmdline: Vec<String>,
    /// Its working directory.
    cwd: std::path::PathBuf,
    /// Its log file, if it writes one ([`log_of`]).
    log: Option<std::path::PathBuf>,
}

impl Stopped {
    /// Starts it again ([`start_detached`]) and waits until `port` answers, up to
    /// `limit` ([`wait_until_back`]).
    fn start(&self, server: &str, port: u16, limit: Duration) {
        let ok = start_detached(&self.cmdline, &self.cwd);
        let started = self.cmdline.join(" ");
        assert!(
            ok || std::thread::panicking(),
            "failed to start {server} again: `setsid -f {started}` failed"
        );
        wait_until_back(server, &started, self.log.as_deref(), limit, || {
            port_answers(port)
        });
    }
}

/// Stops the local process listening on TCP `port` (`SIGTERM`, `SIGKILL` after
/// `grace`); returns what starts it again.
fn stop_listener(
    fault: &'static str,
    port: u16,
    grace: Duration,
) -> Result<Stopped, FaultUnavailable> {
    let pid = pid_listening_on(port).ok_or_else(|| {
        FaultUnavailable::new(fault, format!("no local process listens on port {port}"))
    })?;
    let (cmdline, cwd) = command_line(pid).ok_or_else(|| {
        FaultUnavailable::new(fault, format!("cannot read the command line of {pid}"))
    })?;
    let cmdline = [as_nice_as(pid), cmdline].concat();
    let log = log_of(pid);
    terminate(pid, grace).map_err(|e| FaultUnavailable::new(fault, e))?;
    Ok(Stopped { cmdline, cwd, log })
}

/// The nice value of process `pid` (field 19 of `/proc/PID/stat`).
fn niceness(pid: u32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.get(stat.rfind(')')? + 2..)?;
    after_name.split_whitespace().nth(16)?.parse().ok()
}

/// `nice -n ADJUSTMENT`, the prefix of a command this process runs so that it gets
/// the nice value process `pid` has (none when they are equal or unknown). A server
/// stopped and started again by a test or harness running under `nice -n 19` must not
/// come back at 19: it must be as the fault found it.
fn as_nice_as(pid: u32) -> Vec<String> {
    match (niceness(pid), niceness(std::process::id())) {
        (Some(theirs), Some(ours)) if theirs != ours => {
            vec![
                "nice".to_owned(),
                "-n".to_owned(),
                (theirs - ours).to_string(),
            ]
        }
        _ => Vec::new(),
    }
}

/// `PATH` for a server started where the caller has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A command that starts a shared server (or a script that does): the caller's
/// environment cleared but for `PATH` and `HOME`. A server started with the caller's
/// environment keeps what a test runner set for itself: a `TMPDIR` the server's user
/// cannot write (MariaDB, dropping to the `mysql` user, then never comes back: "Can't
/// create/write to file ... InnoDB: Unable to create temporary file"), a `RUST_LOG`, a
/// proxy. The server reads the rest from its own configuration, as at boot.
pub(crate) fn server_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear().env(
        "PATH",
        std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
    );
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    cmd
}

/// The log file process `pid` writes: its standard error when that is a file (MariaDB
/// points it at its `log_error`, `pg_ctl` at the cluster's log), else the first open
/// file whose name ends in `.log` (NATS's `-l`). Read before a server is stopped, to
/// say why it did not come back.
fn log_of(pid: u32) -> Option<std::path::PathBuf> {
    let target = |fd: &std::path::Path| std::fs::read_link(fd).ok().filter(|t| t.is_file());
    target(std::path::Path::new(&format!("/proc/{pid}/fd/2"))).or_else(|| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .ok()?
            .flatten()
            .filter_map(|fd| target(&fd.path()))
            .find(|t| t.extension().is_some_and(|e| e == "log"))
    })
}

/// Waits until `back` holds for the server `server` (re)started with `started`; past
/// `limit`, says so, with the last lines of its `log` when readable: panics, or prints
/// when the thread already panics (a guard dropped by a failing test).
fn wait_until_back(
    server: &str,
    started: &str,
    log: Option<&std::path::Path>,
    limit: Duration,
    mut back: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + limit;
    while !back() {
        if Instant::now() >= deadline {
            let mut msg = format!(
                "{server} did not come back within {} s of `{started}`: every later test that needs it fails until it is started again (`cargo xtask services`)",
                limit.as_secs()
            );
            match log.map(|path| (path, std::fs::read_to_string(path))) {
                Some((path, Ok(text))) => {
                    let lines: Vec<&str> = text.lines().collect();
                    let last = lines[lines.len().saturating_sub(20)..].join("\n");
                    msg.push_str(&format!("; the last lines of {}:\n{last}", path.display()));
                }
                Some((path, Err(e))) => {
                    msg.push_str(&format!(
                        "; its log {} is not readable: {e}",
                        path.display()
                    ));
                }
                None => msg.push_str("; where it logs is not known"),
            }
            if std::thread::panicking() {
                eprintln!("{msg}");
                return;
            }
            panic!("{msg}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Starts `cmdline` in `cwd` in a session of its own (`setsid -f`), detached from the
/// caller (it outlives the test that restarted it, as the server it replaces did), with
/// a clean environment ([`server_command`]).
fn start_detached(cmdline: &[String], cwd: &std::path::Path) -> bool {
    server_command("setsid")
        .arg("-f")
        .args(cmdline)
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Whether RabbitMQ reports a memory alarm (`None` when `rabbitmqctl` cannot tell).
pub fn rabbit_memory_alarm_active() -> Option<bool> {
    rabbitmqctl(&["-q", "eval", "rabbit_alarm:get_alarms()."])
        .map(|alarms| alarms.contains("memory"))
}

fn memory_alarm_active() -> bool {
    rabbit_memory_alarm_active().unwrap_or(false)
}

/// RabbitMQ's memory high watermark as the node reports it (e.g. `0.4`), or `None`
/// when `rabbitmqctl` cannot tell.
pub fn rabbit_memory_watermark() -> Option<String> {
    rabbitmqctl(&[
        "-q",
        "eval",
        "vm_memory_monitor:get_vm_memory_high_watermark().",
    ])
    .filter(|v| v.parse::<f64>().is_ok())
}

/// RabbitMQ's `max_message_size` in bytes, or `None` when `rabbitmqctl` cannot tell.
pub fn rabbit_max_message_size() -> Option<u64> {
    rabbitmqctl(&[
        "-q",
        "eval",
        "{ok, N} = application:get_env(rabbit, max_message_size), N.",
    ])
    .and_then(|v| v.parse().ok())
}

/// A RabbitMQ memory alarm: the high watermark set to 0.0001 of the machine's memory,
/// so the broker blocks every publishing connection (`connection.blocked`). Dropping
/// it restores the previous watermark and waits until the alarm is cleared.
#[derive(Debug)]
pub struct RabbitMemoryAlarm {
    previous: String,
}

impl RabbitMemoryAlarm {
    /// Raises the alarm and waits until the broker reports it.
    ///
    /// # Panics
    /// When `rabbitmqctl` does not work or the alarm does not come.
    pub fn raise() -> Self {
        Self::try_raise().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Raises the alarm and waits (up to 30 s) until the broker reports it.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when `rabbitmqctl` cannot reach the node or the alarm does
    /// not come (the watermark is restored first).
    pub fn try_raise() -> Result<Self, FaultUnavailable> {
        const FAULT: &str = "RabbitMQ memory alarm";
        let previous = rabbit_memory_watermark().unwrap_or_else(|| "0.4".to_owned());
        rabbitmqctl_result(&["-q", "set_vm_memory_high_watermark", "0.0001"])
            .map_err(|e| FaultUnavailable::new(FAULT, e))?;
        let alarm = Self { previous };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !memory_alarm_active() {
            if Instant::now() > deadline {
                return Err(FaultUnavailable::new(
                    FAULT,
                    "the watermark was lowered but no alarm came within 30 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(alarm)
    }

    /// The watermark restored on drop.
    pub fn previous_watermark(&self) -> &str {
        &self.previous
    }

    fn clear(&self) {
        let _ = rabbitmqctl(&["-q", "set_vm_memory_high_watermark", &self.previous]);
        wait_for(
            "the memory alarm is cleared",
            Duration::from_secs(30),
            || !memory_alarm_active(),
        );
    }
}

impl Drop for RabbitMemoryAlarm {
    fn drop(&mut self) {
        self.clear();
    }
}

/// RabbitMQ's `max_message_size` set to `bytes` on the running node (channels opened
/// afterwards enforce it: a larger publish closes its channel with `406
/// PRECONDITION_FAILED`). It survives `stop_app`/`start_app`. Dropping it restores the
/// previous value.
#[derive(Debug)]
pub struct RabbitMaxMessageSize {
    previous: String,
}

impl RabbitMaxMessageSize {
    /// Sets the limit.
    ///
    /// # Panics
    /// When `rabbitmqctl` does not work.
    pub fn set(bytes: usize) -> Self {
        Self::try_set(bytes).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sets the limit.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when `rabbitmqctl` cannot reach the node.
    pub fn try_set(bytes: usize) -> Result<Self, FaultUnavailable> {
        let previous =
            rabbit_max_message_size().map_or_else(|| "134217728".to_owned(), |n| n.to_string());
        let set = format!("application:set_env(rabbit, max_message_size, {bytes}).");
        rabbitmqctl_result(&["-q", "eval", &set])
            .map_err(|e| FaultUnavailable::new("RabbitMQ max_message_size", e))?;
        Ok(Self { previous })
    }
}

impl Drop for RabbitMaxMessageSize {
    fn drop(&mut self) {
        let restore = format!(
            "application:set_env(rabbit, max_message_size, {}).",
            self.previous
        );
        let _ = rabbitmqctl(&["-q", "eval", &restore]);
    }
}

/// The policy name [`RabbitQueueFull`] sets (and clears).
pub const QUEUE_FULL_POLICY: &str = "outbox-fault-queue-full";

/// One RabbitMQ queue held at its maximum length: a policy
/// ([`QUEUE_FULL_POLICY`]) with `max-length` 0 and `overflow` `reject-publish`. A
/// classic queue then drops what it holds and refuses (`basic.nack`) every publish
/// routed to it; a quorum queue keeps what it holds and refuses publishes only while
/// it holds a message beyond the limit, so a quorum queue whose consumers keep it empty
/// refuses almost nothing (on RabbitMQ 3.10: the first publish to an empty queue is
/// accepted, the next ones refused). Dropping it clears the policy.
#[derive(Debug)]
pub struct RabbitQueueFull {
    _private: (),
}

impl RabbitQueueFull {
    /// Applies the policy to the queue named `queue` (exactly) in the default vhost.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when `rabbitmqctl` cannot reach the node.
    pub fn try_set(queue: &str) -> Result<Self, FaultUnavailable> {
        let pattern = format!("^{}$", regex_escape(queue));
        rabbitmqctl_result(&[
            "-q",
            "set_policy",
            "--apply-to",
            "queues",
            "--priority",
            "100",
            QUEUE_FULL_POLICY,
            &pattern,
            r#"{"max-length":0,"overflow":"reject-publish"}"#,
        ])
        .map_err(|e| FaultUnavailable::new("RabbitMQ queue full", e))?;
        Ok(Self { _private: () })
    }

    /// Clears the policy left by an interrupted run, if any.
    pub fn clear_leftover() {
        let _ = rabbitmqctl(&["-q", "clear_policy", QUEUE_FULL_POLICY]);
    }
}

impl Drop for RabbitQueueFull {
    fn drop(&mut self) {
        let _ = rabbitmqctl(&["-q", "clear_policy", QUEUE_FULL_POLICY]);
    }
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The RabbitMQ node's application stopped (`rabbitmqctl stop_app`, or the compose
/// service stopped): every connection is refused. Dropping it starts it again and
/// waits until it answers.
#[derive(Debug)]
pub struct RabbitStopped {
    docker: bool,
}

impl RabbitStopped {
    /// Stops the broker.
    ///
    /// # Panics
    /// When neither `rabbitmqctl stop_app` nor `docker compose stop rabbitmq` works.
    pub fn stop() -> Self {
        Self::try_stop().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Stops the broker.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when neither `rabbitmqctl stop_app` nor `docker compose
    /// stop rabbitmq` works.
    pub fn try_stop() -> Result<Self, FaultUnavailable> {
        let local = run("rabbitmqctl", &["-q", "stop_app"]);
        if local.is_ok() {
            return Ok(Self { docker: false });
        }
        if docker_engine() && succeeds("docker", &["compose", "stop", "rabbitmq"]) {
            return Ok(Self { docker: true });
        }
        Err(FaultUnavailable::new(
            "RabbitMQ restart",
            format!(
                "{}; and no Docker engine runs the compose service",
                local.err().unwrap_or_default()
            ),
        ))
    }

    /// Starts the broker again now (dropping the guard does it too).
    ///
    /// # Panics
    /// When the broker does not start.
    pub fn end(self) {
        // Drop does the work.
    }

    /// Starts the application again (the node's process kept running, with its own
    /// environment: `rabbitmqctl` only asks it to).
    fn start(&self) {
        let (ok, started) = if self.docker {
            (
                succeeds("docker", &["compose", "start", "rabbitmq"]),
                "docker compose start rabbitmq",
            )
        } else {
            (
                succeeds("rabbitmqctl", &["-q", "start_app"]),
                "rabbitmqctl -q start_app",
            )
        };
        assert!(ok, "failed to restart RabbitMQ: `{started}` failed");
        wait_until_back("RabbitMQ", started, None, Duration::from_secs(60), || {
            port_answers(5672)
        });
    }
}

impl Drop for RabbitStopped {
    fn drop(&mut self) {
        self.start();
    }
}

/// A server process frozen with `SIGSTOP` (or its compose service paused): it keeps
/// its connections open but answers nothing, as a server stalled by a long GC pause, a
/// full disk or an overloaded host does. Dropping it sends `SIGCONT` (or unpauses).
#[derive(Debug)]
struct Frozen {
    how: Freeze,
}

#[derive(Debug)]
enum Freeze {
    Pid(String),
    Docker(&'static str),
}

impl Frozen {
    /// Freezes the local process listening on `port`, else the compose `service` (only
    /// for the shared server's port: cluster nodes are always local).
    fn try_freeze(
        fault: &'static str,
        port: u16,
        service: Option<&'static str>,
    ) -> Result<Self, FaultUnavailable> {
        if let Some(pid) = pid_listening_on(port) {
            let pid = pid.to_string();
            run("kill", &["-STOP", &pid]).map_err(|e| FaultUnavailable::new(fault, e))?;
            let frozen = Self {
                how: Freeze::Pid(pid),
            };
            // `kill` returns once the signal is queued; each thread stops when it next
            // enters the kernel, so a busy server may run on for a moment. Frozen means
            // stopped: wait for it, and continue the process if it does not stop.
            if let Err(e) = frozen.wait_until_stopped() {
                frozen.thaw();
                return Err(FaultUnavailable::new(fault, e));
            }
            return Ok(frozen);
        }
        if let Some(service) = service
            && docker_engine()
            && succeeds("docker", &["compose", "pause", service])
        {
            return Ok(Self {
                how: Freeze::Docker(service),
            });
        }
        Err(FaultUnavailable::new(
            fault,
            format!(
                "no local process listens on port {port}{}",
                service.map_or_else(String::new, |service| format!(
                    ", and `docker compose pause {service}` failed"
                ))
            ),
        ))
    }

    /// Waits up to 10 seconds until the frozen process is in state `T` (stopped).
    fn wait_until_stopped(&self) -> Result<(), String> {
        let Freeze::Pid(pid) = &self.how else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match process_state(pid) {
                Some('T') => return Ok(()),
                None => return Err(format!("process {pid} is gone")),
                Some(state) if Instant::now() >= deadline => {
                    return Err(format!(
                        "process {pid} is still in state {state} 10 s after SIGSTOP"
                    ));
                }
                Some(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    fn thaw(&self) -> bool {
        match &self.how {
            Freeze::Pid(pid) => succeeds("kill", &["-CONT", pid]),
            Freeze::Docker(service) => succeeds("docker", &["compose", "unpause", service]),
        }
    }
}

/// Sends `SIGCONT` to every local process named `process` that is stopped (state `T`):
/// undoes a freeze left by a run that was killed with `SIGKILL` before its guards ran
/// (by name on purpose: whichever node such a run froze, none should stay frozen).
/// Returns how many it continued.
pub fn continue_stopped(process: &str) -> usize {
    let Some(pids) = output("pgrep", &["-x", process]) else {
        return 0;
    };
    pids.lines()
        .filter(|pid| process_state(pid) == Some('T'))
        .filter(|pid| succeeds("kill", &["-CONT", pid]))
        .count()
}

/// The NATS server frozen with `SIGSTOP` (or `docker compose pause nats`): it keeps
/// its connections open but answers nothing, as a server stalled by a long GC pause,
/// a full disk or an overloaded host does. Dropping it sends `SIGCONT`.
#[derive(Debug)]
pub struct NatsFrozen {
    frozen: Frozen,
}

impl NatsFrozen {
    /// Freezes the server.
    ///
    /// # Panics
    /// When no local process listens on [`NATS_PORT`] and `docker compose pause nats`
    /// fails.
    pub fn freeze() -> Self {
        Self::try_freeze().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Freezes the shared server (the process listening on [`NATS_PORT`]).
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on [`NATS_PORT`] and `docker
    /// compose pause nats` fails.
    pub fn try_freeze() -> Result<Self, FaultUnavailable> {
        Frozen::try_freeze("NATS freeze", NATS_PORT, Some("nats")).map(|frozen| Self { frozen })
    }

    /// Freezes the NATS server listening for clients on `port` (a cluster node of
    /// `cargo xtask services --cluster`, say), and no other.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on `port`.
    pub fn try_freeze_port(port: u16) -> Result<Self, FaultUnavailable> {
        Frozen::try_freeze("NATS freeze", port, None).map(|frozen| Self { frozen })
    }

    /// Continues the server now (dropping the guard does it too).
    pub fn thaw(self) {}
}

impl Drop for NatsFrozen {
    fn drop(&mut self) {
        let ok = self.frozen.thaw();
        assert!(
            ok || std::thread::panicking(),
            "failed to continue the NATS server"
        );
    }
}

/// The RabbitMQ node frozen with `SIGSTOP` on its Erlang VM (`beam.smp`), or `docker
/// compose pause rabbitmq`: connections stay open, nothing is answered (no confirms, no
/// deliveries, no heartbeats). Dropping it sends `SIGCONT`. `rabbitmqctl` hangs while
/// the node is frozen: take no other RabbitMQ fault meanwhile.
#[derive(Debug)]
pub struct RabbitFrozen {
    frozen: Frozen,
}

impl RabbitFrozen {
    /// Freezes the shared node (the process listening on [`AMQP_PORT`]).
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on [`AMQP_PORT`] and `docker
    /// compose pause rabbitmq` fails.
    pub fn try_freeze() -> Result<Self, FaultUnavailable> {
        Frozen::try_freeze("RabbitMQ freeze", AMQP_PORT, Some("rabbitmq"))
            .map(|frozen| Self { frozen })
    }

    /// Freezes the RabbitMQ node (its Erlang VM) listening for AMQP on `port` (a
    /// cluster node of `cargo xtask services --cluster`, say), and no other.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on `port`.
    pub fn try_freeze_port(port: u16) -> Result<Self, FaultUnavailable> {
        Frozen::try_freeze("RabbitMQ freeze", port, None).map(|frozen| Self { frozen })
    }
}

impl Drop for RabbitFrozen {
    fn drop(&mut self) {
        let ok = self.frozen.thaw();
        assert!(
            ok || std::thread::panicking(),
            "failed to continue the RabbitMQ node"
        );
    }
}

/// A NATS server stopped (`SIGTERM` to the process listening on its client port, or
/// `docker compose stop nats`): every connection is closed and refused. Dropping it
/// starts the server again with the command line and working directory it had (so its
/// JetStream store directory, cluster routes and flags are the same) and waits until it
/// answers. A file-storage stream survives; a memory one does not. Only that server is
/// touched: other `nats-server` processes (a cluster's nodes) keep running.
#[derive(Debug)]
pub struct NatsStopped {
    how: NatsStart,
    port: u16,
}

#[derive(Debug)]
enum NatsStart {
    Local(Stopped),
    Docker,
}

impl NatsStopped {
    /// Stops the shared server (the one listening on [`NATS_PORT`]).
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on [`NATS_PORT`] (or its
    /// command line cannot be read, or it does not stop) and `docker compose stop nats`
    /// fails.
    pub fn try_stop() -> Result<Self, FaultUnavailable> {
        match Self::try_stop_port(NATS_PORT) {
            Ok(stopped) => Ok(stopped),
            Err(local) => {
                if docker_engine() && succeeds("docker", &["compose", "stop", "nats"]) {
                    Ok(Self {
                        how: NatsStart::Docker,
                        port: NATS_PORT,
                    })
                } else {
                    Err(FaultUnavailable::new(
                        local.fault,
                        format!("{}, and `docker compose stop nats` failed", local.reason),
                    ))
                }
            }
        }
    }

    /// Stops the local NATS server listening for clients on `port`, and no other.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on `port`, its command line
    /// cannot be read, or it does not stop.
    pub fn try_stop_port(port: u16) -> Result<Self, FaultUnavailable> {
        let stopped = stop_listener("NATS restart", port, Duration::from_secs(10))?;
        Ok(Self {
            how: NatsStart::Local(stopped),
            port,
        })
    }
}

impl Drop for NatsStopped {
    fn drop(&mut self) {
        let port = self.port;
        match &self.how {
            NatsStart::Local(stopped) => stopped.start("NATS", port, Duration::from_secs(60)),
            NatsStart::Docker => {
                let ok = succeeds("docker", &["compose", "start", "nats"]);
                assert!(ok || std::thread::panicking(), "failed to start NATS again");
                wait_until_back(
                    "NATS",
                    "docker compose start nats",
                    None,
                    Duration::from_secs(60),
                    || port_answers(port),
                );
            }
        }
    }
}

/// PostgreSQL stopped (`pg_ctlcluster --skip-systemctl-redirect VERSION main stop -m
/// fast`, or `docker compose stop postgres`): every session is terminated and new ones
/// are refused. Dropping it starts the server again and waits until it accepts
/// connections. Stop, wait, drop: a restart with a downtime of the caller's choosing.
#[derive(Debug)]
pub struct PgStopped {
    how: PgStart,
}

#[derive(Debug)]
enum PgStart {
    /// The cluster's version, the `nice` prefix that restores the server's nice value
    /// (see [`as_nice_as`]), and its log file ([`log_of`]).
    Local(String, Vec<String>, Option<std::path::PathBuf>),
    Docker,
}

impl PgStopped {
    /// Stops the server (fast shutdown: sessions are terminated, transactions rolled
    /// back).
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local cluster can be stopped (`pg_ctlcluster`
    /// missing, no cluster in `/etc/postgresql`, no permission) and `docker compose stop
    /// postgres` fails.
    pub fn try_stop() -> Result<Self, FaultUnavailable> {
        const FAULT: &str = "PostgreSQL restart";
        let pid = pid_listening_on(5432);
        let nice = pid.map(as_nice_as).unwrap_or_default();
        let log = pid.and_then(log_of);
        let local = postgres_version().and_then(|version| {
            run(
                "pg_ctlcluster",
                &[
                    "--skip-systemctl-redirect",
                    &version,
                    "main",
                    "stop",
                    "-m",
                    "fast",
                ],
            )
            .map(|_| version)
        });
        match local {
            Ok(version) => Ok(Self {
                how: PgStart::Local(version, nice, log),
            }),
            Err(why) => {
                if docker_engine() && succeeds("docker", &["compose", "stop", "postgres"]) {
                    Ok(Self {
                        how: PgStart::Docker,
                    })
                } else {
                    Err(FaultUnavailable::new(
                        FAULT,
                        format!("{why}; and no Docker engine runs the compose service"),
                    ))
                }
            }
        }
    }
}

/// The highest-numbered PostgreSQL cluster version configured in `/etc/postgresql`.
fn postgres_version() -> Result<String, String> {
    let dir = "/etc/postgresql";
    let mut versions: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {dir}: {e}"))?
        .flatten()
        .filter(|e| e.path().join("main").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    versions.sort_by_key(|v| {
        v.split('.')
            .map(|part| part.parse::<u32>().unwrap_or(0))
            .collect::<Vec<_>>()
    });
    versions
        .pop()
        .ok_or_else(|| format!("no PostgreSQL cluster `main` configured in {dir}"))
}

impl Drop for PgStopped {
    fn drop(&mut self) {
        let (ok, started, log) = match &self.how {
            PgStart::Local(version, nice, log) => {
                let start = [
                    "pg_ctlcluster",
                    "--skip-systemctl-redirect",
                    version,
                    "main",
                    "start",
                ];
                let mut command: Vec<&str> = nice.iter().map(String::as_str).collect();
                command.extend(start);
                let ok = server_command(command[0])
                    .args(&command[1..])
                    .output()
                    .is_ok_and(|o| o.status.success());
                (ok, command.join(" "), log.as_deref())
            }
            PgStart::Docker => (
                succeeds("docker", &["compose", "start", "postgres"]),
                "docker compose start postgres".to_owned(),
                None,
            ),
        };
        assert!(
            ok || std::thread::panicking(),
            "failed to start PostgreSQL again: `{started}` failed"
        );
        wait_until_back("PostgreSQL", &started, log, Duration::from_secs(60), || {
            port_answers(5432)
                && Command::new("pg_isready")
                    .args(["-q", "-h", "127.0.0.1", "-p", "5432", "-t", "2"])
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(true)
        });
    }
}

/// The port of the shared MariaDB (or MySQL) server (`mysql://127.0.0.1:3306`).
pub const MYSQL_PORT: u16 = 3306;

/// The MariaDB (or MySQL) server listening on [`MYSQL_PORT`] stopped (`SIGTERM`: a
/// normal shutdown, every session is ended, open transactions are rolled back; `SIGKILL`
/// after 60 s), or `docker compose stop mariadb`; new connections are refused. Dropping
/// it starts the server again with the command line and working directory it had (the
/// server reads its configuration files again, `user = mysql` among them: Debian's
/// `mariadbd` started by root drops to that user) and waits until it answers. Stop,
/// wait, drop: a restart with a downtime of the caller's choosing. No `systemd` or init
/// script is needed: the server is found by its port, as [`NatsStopped`] finds NATS.
#[derive(Debug)]
pub struct MariaDbStopped {
    how: MariaDbStart,
}

#[derive(Debug)]
enum MariaDbStart {
    Local(Stopped),
    Docker,
}

impl MariaDbStopped {
    /// Stops the shared server.
    ///
    /// # Errors
    /// [`FaultUnavailable`] when no local process listens on [`MYSQL_PORT`] (or its
    /// command line cannot be read, or it does not stop) and `docker compose stop
    /// mariadb` fails.
    pub fn try_stop() -> Result<Self, FaultUnavailable> {
        match stop_listener("MariaDB restart", MYSQL_PORT, Duration::from_secs(60)) {
            Ok(stopped) => Ok(Self {
                how: MariaDbStart::Local(stopped),
            }),
            Err(local) => {
                if docker_engine() && succeeds("docker", &["compose", "stop", "mariadb"]) {
                    Ok(Self {
                        how: MariaDbStart::Docker,
                    })
                } else {
                    Err(FaultUnavailable::new(
                        local.fault,
                        format!("{}, and `docker compose stop mariadb` failed", local.reason),
                    ))
                }
            }
        }
    }
}

impl Drop for MariaDbStopped {
    fn drop(&mut self) {
        // InnoDB's crash recovery is not needed after a normal shutdown: it answers in
        // seconds; the deadline is generous for a loaded machine.
        let limit = Duration::from_secs(120);
        match &self.how {
            MariaDbStart::Local(stopped) => stopped.start("MariaDB", MYSQL_PORT, limit),
            MariaDbStart::Docker => {
                let ok = succeeds("docker", &["compose", "start", "mariadb"]);
                assert!(
                    ok || std::thread::panicking(),
                    "failed to start MariaDB again"
                );
                wait_until_back(
                    "MariaDB",
                    "docker compose start mariadb",
                    None,
                    limit,
                    || port_answers(MYSQL_PORT),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        as_nice_as, log_of, niceness, pid_listening_on, regex_escape, server_command,
        wait_until_back,
    };

    /// A server that does not come back within its deadline is named, with what
    /// started it and the last lines of its log.
    #[test]
    fn a_server_that_does_not_come_back_says_why() {
        let dir = std::env::temp_dir().join(format!("outbox-faults-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let log = dir.join("server.log");
        let lines: String = (1..=30).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, lines + "InnoDB: Unable to create temporary file\n").expect("log");
        let said = std::panic::catch_unwind(|| {
            wait_until_back(
                "MariaDB",
                "setsid -f /usr/sbin/mariadbd",
                Some(&log),
                std::time::Duration::ZERO,
                || false,
            );
        })
        .expect_err("it panics");
        let said = said.downcast_ref::<String>().expect("a message");
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(
            said.starts_with(
                "MariaDB did not come back within 0 s of `setsid -f /usr/sbin/mariadbd`"
            ),
            "{said}"
        );
        assert!(said.contains("Unable to create temporary file"), "{said}");
        assert!(
            said.contains("line 12") && !said.contains("line 11\n"),
            "the last 20 lines: {said}"
        );
    }

    /// A server's log is the file its standard error points at.
    #[test]
    fn a_servers_log_is_found_by_its_standard_error() {
        let dir = std::env::temp_dir().join(format!("outbox-log-of-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let log = dir.join("server.log");
        let file = std::fs::File::create(&log).expect("log");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stderr(file)
            .spawn()
            .expect("sleep");
        let found = log_of(child.id());
        let _ = child.kill();
        let _ = child.wait();
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert_eq!(found, Some(log));
    }

    /// A server is started with `PATH` and `HOME` only, whatever the caller's
    /// environment holds (cargo's `CARGO_*` variables, a `TMPDIR`, ...).
    #[test]
    fn servers_start_with_a_clean_environment() {
        assert!(
            std::env::vars_os().any(|(k, _)| k != "PATH" && k != "HOME"),
            "the test's own environment has more"
        );
        let out = server_command("env").output().expect("env");
        assert!(out.status.success());
        let keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_owned()))
            .collect();
        assert!(keys.iter().any(|k| k == "PATH"), "{keys:?}");
        assert!(keys.iter().all(|k| k == "PATH" || k == "HOME"), "{keys:?}");
    }

    /// A server restarted by a process under `nice` gets the nice value it had: the
    /// prefix is empty for a process as nice as this one.
    #[test]
    fn the_nice_value_is_read_and_restored() {
        let ours = niceness(std::process::id()).expect("our nice value");
        assert!((-20..=19).contains(&ours));
        assert!(as_nice_as(std::process::id()).is_empty());
    }

    /// The server on a port is found by the port: here a listener of this test
    /// process, and no process for a port nobody listens on.
    #[test]
    fn the_process_listening_on_a_port_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        assert_eq!(pid_listening_on(port), Some(std::process::id()));
        drop(listener);
        assert_eq!(pid_listening_on(port), None);
    }

    #[test]
    fn queue_names_are_escaped_for_the_policy_pattern() {
        assert_eq!(regex_escape("chaos.projection"), r"chaos\.projection");
        assert_eq!(regex_escape("a_b-c"), "a_b-c");
    }
}
