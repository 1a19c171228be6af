//! Ordered delivery per partition key, end to end on the real PostgreSQL and RabbitMQ:
//! the shared suite of `outbox-testkit` (a real consumer reads the broker and checks
//! every key's order), run against this backend.

mod common;

use common::harness;

outbox_testkit::ordered_delivery_tests!(harness);
