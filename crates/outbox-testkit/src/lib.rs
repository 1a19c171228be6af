//! # outboxkit-testkit
//!
//! Test support shared by the SQL backends' integration tests (not published):
//!
//! - [`rabbit`]: an isolated exchange and queue per test on the real RabbitMQ, and raw
//!   lapin consumers that record what arrived;
//! - [`faults`]: faults injected into the shared servers (RabbitMQ memory alarm,
//!   `max_message_size`, a queue held full, node stopped or frozen; NATS frozen or
//!   stopped; PostgreSQL or MariaDB / MySQL stopped), each undone on drop, under one
//!   machine-wide lock (also used by `cargo xtask chaos`);
//! - [`pg`]: a PostgreSQL outage for one consumer only (a role of its own, locked out
//!   and let in again);
//! - [`slot`]: a logical replication slot invalidated by PostgreSQL, or its WAL
//!   removed from `pg_wal` (under the fault lock);
//! - [`ordered`]: the ordered-delivery suite (dispatcher in `Ordering::PerKey` mode,
//!   a real broker, a consumer checking every key's order), generic over the
//!   conformance [`Harness`](outboxkit_core::conformance::Harness) and the
//!   [`Broker`](ordered::Broker), expanded by [`ordered_delivery_tests!`] over both
//!   RabbitMQ and NATS JetStream.
//!
//! ```ignore
//! async fn harness() -> MyHarness { /* fresh schema */ }
//! // mod ordered_delivery { mod rabbit { .. } mod nats { .. } }
//! outboxkit_testkit::ordered_delivery_tests!(harness);
//! ```

pub mod cluster;
pub mod faults;
pub mod ordered;
pub mod pg;
pub mod rabbit;
pub mod slot;

/// Runs `work` on a current-thread runtime on a thread of its own, for a guard's `Drop`
/// that must do I/O while the test's runtime unwinds (a runtime cannot block inside
/// another); whether it ended without a panic.
pub fn on_own_runtime(work: impl Future<Output = ()> + Send + 'static) -> bool {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(work);
    })
    .join()
    .is_ok()
}

/// Says that a test left something behind (`what`, one line), on the process's real
/// standard error: the test harness captures `eprintln!` of a passing test, and a
/// leftover of a passing test is exactly what would go unnoticed (an empty `t_*` schema
/// after a whole `cargo xtask itest`, twice, its test not found).
pub fn leftover(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "outboxkit-testkit: {what}");
}
