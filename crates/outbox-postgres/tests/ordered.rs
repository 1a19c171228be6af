//! Ordered delivery per partition key, end to end on the real PostgreSQL over each
//! broker, RabbitMQ and NATS JetStream: the shared suite of `outboxkit-testkit` (a real
//! consumer reads the broker and checks every key's order), run against this backend
//! (`ordered_delivery::rabbit::*` and `ordered_delivery::nats::*`).

mod common;

use common::harness;

outboxkit_testkit::ordered_delivery_tests!(harness);
