//! The ordered-delivery suite of `outboxkit-testkit` (dispatcher in per-key mode, the real
//! RabbitMQ and NATS JetStream, a consumer checking every key's order), run against a
//! real SQL Server over each broker: ignored unless run with `--ignored` and `MSSQL_URL`
//! set.

mod common;

use common::harness;

outboxkit_testkit::ordered_delivery_tests!(
    #[ignore = "needs MSSQL_URL"]
    harness
);
