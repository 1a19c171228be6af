//! Faults injected into the shared servers, for the tests that need them: a RabbitMQ
//! memory alarm, a RabbitMQ `max_message_size` lower than the publisher's, a RabbitMQ
//! node stopped, and a NATS server frozen with `SIGSTOP`.
//!
//! Every guard undoes its fault when dropped, also when the test panics. They must be
//! taken under [`lock`]: one lock for the whole machine (an exclusive `flock` on a file
//! in the temporary directory, which also excludes the other tests of this process), so
//! two faults never overlap and a fault test never disturbs another one.
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

/// Takes the machine-wide fault lock, waiting for whoever holds it.
///
/// # Panics
/// When the lock file cannot be opened or locked.
pub async fn lock() -> FaultLock {
    let path = std::env::temp_dir().join("outbox-shared-server-faults.lock");
    tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        file.lock()
            .unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
        FaultLock { _file: file }
    })
    .await
    .expect("lock task")
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

fn local_rabbitmqctl() -> bool {
    succeeds("rabbitmqctl", &["-q", "status"])
}

/// Runs `rabbitmqctl ARGS` on the local node, or in the compose service.
fn rabbitmqctl(args: &[&str]) -> Option<String> {
    if local_rabbitmqctl() {
        output("rabbitmqctl", args)
    } else {
        let mut all = vec!["compose", "exec", "-T", "rabbitmq", "rabbitmqctl"];
        all.extend_from_slice(args);
        output("docker", &all)
    }
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn memory_alarm_active() -> bool {
    rabbitmqctl(&["-q", "eval", "rabbit_alarm:get_alarms()."])
        .is_some_and(|alarms| alarms.contains("memory"))
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
        let previous = rabbitmqctl(&[
            "-q",
            "eval",
            "vm_memory_monitor:get_vm_memory_high_watermark().",
        ])
        .filter(|v| v.parse::<f64>().is_ok())
        .unwrap_or_else(|| "0.4".to_owned());
        let alarm = Self { previous };
        assert!(
            rabbitmqctl(&["-q", "set_vm_memory_high_watermark", "0.0001"]).is_some(),
            "rabbitmqctl set_vm_memory_high_watermark failed"
        );
        wait_for(
            "the memory alarm is raised",
            Duration::from_secs(30),
            memory_alarm_active,
        );
        alarm
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
/// PRECONDITION_FAILED`). Dropping it restores the previous value.
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
        let previous = rabbitmqctl(&[
            "-q",
            "eval",
            "{ok, N} = application:get_env(rabbit, max_message_size), N.",
        ])
        .filter(|v| v.parse::<u64>().is_ok())
        .unwrap_or_else(|| "134217728".to_owned());
        let set = format!("application:set_env(rabbit, max_message_size, {bytes}).");
        assert!(
            rabbitmqctl(&["-q", "eval", &set]).is_some(),
            "rabbitmqctl eval application:set_env failed"
        );
        Self { previous }
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
        if succeeds("rabbitmqctl", &["-q", "stop_app"]) {
            return Self { docker: false };
        }
        if succeeds("docker", &["info"]) && succeeds("docker", &["compose", "stop", "rabbitmq"]) {
            return Self { docker: true };
        }
        panic!(
            "cannot stop RabbitMQ: neither `rabbitmqctl stop_app` nor `docker compose stop rabbitmq` worked"
        );
    }

    /// Starts the broker again now (dropping the guard does it too).
    ///
    /// # Panics
    /// When the broker does not start.
    pub fn end(self) {
        // Drop does the work.
    }

    fn start(&self) {
        let ok = if self.docker {
            succeeds("docker", &["compose", "start", "rabbitmq"])
        } else {
            succeeds("rabbitmqctl", &["-q", "start_app"])
        };
        assert!(ok, "failed to restart RabbitMQ");
        wait_for("RabbitMQ answers", Duration::from_secs(60), || {
            std::net::TcpStream::connect("127.0.0.1:5672").is_ok()
        });
    }
}

impl Drop for RabbitStopped {
    fn drop(&mut self) {
        self.start();
    }
}

/// The NATS server frozen with `SIGSTOP` (or `docker compose pause nats`): it keeps
/// its connections open but answers nothing, as a server stalled by a long GC pause,
/// a full disk or an overloaded host does. Dropping it sends `SIGCONT`.
#[derive(Debug)]
pub struct NatsFrozen {
    how: Freeze,
}

#[derive(Debug)]
enum Freeze {
    Pid(String),
    Docker,
}

impl NatsFrozen {
    /// Freezes the server.
    ///
    /// # Panics
    /// When no local `nats-server` process is found and `docker compose pause nats`
    /// fails.
    pub fn freeze() -> Self {
        if let Some(pid) = output("pgrep", &["-x", "nats-server"])
            .and_then(|pids| pids.lines().next().map(str::to_owned))
        {
            assert!(
                succeeds("kill", &["-STOP", &pid]),
                "kill -STOP {pid} failed"
            );
            return Self {
                how: Freeze::Pid(pid),
            };
        }
        assert!(
            succeeds("docker", &["compose", "pause", "nats"]),
            "no local nats-server process, and `docker compose pause nats` failed"
        );
        Self {
            how: Freeze::Docker,
        }
    }

    /// Continues the server now (dropping the guard does it too).
    pub fn thaw(self) {}
}

impl Drop for NatsFrozen {
    fn drop(&mut self) {
        let ok = match &self.how {
            Freeze::Pid(pid) => succeeds("kill", &["-CONT", pid]),
            Freeze::Docker => succeeds("docker", &["compose", "unpause", "nats"]),
        };
        assert!(
            ok || std::thread::panicking(),
            "failed to continue the NATS server"
        );
    }
}
