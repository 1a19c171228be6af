//! The outbox-core store conformance suite (every property, the ordered ones included),
//! run against a real SQL Server when `MSSQL_URL` is set; otherwise each property
//! prints that it was skipped and asserts nothing.

mod common;

use common::harness;

outbox_core::store_conformance_tests!(optional harness);
