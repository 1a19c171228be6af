//! The outboxkit-core store conformance suite, run against the real MariaDB / MySQL at
//! `MYSQL_URL`: every property, the ordered ones included, a fresh database each.

mod common;
use common::harness;

outboxkit_core::store_conformance_tests!(harness);
