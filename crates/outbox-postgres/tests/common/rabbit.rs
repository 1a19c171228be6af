//! RabbitMQ fixtures, shared with the other backends through `outbox-testkit`.
#![allow(unused_imports, unreachable_pub)] // reason: each test binary uses a different subset

pub use outbox_testkit::rabbit::*;
