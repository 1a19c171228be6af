//! The ordered-delivery suite of `outbox-testkit` (dispatcher in per-key mode, the real
//! RabbitMQ and NATS JetStream, a consumer checking every key's order), run against a
//! real SQL Server over each broker when `MSSQL_URL` is set; otherwise each test prints
//! that it was skipped and asserts nothing (and creates nothing on the brokers).

mod common;

use common::harness;

outbox_testkit::ordered_delivery_tests!(optional harness);
