//! The outboxkit-core store conformance suite (every property, the ordered ones included),
//! run against a real SQL Server: ignored unless run with `--ignored` and `MSSQL_URL`
//! set.

mod common;

use common::harness;

outboxkit_core::store_conformance_tests!(
    #[ignore = "needs MSSQL_URL"]
    harness
);
