//! Service bring-up: PostgreSQL, RabbitMQ, NATS and MariaDB on their default local
//! ports.
//!
//! Each service is checked for real readiness (not just an open port). The
//! ones that are not ready are started with `docker compose` when a Docker
//! engine answers `docker info`, otherwise with the locally installed
//! servers, and then polled until ready or until the deadline passes.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{display, workspace_root};

/// Pause between two readiness polls.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Upper bound for one readiness check (connect, handshake, reply).
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The AMQP 0-9-1 protocol header a client sends first.
const AMQP_PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
/// Where the local PostgreSQL clusters are configured (one directory per version).
const POSTGRES_CONF_DIR: &str = "/etc/postgresql";

/// A service the tests and examples need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Service {
    Postgres,
    Rabbitmq,
    Nats,
    /// MariaDB (or MySQL) for `outboxkit-mysql`, as `root` without a password.
    Mariadb,
}

impl Service {
    const ALL: [Self; 4] = [Self::Postgres, Self::Rabbitmq, Self::Nats, Self::Mariadb];

    /// Name used in messages; also the service name in `compose.yaml`.
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Rabbitmq => "rabbitmq",
            Self::Nats => "nats",
            Self::Mariadb => "mariadb",
        }
    }

    fn addr(self) -> SocketAddr {
        let port = match self {
            Self::Postgres => 5432,
            Self::Rabbitmq => 5672,
            Self::Nats => 4222,
            Self::Mariadb => 3306,
        };
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// `Ok` when the service accepts clients; otherwise why not.
    fn check(self) -> Result<(), String> {
        match self {
            Self::Postgres => check_postgres(self.addr()),
            Self::Rabbitmq => check_amqp(self.addr()),
            Self::Nats => check_nats(self.addr()),
            Self::Mariadb => check_mysql(self.addr()),
        }
    }

    /// The command that starts the locally installed server, with a clean environment
    /// ([`server_command`]).
    fn local_start_command(self) -> Result<Command> {
        let mut cmd;
        match self {
            Self::Postgres => {
                let version = postgres_version()?;
                cmd = server_command("pg_ctlcluster");
                cmd.args(["--skip-systemctl-redirect", &version, "main", "start"]);
            }
            Self::Rabbitmq => {
                cmd = server_command("rabbitmq-server");
                cmd.arg("-detached");
            }
            Self::Nats => {
                cmd = server_command("start-stop-daemon");
                cmd.args([
                    "--start",
                    "--oknodo",
                    "--background",
                    "--exec",
                    "/usr/sbin/nats-server",
                    "--",
                    "-a",
                    "127.0.0.1",
                    "-p",
                    "4222",
                    "-js",
                    "-sd",
                    "/var/lib/nats-server",
                    "-l",
                    "/var/log/nats-server.log",
                ]);
            }
            Self::Mariadb => {
                // Debian's init script works without systemd (it runs mysqld_safe).
                cmd = server_command("/etc/init.d/mariadb");
                cmd.arg("start");
            }
        }
        Ok(cmd)
    }

    /// Where the locally installed server logs, as it is configured on Debian (NATS:
    /// the `-l` above; MariaDB: its `log_error`, read with `my_print_defaults`).
    fn local_log(self) -> Option<PathBuf> {
        match self {
            Self::Postgres => postgres_version().ok().map(|version| {
                PathBuf::from(format!("/var/log/postgresql/postgresql-{version}-main.log"))
            }),
            Self::Nats => Some(PathBuf::from("/var/log/nats-server.log")),
            Self::Mariadb => {
                let out = Command::new("my_print_defaults")
                    .arg("--mysqld")
                    .stdin(Stdio::null())
                    .output()
                    .ok()?;
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .find_map(|l| l.strip_prefix("--log-error=").map(PathBuf::from))
            }
            Self::Rabbitmq => None,
        }
    }
}

/// `PATH` for a server started where the caller has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A command that starts a server (or a script that does): the caller's environment
/// cleared but for `PATH` and `HOME`. A server started with the caller's environment
/// keeps what a CI system or a shell set for itself: a `TMPDIR` the server's user
/// cannot write kept MariaDB from starting ("Can't create/write to file ... InnoDB:
/// Unable to create temporary file"). The servers read the rest from their own
/// configuration, as at boot.
pub(crate) fn server_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
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

/// The last `n` lines of `path`, indented, or why they cannot be read.
fn last_lines(path: &std::path::Path, n: usize) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..]
                .iter()
                .map(|l| format!("\n      {l}"))
                .collect()
        }
        Err(e) => format!(" (not readable: {e})"),
    }
}

/// What was done to bring a service up.
struct Attempt {
    service: Service,
    /// "started with docker compose" or "started locally".
    how: &'static str,
    /// The command that was run.
    command: String,
    /// Anything odd about the start (non-zero exit, where its output went).
    note: Option<String>,
    /// The reason of the latest failed readiness check.
    last_check: String,
    /// Files that say why it did not start: the start command's output, the server's
    /// log.
    logs: Vec<PathBuf>,
}

/// Makes sure PostgreSQL, RabbitMQ and NATS are ready, starting what is not,
/// and prints one status line per service.
pub(crate) fn ensure(timeout: Duration) -> Result<()> {
    let began = Instant::now();
    let mut down = Vec::new();
    for service in Service::ALL {
        match service.check() {
            Ok(()) => println!("{}: ready (already running)", service.name()),
            Err(why) => down.push((service, why)),
        }
    }

    if !down.is_empty() {
        let attempts = if docker_engine_available() {
            start_with_compose(down)?
        } else {
            start_locally(down)?
        };
        wait_until_ready(attempts, began, began + timeout, timeout)?;
    }
    ensure_logical_wal(timeout)?;

    if std::env::var_os("MSSQL_URL").is_none() {
        println!("sqlserver: MSSQL_URL not set; SQL Server tests will be skipped");
    } else {
        println!("sqlserver: MSSQL_URL set (not checked by xtask)");
    }
    Ok(())
}

/// The WAL relay (`outbox relay --source wal`, docs/wal.md) needs `wal_level =
/// logical`. The compose service starts with it; a local server that runs with
/// another level gets `ALTER SYSTEM SET wal_level = logical` and one restart (under the
/// machine-wide fault lock of `outboxkit_testkit::faults`, so that no fault test is
/// running against it meanwhile). Without `psql` this is skipped with a note.
fn ensure_logical_wal(timeout: Duration) -> Result<()> {
    // A test of the WAL relay (crates/outbox-cli/tests/relay_wal.rs, test o) names a
    // synchronous standby that never connects, for seconds, and resets it when it ends;
    // a test process killed meanwhile would leave every commit of the server waiting.
    if psql(&["-Atc", "SHOW synchronous_standby_names"]).as_deref() == Some("outbox_test_nobody") {
        println!("postgres: synchronous_standby_names left by a killed test: reset");
        psql(&["-Atc", "ALTER SYSTEM RESET synchronous_standby_names"])
            .context("ALTER SYSTEM RESET synchronous_standby_names failed")?;
        psql(&["-Atc", "SELECT pg_reload_conf()"]).context("pg_reload_conf() failed")?;
    }
    let Some(level) = psql(&["-Atc", "SHOW wal_level"]) else {
        println!("postgres: psql not found; cannot check wal_level (the WAL relay needs logical)");
        return Ok(());
    };
    if level == "logical" {
        println!("postgres: wal_level = logical");
        return Ok(());
    }
    if docker_engine_available() && !postgres_conf_dir_exists() {
        bail!(
            "postgres: wal_level is {level:?}; recreate the compose service (`docker compose up -d --force-recreate postgres`), which starts it with wal_level=logical"
        );
    }
    println!(
        "postgres: wal_level is {level:?}; setting it to logical and restarting PostgreSQL once"
    );
    psql(&["-Atc", "ALTER SYSTEM SET wal_level = logical"])
        .context("ALTER SYSTEM SET wal_level = logical failed")?;
    let version = postgres_version()?;
    let lock_path = std::env::temp_dir().join("outbox-shared-server-faults.lock");
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("could not open {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("could not lock {}", lock_path.display()))?;
    let status = server_command("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .stdin(Stdio::null())
        .status()
        .context("could not run pg_ctlcluster")?;
    if !status.success() {
        bail!("`pg_ctlcluster {version} main restart` failed ({status})");
    }
    let began = Instant::now();
    wait_until_ready(
        vec![Attempt {
            service: Service::Postgres,
            how: "restarted with wal_level = logical",
            command: format!("pg_ctlcluster {version} main restart"),
            note: None,
            last_check: String::new(),
            logs: Service::Postgres.local_log().into_iter().collect(),
        }],
        began,
        began + timeout,
        timeout,
    )?;
    drop(lock);
    match psql(&["-Atc", "SHOW wal_level"]) {
        Some(level) if level == "logical" => Ok(()),
        other => bail!("postgres: wal_level is still {other:?} after the restart"),
    }
}

fn postgres_conf_dir_exists() -> bool {
    fs::metadata(POSTGRES_CONF_DIR).is_ok_and(|m| m.is_dir())
}

/// `psql` against the local server's `postgres` database as user `postgres`; its
/// trimmed output, or `None` when psql is missing or fails.
fn psql(args: &[&str]) -> Option<String> {
    let out = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            "5432",
            "-U",
            "postgres",
            "-d",
            "postgres",
        ])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Whether a Docker engine answers (the client alone is not enough).
fn docker_engine_available() -> bool {
    Command::new("docker")
        .arg("info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn start_with_compose(down: Vec<(Service, String)>) -> Result<Vec<Attempt>> {
    let mut cmd = Command::new("docker");
    cmd.args(["compose", "up", "-d"])
        .args(down.iter().map(|(service, _)| service.name()))
        .current_dir(workspace_root())
        .stdin(Stdio::null());
    let shown = display(&cmd);
    println!("xtask: Docker engine found, running `{shown}`");
    let status = cmd
        .status()
        .with_context(|| format!("could not run `{shown}`"))?;
    if !status.success() {
        let names: Vec<_> = down.iter().map(|(service, _)| service.name()).collect();
        bail!(
            "`{shown}` failed ({status}); services not ready: {}",
            names.join(", ")
        );
    }
    Ok(down
        .into_iter()
        .map(|(service, why)| Attempt {
            service,
            how: "started with docker compose",
            command: shown.clone(),
            note: None,
            last_check: why,
            logs: Vec::new(),
        })
        .collect())
}

fn start_locally(down: Vec<(Service, String)>) -> Result<Vec<Attempt>> {
    let mut attempts = Vec::new();
    for (service, why) in down {
        let mut cmd = service.local_start_command().with_context(|| {
            format!(
                "{} ({}) is not ready ({why}) and cannot be started locally",
                service.name(),
                service.addr()
            )
        })?;
        let shown = display(&cmd);
        // Daemons may inherit stdout/stderr: point them at a file, never at a
        // pipe we would wait on.
        let log = start_log_path(service);
        let out =
            File::create(&log).with_context(|| format!("could not create {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("could not reopen {}", log.display()))?;
        println!(
            "xtask: {} not ready ({why}); running `{shown}`",
            service.name()
        );
        let status = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .status()
            .with_context(|| {
                format!(
                    "{} ({}) is not ready ({why}) and `{shown}` could not be run",
                    service.name(),
                    service.addr()
                )
            })?;
        let note = if status.success() {
            None
        } else {
            let output = fs::read_to_string(&log).unwrap_or_default();
            let note = format!("it failed ({status}); output in {}", log.display());
            // Keep waiting: the server may be starting up already.
            eprintln!("xtask: warning: `{shown}` failed ({status}); waiting anyway");
            for line in output.lines().filter(|l| !l.trim().is_empty()).take(10) {
                eprintln!("    {line}");
            }
            Some(note)
        };
        attempts.push(Attempt {
            service,
            how: "started locally",
            command: shown,
            note,
            last_check: why,
            logs: [Some(log), service.local_log()]
                .into_iter()
                .flatten()
                .collect(),
        });
    }
    Ok(attempts)
}

fn start_log_path(service: Service) -> PathBuf {
    std::env::temp_dir().join(format!("xtask-{}-start.log", service.name()))
}

/// The PostgreSQL version whose cluster to start: the highest-numbered
/// directory in `/etc/postgresql`.
fn postgres_version() -> Result<String> {
    let entries = fs::read_dir(POSTGRES_CONF_DIR)
        .with_context(|| format!("could not list {POSTGRES_CONF_DIR}"))?;
    let mut versions = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("could not list {POSTGRES_CONF_DIR}"))?;
        if entry.path().is_dir() {
            versions.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    versions.sort_by_key(|v| {
        v.split('.')
            .map(|part| part.parse::<u32>().unwrap_or(0))
            .collect::<Vec<_>>()
    });
    versions
        .pop()
        .with_context(|| format!("no PostgreSQL cluster configured in {POSTGRES_CONF_DIR}"))
}

fn wait_until_ready(
    mut pending: Vec<Attempt>,
    began: Instant,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    loop {
        pending.retain_mut(|attempt| match attempt.service.check() {
            Ok(()) => {
                println!(
                    "{}: {}, ready after {:.1} s",
                    attempt.service.name(),
                    attempt.how,
                    began.elapsed().as_secs_f64()
                );
                false
            }
            Err(why) => {
                attempt.last_check = why;
                true
            }
        });
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let mut msg = format!(
                "services not ready after {} s (set --service-timeout or XTASK_SERVICE_TIMEOUT to wait longer):",
                timeout.as_secs()
            );
            for attempt in &pending {
                msg.push_str(&format!(
                    "\n  {} ({}): tried `{}`",
                    attempt.service.name(),
                    attempt.service.addr(),
                    attempt.command
                ));
                if let Some(note) = &attempt.note {
                    msg.push_str(&format!(" ({note})"));
                }
                msg.push_str(&format!("; last check: {}", attempt.last_check));
                for log in &attempt.logs {
                    msg.push_str(&format!(
                        "\n    last lines of {}:{}",
                        log.display(),
                        last_lines(log, 10)
                    ));
                }
            }
            bail!(msg);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// PostgreSQL: `pg_isready` when installed, a TCP connect otherwise.
fn check_postgres(addr: SocketAddr) -> Result<(), String> {
    let status = Command::new("pg_isready")
        .args([
            "-q",
            "-h",
            &addr.ip().to_string(),
            "-p",
            &addr.port().to_string(),
        ])
        .args(["-t", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(match status.code() {
            Some(1) => "pg_isready: server is rejecting connections (starting up?)".to_owned(),
            Some(2) => "pg_isready: no response".to_owned(),
            _ => format!("pg_isready: {status}"),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => connect(addr).map(drop),
        Err(e) => Err(format!("could not run pg_isready: {e}")),
    }
}

/// RabbitMQ: the server must answer the AMQP protocol header with a
/// Connection.Start method frame (type 1, channel 0).
fn check_amqp(addr: SocketAddr) -> Result<(), String> {
    let mut stream = connect(addr)?;
    let deadline = Instant::now() + CHECK_TIMEOUT;
    stream
        .write_all(AMQP_PROTOCOL_HEADER)
        .map_err(|e| format!("AMQP handshake: sending protocol header: {e}"))?;
    let reply = read_until(&mut stream, deadline, |buf| buf.len() >= 7)
        .map_err(|e| format!("AMQP handshake: waiting for Connection.Start: {e}"))?;
    match reply.as_slice() {
        [1, 0, 0, ..] if reply.len() >= 7 => Ok(()),
        [b'A', b'M', b'Q', b'P', ..] => Err(format!(
            "AMQP handshake: server rejected protocol 0-9-1 (replied {:?})",
            String::from_utf8_lossy(&reply)
        )),
        _ => Err(format!(
            "AMQP handshake: expected a Connection.Start frame, got {} byte(s) {:02x?}",
            reply.len(),
            &reply[..reply.len().min(16)]
        )),
    }
}

/// MariaDB / MySQL: the server greets every client with a handshake packet (a 4-byte
/// header, then protocol version 10); a server that refuses clients (too many
/// connections, a blocked host) sends an error packet (`0xff`) instead.
fn check_mysql(addr: SocketAddr) -> Result<(), String> {
    let mut stream = connect(addr)?;
    let deadline = Instant::now() + CHECK_TIMEOUT;
    let greeting = read_until(&mut stream, deadline, |buf| buf.len() >= 5)
        .map_err(|e| format!("MySQL handshake: waiting for the greeting: {e}"))?;
    match greeting.get(4) {
        Some(10) => Ok(()),
        Some(0xff) => Err(format!(
            "MySQL handshake: the server refused: {:?}",
            String::from_utf8_lossy(&greeting[greeting.len().min(7)..])
        )),
        _ => Err(format!(
            "MySQL handshake: expected protocol 10, got {} byte(s) {:02x?}",
            greeting.len(),
            &greeting[..greeting.len().min(16)]
        )),
    }
}

/// NATS: the server greets every client with an `INFO {...}` line.
fn check_nats(addr: SocketAddr) -> Result<(), String> {
    let mut stream = connect(addr)?;
    let deadline = Instant::now() + CHECK_TIMEOUT;
    let greeting = read_until(&mut stream, deadline, |buf| buf.contains(&b'\n'))
        .map_err(|e| format!("NATS: waiting for INFO: {e}"))?;
    if greeting.starts_with(b"INFO ") {
        Ok(())
    } else {
        let shown = String::from_utf8_lossy(&greeting[..greeting.len().min(60)]).into_owned();
        Err(format!("NATS: expected an INFO line, got {shown:?}"))
    }
}

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect_timeout(&addr, CHECK_TIMEOUT)
        .map_err(|e| format!("TCP connect to {addr}: {e}"))?;
    stream
        .set_write_timeout(Some(CHECK_TIMEOUT))
        .map_err(|e| format!("TCP {addr}: {e}"))?;
    Ok(stream)
}

/// Reads until `done` holds for what was read, the peer closes, or the
/// deadline passes (an error unless `done` holds).
fn read_until(
    stream: &mut TcpStream,
    deadline: Instant,
    done: impl Fn(&[u8]) -> bool,
) -> Result<Vec<u8>, String> {
    const MAX: usize = 64 * 1024;
    let mut buf = Vec::new();
    let mut chunk = [0_u8; 1024];
    while !done(&buf) && buf.len() < MAX {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out after {} s", CHECK_TIMEOUT.as_secs()));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        match stream.read(&mut chunk) {
            Ok(0) if buf.is_empty() => return Err("connection closed without a reply".to_owned()),
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("timed out after {} s", CHECK_TIMEOUT.as_secs()));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A one-shot server on an ephemeral port that reads a little, replies
    /// with `reply`, then closes.
    fn fake_server(reply: &'static [u8], read_first: usize) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        thread::spawn(move || {
            if let Ok((mut conn, _)) = listener.accept() {
                let mut got = vec![0_u8; read_first];
                let _ = conn.read_exact(&mut got);
                let _ = conn.write_all(reply);
            }
        });
        addr
    }

    #[test]
    fn amqp_connection_start_is_ready() {
        // Frame type 1, channel 0, size, then class 10 method 10.
        let addr = fake_server(b"\x01\x00\x00\x00\x00\x01\x00\x00\x0a\x00\x0a", 8);
        assert_eq!(check_amqp(addr), Ok(()));
    }

    #[test]
    fn amqp_protocol_mismatch_is_not_ready() {
        let addr = fake_server(b"AMQP\x00\x00\x09\x01", 8);
        let err = check_amqp(addr).expect_err("not ready");
        assert!(err.contains("rejected"), "{err}");
    }

    #[test]
    fn amqp_silent_close_is_not_ready() {
        let addr = fake_server(b"", 8);
        assert!(check_amqp(addr).is_err());
    }

    #[test]
    fn mysql_handshake_is_ready_and_an_error_packet_is_not() {
        let addr = fake_server(b"\x4a\x00\x00\x00\x0a10.11.19-MariaDB\x00", 0);
        assert_eq!(check_mysql(addr), Ok(()));
        let addr = fake_server(b"\x17\x00\x00\x00\xff\x10\x04Too many connections", 0);
        let err = check_mysql(addr).expect_err("not ready");
        assert!(err.contains("refused"), "{err}");
    }

    #[test]
    fn nats_info_line_is_ready() {
        let addr = fake_server(b"INFO {\"server_id\":\"x\"}\r\n", 0);
        assert_eq!(check_nats(addr), Ok(()));
    }

    #[test]
    fn nats_other_greeting_is_not_ready() {
        let addr = fake_server(b"-ERR 'nope'\r\n", 0);
        let err = check_nats(addr).expect_err("not ready");
        assert!(err.contains("INFO"), "{err}");
    }

    #[test]
    fn closed_port_is_not_ready() {
        let addr = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr")
        };
        assert!(check_nats(addr).is_err());
        assert!(check_amqp(addr).is_err());
    }
}
