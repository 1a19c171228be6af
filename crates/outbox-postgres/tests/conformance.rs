//! The outbox-core store conformance suite, run against the real PostgreSQL.

mod common;
use common::harness;

outbox_core::store_conformance_tests!(harness);
