//! The outboxkit-core store conformance suite, run against the real PostgreSQL.

mod common;
use common::harness;

outboxkit_core::store_conformance_tests!(harness);
